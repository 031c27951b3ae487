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
`update_from_output()`) and the runner's propose calls (`plugin.py`: the seconds travel with
the runner's output, from whichever process runs it), and writes one
record per engine step in the shared step schema. A record pairs a verify with the drafting
that produced its drafts (in the previous step), as rlsched's engine does: `k` is the longest
chain verified, `draft_ms` the propose calls that drafted it (with k = 0, the drafter's feed;
NaN where the runner's drafting was not timed), `verify_ms`
the rest of the step; its counts by draft position (`accepted_by_position`,
`tried_by_position`, `drafted_by_position`, `recorder.position_counts`) are over the requests
that had drafts verified, each by its own draft length. What a step chose is kept by its
scheduler output, so the pairing holds with async scheduling too, where the next step is
scheduled before this one's output is in.
Steps that prefill prompt tokens are recorded as `prefill` (nothing verified) or `mixed`.
"""

from __future__ import annotations

import time

import numpy as np

from rlsched.executor.engine.recorder import position_counts, step_record
from rlsched.executor.vllm.plugin import draft_seconds
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
        self.step = 0  # engine steps whose output came back
        self.scheduled = 0  # engine steps scheduled (one ahead of `step` under async scheduling)
        self._ids = np.zeros(0, dtype=np.int64)
        self._k_of: dict[str, int] = {}  # the chain length chosen for each request's next drafts
        self._chosen: dict[int, tuple] = {}  # id(scheduler output) -> (state, strategy, time scheduled)
        self._pending = None  # (state, strategy, draft seconds) of the drafts the next step verifies
        self._t0 = time.perf_counter()
        self.rl_step = 0
        self.hook_s = 0.0  # seconds spent in the hook itself (choosing, learning, recording)
        self.chosen: list[int] = []  # each step's longest chosen chain (what the policy asked for)

    # --- the rollout -----------------------------------------------------------------------

    def begin(self, prompt_of: np.ndarray, rl_step: int = 0) -> None:
        """A new rollout of len(prompt_of) samples, added to vLLM in this order."""
        self.fresh_samples(prompt_of)
        self.rl_step, self.step, self.scheduled, self.hook_s = rl_step, 0, 0, 0.0
        self._t0 = time.perf_counter()

    def fresh_samples(self, prompt_of: np.ndarray) -> None:
        """Per-sample state starts afresh for len(prompt_of) samples (the drafters' running
        acceptance carries on)."""
        self.estimator.retire(self._ids)
        self.estimator.begin_rollout(len(prompt_of), np.asarray(prompt_of, dtype=np.int64))
        self.index_of.clear()
        self.counts.clear()
        self._ids = np.zeros(0, dtype=np.int64)
        self._k_of, self._pending, self._chosen = {}, None, {}

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
        chunks = [0, 0, 0]  # prompt chunks' tokens and sum of c (c + 2 cached); rows not in a prompt
        for req_id, n in out.num_scheduled_tokens.items():
            r = scheduler.requests.get(req_id)
            if r is None or req_id not in self.index_of:
                continue
            done, after = r.num_computed_tokens, r.num_computed_tokens + n  # in the KV cache before, after
            if done < r.num_prompt_tokens:
                c = min(n, r.num_prompt_tokens - done)
                chunks[0], chunks[1] = chunks[0] + c, chunks[1] + c * (c + 2 * done)
                if after < r.num_prompt_tokens:
                    continue  # no token comes out of this step
                chunks[2] -= 1  # the last chunk emits the first token: a row, not a decode row
            rows.append(req_id)
            ctx.append(after)
            room.append(r.max_tokens - r.num_output_tokens - 2)  # drafts a next step could keep
        chunks[2] += len(rows)
        ids = np.array([self.index_of[q] for q in rows], dtype=np.int64)
        if not np.array_equal(ids, self._ids):  # the estimator keys pending counts by the array
            self.estimator.retire(self._ids)
            self._ids = ids
        ctx = np.asarray(ctx, dtype=np.int64)
        pool = scheduler.kv_cache_manager.block_pool
        state = EngineState(
            self.instance,
            self.scheduled,
            time.perf_counter() - self._t0,
            self._ids,
            ctx,
            int(ctx.sum()),
            len(scheduler.waiting),
            pool.get_num_free_blocks() * scheduler.block_size,
            self.estimator,
        )
        strategy = None
        if self.policy is not None:  # else vLLM's own choice (num_speculative_tokens or its batch-size table)
            strategy = self._choose(state, rows, room, out)
        self.scheduled += 1
        t_step = time.perf_counter()
        self._chosen[id(out)] = (state, strategy, t_step, t_step - t_in, chunks)
        self.hook_s += t_step - t_in

    def _choose(self, state: EngineState, rows: list[str], room: list[int], out) -> Strategy:
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
        return strategy

    def trim(self, draft) -> None:
        """Cut each request's drafts to the length chosen for it."""
        for i, (req_id, toks) in enumerate(zip(draft.req_ids, draft.draft_token_ids)):
            k = self._k_of.get(req_id)
            if k is not None and len(toks) > k:
                draft.draft_token_ids[i] = toks[:k]

    def after_step(self, scheduler_output, runner_output) -> None:
        """The step ran: feed the estimator and the policy, write the step record."""
        t_in = time.perf_counter()
        state, strategy, t_step, before_s, chunks = self._chosen.pop(
            id(scheduler_output), (None, None, t_in, 0.0, None)
        )
        timed = draft_seconds(runner_output)  # this step's drafting (None: not timed where the runner runs)
        step_s, draft_s = t_in - t_step, timed or 0.0
        spec = scheduler_output.scheduled_spec_decode_tokens
        index = runner_output.req_id_to_index
        sampled = runner_output.sampled_token_ids
        rows = [q for q in scheduler_output.num_scheduled_tokens if q in self.index_of and q in index]
        verified = [q for q in rows if spec.get(q)]
        # drafts verified: as vLLM counts them, each request's scheduled spec tokens (under async
        # scheduling placeholders, -1, that the runner fills) less those a grammar invalidated
        invalid = getattr(scheduler_output, "num_invalid_spec_tokens", None) or {}
        dk = np.array([len(spec[q]) - invalid.get(q, 0) for q in verified], dtype=np.int64)
        acc = np.array([max(0, len(sampled[index[q]]) - 1) for q in verified], dtype=np.int64)
        acc = np.minimum(acc, dk)
        emitted = sum(len(sampled[index[q]]) for q in rows)
        prev, self._pending = self._pending, (state, strategy, None if timed is None else draft_s)
        for q, d, a in zip(verified, dk.tolist(), acc.tolist()):
            self.add_counts(self.index_of[q], (d, a, int(a < d), 1))
        if prev is not None and prev[0] is not None:
            self._learn(prev, verified, rows, dk, acc, emitted, step_s, draft_s)
        if self.record is not None:
            split = timed is not None and (prev is None or prev[2] is not None)  # both drafts timed
            draft = draft_s if split else None
            hook_ms = (before_s + time.perf_counter() - t_in) * 1e3  # choosing and learning, this step
            record = self._record(scheduler_output, prev, state, rows, dk, acc, emitted, step_s, draft, t_step)
            record["hook_ms"] = hook_ms  # (beside the schema's columns, as the three below)
            if chunks is not None:  # prompt tokens computed, their attention's size, rows not in a prompt
                record.update(prompt_tokens=chunks[0], prompt_sq=chunks[1], decode_rows=chunks[2])
            self.record(record)
        self.step += 1
        self.hook_s += time.perf_counter() - t_in

    def _learn(self, prev, verified, rows, dk, acc, emitted: int, step_s: float, now_draft_s: float) -> None:
        """Feed the estimator and the policy what the step verified of the drafts chosen before
        it (`prev`: their state, strategy and draft seconds; `now_draft_s`: this step's drafting)."""
        state, strategy, draft_s = prev
        draft_s = draft_s or 0.0
        drafted, n_acc = int(dk.sum()), int(acc.sum())
        if drafted:
            ids = np.array([self.index_of[q] for q in verified], dtype=np.int64)
            if self.needs_acceptance:
                self.estimator.update(self.drafter, ids, acc, dk)
            if self.observes:
                verify_s = step_s - now_draft_s
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
                    now_draft_s,
                    step_s - now_draft_s,
                )
            )

    def _record(self, scheduler_output, prev, state, rows, dk, acc, emitted, step_s, draft_s, t_step) -> dict:
        """The step record: a verify paired with the drafting that produced its drafts."""
        spec = scheduler_output.scheduled_spec_decode_tokens
        scheduled = scheduler_output.num_scheduled_tokens
        prefill = sum(1 for q, n in scheduled.items() if n > 1 + len(spec.get(q, ())))
        kind = "decode" if not prefill else ("prefill" if prefill == len(scheduled) else "mixed")
        if draft_s is None:  # drafting not timed where the runner runs: the step is not split
            draft_ms = verify_ms = float("nan")
            step_ms = step_s * 1e3
        else:
            draft_ms = (prev[2] if prev is not None else 0.0) * 1e3  # with k = 0: the drafter's feed
            verify_ms = (step_s - draft_s) * 1e3
            step_ms = draft_ms + verify_ms
        ctx = int(sum(scheduled.values())) if kind == "prefill" or state is None else int(state.ctx_tokens)
        drafted = int(dk.sum())
        # fmt: off
        record = step_record(
            self.rl_step, self.instance, self.step, t_step - self._t0, kind, len(rows),
            self.drafter if drafted else "off", int(dk.max(initial=0)), 1, drafted, int(acc.sum()), emitted,
            draft_ms, verify_ms, step_ms, ctx, position_counts(dk, acc),
        )
        # fmt: on
        return record
