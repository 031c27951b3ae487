"""rlsched's draft policies inside vLLM: a scheduler that asks a DraftPolicy every step.

The seam is vLLM's scheduler (`scheduler_cls`), where vLLM itself picks the draft length of
its batch-size table (`num_speculative_tokens_per_batch_size`): every `schedule()` returns
`num_spec_tokens_to_schedule`, how many tokens the model runner drafts for each running
request after this step's forward, and those drafts are verified in the next step by vLLM's
rejection sampler. `PolicyScheduler` sets that number from the policy's Strategy instead,
per step; a per-request Strategy (`k_per_row`) is applied when the drafts come back
(`update_draft_token_ids`), where each request's list is cut to its own length (0: it decodes
plain in the next step). Cutting a chain keeps its prefix and the draft probabilities of that
prefix, so verification stays lossless. A custom proposer would see the same numbers but not
the batch, the queue or the KV cache; a wrapper of the runner's propose step alone could not
shorten the verify. With k = 0 for a whole step the drafter still runs its one forward over
the step's new tokens (vLLM keeps its KV cache in sync), so an off step costs a feed.

The policy sees the same `EngineState` as in rlsched's engine: the requests that produce a
token in this step, their context lengths, the waiting queue, the free KV tokens and the
shared `AcceptanceEstimator`, fed after every verify with each request's drafted and accepted
counts (`update_from_output`). `StepOutcome`s reach `policy.observe`.

Step records: the hook times the model step (from `schedule()` returning to
`update_from_output()`) and the runner's propose call (`install_draft_clock`, a wrapper on
the runner reached through `LLM.collective_rpc`; the engine runs in-process), and writes one
record per engine step in the shared step schema. A record pairs a verify with the drafting
that produced its drafts (in the previous step), as rlsched's engine does: `k` is the longest
chain verified, `draft_ms` the propose call that drafted it (with k = 0, the drafter's feed),
`verify_ms` the rest of the step.
Steps that prefill prompt tokens are recorded as `prefill` (nothing verified) or `mixed`.
"""

from __future__ import annotations

import time

import numpy as np

from rlsched.executor.engine.recorder import step_record
from rlsched.policies.types import EngineState, StepOutcome, Strategy


class StepHook:
    """The policy side of one vLLM engine: the policy, the estimator, the request -> sample
    index map of the current rollout, and the step records. With `policy` None the hook only
    watches: vLLM keeps its own draft length, the estimator and the records are fed alike."""

    def __init__(self, policy, estimator, drafter: str, k_max: int, *, instance: int = 0, prober=None, record=None):
        self.policy, self.estimator, self.drafter, self.k_max = policy, estimator, drafter, k_max
        self.instance, self.prober, self.record = instance, prober, record
        self.needs_acceptance = policy is None or getattr(policy, "needs_acceptance", True)
        self.observes = policy is not None and getattr(policy, "observes", True)
        self.index_of: dict[str, int] = {}  # vLLM's request id -> the sample's index in the rollout
        self._expect: int | None = None
        self.counts: dict[int, list[int]] = {}  # per sample: drafted, accepted, rejected, verify steps
        self.step = 0
        self.draft_s = 0.0  # the runner's propose call of the current step (install_draft_clock)
        self._ids = np.zeros(0, dtype=np.int64)
        self._k_of: dict[str, int] = {}  # the chain length chosen for each request's next drafts
        self._next = (None, Strategy())  # (state, strategy) of the drafts proposed in this step
        self._pending = None  # (state, strategy, draft seconds) of the drafts the next step verifies
        self._t_step = 0.0
        self._t0 = time.perf_counter()
        self.rl_step = 0
        self.hook_s = 0.0  # seconds spent in the hook itself (choosing, learning, recording)
        self.chosen: list[int] = []  # each step's longest chosen chain (what the policy asked for)

    # --- the rollout -----------------------------------------------------------------------

    def begin(self, prompt_of: np.ndarray, rl_step: int = 0) -> None:
        """A new rollout of len(prompt_of) samples, added to vLLM in this order."""
        self.estimator.retire(self._ids)
        self.estimator.begin_rollout(len(prompt_of), np.asarray(prompt_of, dtype=np.int64))
        self.index_of.clear()
        self.counts.clear()
        self._ids = np.zeros(0, dtype=np.int64)
        self._k_of, self._pending = {}, None
        self.rl_step, self.step, self.hook_s, self._t0 = rl_step, 0, 0.0, time.perf_counter()

    def end(self) -> None:
        self.estimator.retire(self._ids)

    def expect(self, index: int) -> None:
        """The next request vLLM admits is sample `index` (else requests are numbered in the
        order they arrive)."""
        self._expect = index

    def admit(self, request) -> None:
        index = len(self.index_of) if self._expect is None else self._expect
        self.index_of.setdefault(request.request_id, index)
        self._expect = None

    def take_counts(self, index: int) -> list[int]:
        """Sample `index`'s chain counts (drafted, accepted, rejected, verify steps), removed."""
        return self.counts.pop(index, [0, 0, 0, 0])

    def add_counts(self, index: int, counts) -> None:
        mine = self.counts.setdefault(index, [0, 0, 0, 0])
        for j, c in enumerate(counts):
            mine[j] += int(c)

    # --- one engine step -------------------------------------------------------------------

    def before_step(self, scheduler, out) -> None:
        """After vLLM scheduled this step: choose the drafts proposed after it."""
        t_in = time.perf_counter()
        rows, ctx, room = [], [], []
        for req_id, n in out.num_scheduled_tokens.items():
            r = scheduler.requests.get(req_id)
            if r is None or req_id not in self.index_of:
                continue
            after = r.num_computed_tokens + n  # tokens in the KV cache once this step ran
            if after < r.num_prompt_tokens:
                continue  # a prompt chunk: no token comes out of this step
            rows.append(req_id)
            ctx.append(after)
            room.append(r.max_tokens - r.num_output_tokens - 2)  # drafts a next step could keep
        ids = np.array([self.index_of[q] for q in rows], dtype=np.int64)
        if not np.array_equal(ids, self._ids):  # the estimator keys pending counts by the array
            self.estimator.retire(self._ids)
            self._ids = ids
        ctx = np.asarray(ctx, dtype=np.int64)
        pool = scheduler.kv_cache_manager.block_pool
        state = EngineState(
            self.instance,
            self.step,
            time.perf_counter() - self._t0,
            self._ids,
            ctx,
            int(ctx.sum()),
            len(scheduler.waiting),
            pool.get_num_free_blocks() * scheduler.block_size,
            self.estimator,
        )
        self._next = (state, None)
        self.draft_s = 0.0
        if self.policy is not None:  # else vLLM's own choice (num_speculative_tokens or its batch-size table)
            self._choose(state, rows, room, out)
        self._t_step = time.perf_counter()
        self.hook_s += self._t_step - t_in

    def _choose(self, state: EngineState, rows: list[str], room: list[int], out) -> None:
        strategy = self.policy.choose(state) if len(rows) else Strategy()
        if self.prober is not None and len(rows):
            strategy = self.prober(strategy)
        if strategy.width != 1:
            raise ValueError(f"strategy {strategy.label}: vLLM drafts chains, not trees")
        ks = strategy.row_lengths(room, self.k_max)
        self._k_of = dict(zip(rows, ks.tolist()))
        k = int(ks.max(initial=0))
        out.num_spec_tokens_to_schedule = k
        self.chosen.append(k)
        self._next = (state, strategy)

    def trim(self, draft) -> None:
        """Cut each request's drafts to the length chosen for it."""
        for i, (req_id, toks) in enumerate(zip(draft.req_ids, draft.draft_token_ids)):
            k = self._k_of.get(req_id)
            if k is not None and len(toks) > k:
                draft.draft_token_ids[i] = toks[:k]

    def after_step(self, scheduler_output, runner_output) -> None:
        """The step ran: feed the estimator and the policy, write the step record."""
        t_in = time.perf_counter()
        step_s = t_in - self._t_step
        spec = scheduler_output.scheduled_spec_decode_tokens
        index = runner_output.req_id_to_index
        sampled = runner_output.sampled_token_ids
        rows = [q for q in scheduler_output.num_scheduled_tokens if q in self.index_of and q in index]
        verified = [q for q in rows if spec.get(q)]
        dk = np.array([sum(t >= 0 for t in spec[q]) for q in verified], dtype=np.int64)
        acc = np.array([max(0, len(sampled[index[q]]) - 1) for q in verified], dtype=np.int64)
        acc = np.minimum(acc, dk)
        emitted = sum(len(sampled[index[q]]) for q in rows)
        prev, self._pending = self._pending, (*self._next, self.draft_s)
        for q, d, a in zip(verified, dk.tolist(), acc.tolist()):
            self.add_counts(self.index_of[q], (d, a, int(a < d), 1))
        if prev is not None:
            self._learn(prev, verified, rows, dk, acc, emitted, step_s)
        if self.record is not None:
            self._record(scheduler_output, prev, rows, dk, acc, emitted, step_s)
        self.step += 1
        self.hook_s += time.perf_counter() - t_in

    def _learn(self, prev, verified, rows, dk, acc, emitted: int, step_s: float) -> None:
        """Feed the estimator and the policy what the step verified of the drafts chosen before
        it (`prev`: their state, strategy and draft seconds)."""
        state, strategy, draft_s = prev
        drafted, n_acc = int(dk.sum()), int(acc.sum())
        if drafted:
            ids = np.array([self.index_of[q] for q in verified], dtype=np.int64)
            if self.needs_acceptance:
                self.estimator.update(self.drafter, ids, acc, dk)
            if self.observes:
                verify_s = step_s - self.draft_s
                self.policy.observe(
                    StepOutcome(
                        self.instance,
                        state.step,
                        strategy,
                        len(verified),
                        drafted,
                        n_acc,
                        emitted,
                        verify_s + draft_s,
                        draft_s,
                        verify_s,
                        ids,
                        acc,
                    )
                )
        elif self.observes:
            self.policy.observe(
                StepOutcome(
                    self.instance,
                    state.step,
                    strategy,
                    len(rows),
                    0,
                    0,
                    emitted,
                    step_s,
                    self.draft_s,
                    step_s - self.draft_s,
                )
            )

    def _record(self, scheduler_output, prev, rows, dk, acc, emitted: int, step_s: float) -> None:
        """The step record: a verify paired with the drafting that produced its drafts."""
        spec = scheduler_output.scheduled_spec_decode_tokens
        scheduled = scheduler_output.num_scheduled_tokens
        prefill = sum(1 for q, n in scheduled.items() if n > 1 + len(spec.get(q, ())))
        kind = "decode" if not prefill else ("prefill" if prefill == len(scheduled) else "mixed")
        draft_ms = (prev[2] if prev is not None else 0.0) * 1e3  # with k = 0: the drafter's feed
        verify_ms = (step_s - self.draft_s) * 1e3
        ctx = int(sum(scheduled.values())) if kind == "prefill" else int(self._next[0].ctx_tokens)
        drafted = int(dk.sum())
        # fmt: off
        self.record(step_record(
            self.rl_step, self.instance, self.step, self._t_step - self._t0, kind, len(rows),
            self.drafter if drafted else "off", int(dk.max(initial=0)), 1, drafted, int(acc.sum()), emitted,
            draft_ms, verify_ms, draft_ms + verify_ms, ctx,
        ))
        # fmt: on


def scheduler_class():
    """vLLM's scheduler with a `hook` (a StepHook, attached after start-up; None: vLLM as is)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    class PolicyScheduler(Scheduler):
        hook: StepHook | None = None

        def add_request(self, request) -> None:
            if self.hook is not None:
                self.hook.admit(request)
            super().add_request(request)

        def schedule(self, *args, **kwargs):
            out = super().schedule(*args, **kwargs)
            if self.hook is not None and out.total_num_scheduled_tokens > 0:
                self.hook.before_step(self, out)
            return out

        def update_from_output(self, scheduler_output, model_runner_output):
            if self.hook is not None and scheduler_output.total_num_scheduled_tokens > 0:
                self.hook.after_step(scheduler_output, model_runner_output)
            return super().update_from_output(scheduler_output, model_runner_output)

        def update_draft_token_ids(self, draft_token_ids) -> None:
            if self.hook is not None:
                self.hook.trim(draft_token_ids)
            super().update_draft_token_ids(draft_token_ids)

    return PolicyScheduler


def install_draft_clock(llm, hook: StepHook) -> None:
    """Time the model runner's propose call into `hook.draft_s` (in-process engine only)."""

    def wrap(worker, hook):
        runner = worker.model_runner
        propose = getattr(runner, "_rlsched_propose", None) or runner.propose_draft_token_ids
        runner._rlsched_propose = propose

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return propose(*args, **kwargs)
            finally:
                hook.draft_s += time.perf_counter() - t

        runner.propose_draft_token_ids = timed

    llm.collective_rpc(wrap, args=(hook,))


def attach(llm, hook: StepHook) -> None:
    """Give `llm`'s PolicyScheduler its hook and time its drafting."""
    core = llm.llm_engine.engine_core
    scheduler = getattr(core, "engine_core", core).scheduler
    if not hasattr(type(scheduler), "hook"):
        raise RuntimeError("the vLLM engine was not started with rlsched's scheduler_class()")
    scheduler.hook = hook
    install_draft_clock(llm, hook)
