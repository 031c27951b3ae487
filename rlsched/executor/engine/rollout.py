"""The speculative rollout engine: continuous batching around `speculative.step`.

Requests (prompt token ids, ids, a token budget, an optional end-of-sequence id) wait in a
queue. Between steps, finished rows leave (their cache rows are freed) and waiting requests
join (one ragged prefill) while batch slots and KV room allow. Each step:

1. builds the `EngineState` a policy sees (the same fields the simulator fills),
2. asks `policy.choose(state)` for a Strategy (off, or a drafter and k, or per-row lengths);
   a policy that prices acceptance and has kept SD off for `probe_every` steps gets one
   probing step instead (`policies/probe.py`),
3. caps each row's draft length by what the row may still emit, drafts, and runs ONE target
   forward (`step`; `decode_step` when nothing is drafted),
4. feeds the shared AcceptanceEstimator and `policy.observe` (measured wall-clock times),
5. appends one step record to the trace (`recorder.py`, journaled every step: a crash loses at
   most the step in flight); a finished sample gets one sample record.

KV room is reserved per request (prompt + token budget, `rows.py`), so a running row never runs
out of cache and nothing is ever preempted; a request that could never fit is refused up front.
Rows move between engines of a pool through `migration.py`.

Sample ids inside a rollout: the estimator indexes its arrays by sample id, so the engine
numbers the requests of one `run` 0..n-1 (their order) for `EngineState.sample_ids`,
`StepOutcome.sample_ids` and the estimator; the caller's own ids come back in the results and
in the sample trace.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from rlsched.errors import UserError
from rlsched.executor.decode.sampling import SamplingParams
from rlsched.executor.decode.speculative import Seq, decode_step, step, tree_step
from rlsched.executor.decode.tree_verify import DraftTree
from rlsched.executor.engine.admission import Admission
from rlsched.executor.engine.migration import RowMigration
from rlsched.executor.engine.recorder import Recorder, position_counts, sample_record, step_record
from rlsched.executor.engine.rows import (
    Request,
    RolloutResult,
    Row,
    SampleResult,
    append_tokens,
    check_requests,
    reserve,
    summary,
)
from rlsched.policies.acceptance import AcceptanceEstimator
from rlsched.policies.draft import PolicyContext
from rlsched.policies.probe import PROBE_EVERY, prober_for
from rlsched.policies.registry import GENERATE, PolicySpec, Words, as_spec, make_draft_policy
from rlsched.policies.types import EngineState, StepOutcome, Strategy

# The weight a sample's earlier steps keep in its acceptance estimate, step to step
# (`AcceptanceEstimator.sample_decay`; 1: its whole response so far, as the simulator's
# per-sample constants). Accepted drafts a step fall near an answer's end only because k is
# capped at the tokens left; the per-token acceptance barely moves along an answer.
SAMPLE_DECAY = 1.0


def build_policy(spec: PolicySpec | str, drafters: tuple[str, ...], cost=None, words: Words = GENERATE, **ctx_kwargs):
    """A DraftPolicy from a parsed policy spec (or its text), for the executor's drafters; a
    policy that needs a cost model without one is refused with a UserError. Step times here are
    measured, so priced policies calibrate to them."""
    p = as_spec(spec)
    if cost is None and p.priced:
        raise UserError(
            f"policy '{p.text}' needs a cost model; pass one (a fitted or analytic CostModel) "
            "or choose a policy without one: off, static:K, bandit, table:FILE"
        )
    ctx_kwargs.setdefault("calibrate", True)
    return make_draft_policy(p, PolicyContext(cost=cost, drafters=drafters, **ctx_kwargs), words)


class RolloutEngine(Admission, RowMigration):
    """Continuous-batching speculative rollouts on one model (one instance); a RolloutBackend
    (`executor/backends.py`).

    model: the target (`Transformer`); drafter: a drafter, a list of them, or None (names
    are what Strategy.drafter refers to); cache_capacity: the KV budget in tokens, shared by
    the running rows; max_batch: rows at once; sampling: SamplingParams; policy: a DraftPolicy
    or a name/policy file (built with `build_policy`, `cost` given or None); estimator: the
    shared AcceptanceEstimator (a fresh one over the drafters when None); trace_dir: where
    `steps/` and `samples/` trace parts go (none when None; `trace_tag` names this engine's
    parts where several engines write into one folder); share_prompts: samples of one prompt
    share its prefill (`admission.plan_prefill`); probe_every: off steps in a row (across rollouts)
    after which a policy that prices acceptance gets one probing step (`policies/probe.py`;
    None: never)."""

    def __init__(
        self,
        model,
        drafter,
        cache_capacity: int,
        max_batch: int,
        sampling: SamplingParams,
        policy,
        estimator: AcceptanceEstimator | None = None,
        trace_dir: Path | None = None,
        *,
        cost=None,
        k_max: int = 8,
        instance: int = 0,
        rl_step: int = 0,
        generator: torch.Generator | None = None,
        ngram_history: bool = True,
        trace_tag: str = "",
        share_prompts: bool = True,
        probe_every: int | None = PROBE_EVERY,
    ):
        if max_batch < 1 or cache_capacity < 1:
            raise UserError(
                f"the engine needs max_batch >= 1 and cache_capacity >= 1 (got {max_batch}, {cache_capacity})"
            )
        self.model, self.sampling, self.generator = model, sampling, generator
        self.drafters = {d.name: d for d in _as_list(drafter) if d.name != "off"}
        names = tuple(self.drafters)
        self.cache_capacity, self.max_batch, self.k_max = cache_capacity, max_batch, k_max
        if isinstance(policy, (str, PolicySpec)):
            policy = build_policy(policy, names, cost, k_max=k_max, max_batch=max_batch)
        self.policy = policy
        self.estimator = estimator if estimator is not None else AcceptanceEstimator(names, sample_decay=SAMPLE_DECAY)
        self.instance, self.rl_step = instance, rl_step
        self.ngram_history = ngram_history
        self.share_prompts = share_prompts
        self.recorder = Recorder(trace_dir, trace_tag)
        self.trace_dir = self.recorder.trace_dir
        self._cache = None
        self.step_index = 0
        self._prober = prober_for(self.policy, names, probe_every)
        self._observers = [d for d in self.drafters.values() if hasattr(d, "observe")]  # they read the target's states
        self._tree_ctx = PolicyContext(cost=None, drafters=names)  # the tree shapes, as the policies build them
        self._trees: dict[Strategy, DraftTree] = {}

    @property
    def probes(self) -> int:
        """Probing steps run so far (`policies/probe.py`)."""
        return self._prober.probes

    # --- the rollout ---------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, requests: list[Request]) -> RolloutResult:
        """Generate every request; results in request order, with overall stats."""
        results = self.start(requests)
        while self.has_work:
            for i, res in self.work():
                results[i] = res
        return self.result(results)

    @torch.inference_mode()
    def start(self, requests: list[Request]) -> list:
        """`run` in parts: begin a rollout of `requests` (checked and queued), then `work` until
        no work is left, filling the returned list (request order), then `result`."""
        check_requests(requests, self.cache_capacity)
        prompt_index: dict = {}
        prompt_of = np.array(
            [prompt_index.setdefault(r.prompt_id, len(prompt_index)) for r in requests], dtype=np.int64
        )
        self.begin(prompt_of, max((reserve(r) for r in requests), default=1))
        self.submit(list(enumerate(requests)))
        return [None] * len(requests)

    def result(self, results: list) -> RolloutResult:
        """The finished rollout `start` began: its samples and overall stats."""
        seconds = time.perf_counter() - self._t0
        self.estimator.retire(self._ids)
        return RolloutResult(list(results), summary(results, self._totals, seconds))

    # --- the rollout one step at a time (what `run` and a pool instance drive) ---------------

    def begin(self, prompt_of: np.ndarray, longest_reserve: int) -> None:
        """Start a rollout of len(prompt_of) samples (dense indices 0..n-1, sample i of prompt
        prompt_of[i]); this instance may get any of them (`submit`, `import_rows`)."""
        self.estimator.begin_rollout(len(prompt_of), prompt_of)
        self._ensure_cache(longest_reserve)
        for d in self.drafters.values():
            if hasattr(d, "reset"):
                d.reset()
        self._queue: list[Row] = []  # waiting rows: fresh requests, or migrated ones to re-prefill
        self._running: dict[int, Row] = {}  # cache slot -> row
        self._ids = np.zeros(0, dtype=np.int64)
        self.step_index = 0  # steps count per rollout, as in the simulator
        self._totals = dict(
            steps=0,
            drafted=0,
            accepted=0,
            rejected=0,
            sd_emitted=0,
            sd_rows=0,
            kv_peak_tokens=0,
            max_running=0,
            draft_s=0.0,
        )
        self._t0 = time.perf_counter()

    def submit(self, items: list[tuple[int, Request]]) -> None:
        """Queue requests (their dense rollout index, the request)."""
        for i, req in items:
            self._queue.append(Row(req, i, Seq(list(req.prompt), -1, req.prompt_id), req.prompt[-1]))

    @property
    def has_work(self) -> bool:
        return bool(self._queue or self._running)

    @property
    def totals(self) -> dict:
        """The rollout's running totals: steps, drafts, chains, KV peak, largest batch."""
        return dict(self._totals)

    def work(self) -> list[tuple[int, SampleResult]]:
        """One engine step (admissions, one decode or speculative step, retirements); returns
        the samples that finished, with their dense indices."""
        with torch.inference_mode():
            reserved = self._admit()
            t = self._totals
            t["kv_peak_tokens"] = max(t["kv_peak_tokens"], reserved)
            t["max_running"] = max(t["max_running"], len(self._running))
            if not self._running:  # nothing fits and nothing runs: cannot happen after check_requests
                raise RuntimeError("no request fits the KV cache")
            self._compact()
            self._decode(self._running, t, len(self._queue))
            return self._retire(self._running)

    def resize(self, cache_capacity: int, drafter_max_len: int) -> None:
        """Room for longer requests (a longer prompt than the engine was sized for): the KV
        budget, and a model drafter's cache rows."""
        self.cache_capacity = cache_capacity
        d = self.drafters.get("model")
        if d is not None:
            d.new_cache(self.max_batch, drafter_max_len)

    # --- one engine step ---------------------------------------------------------------------

    def _state(self, running: dict[int, Row], waiting: int) -> EngineState:
        """What the policy sees: the same fields as in the simulator."""
        rows = list(running.values())
        ids = np.array([r.index for r in rows], dtype=np.int64)
        if not np.array_equal(ids, self._ids):  # the batch changed: a new id array (the estimator keys by it)
            self.estimator.retire(self._ids)
            self._ids = ids
        ctx = np.array([len(r.seq.tokens) for r in rows], dtype=np.int64)
        ctx_tokens = int(ctx.sum())
        return EngineState(
            self.instance,
            self.step_index,
            time.perf_counter() - self._t0,
            self._ids,
            ctx,
            ctx_tokens,
            waiting,
            self.cache_capacity - ctx_tokens,
            self.estimator,
        )

    def _decode(self, running: dict[int, Row], totals: dict, waiting: int) -> None:
        """One step over the running rows: choose, draft, verify, learn, record."""
        state = self._state(running, waiting)
        strategy = self._prober(self.policy.choose(state))
        rows = list(running.values())
        t, out, dk, draft_s, trials, drafter = self._draft_verify(strategy, rows)
        accepted = out.accepted.cpu()  # waits for the device: the clock below then sees the verify
        verify_s = time.perf_counter() - t - draft_s
        emitted, rejected = append_tokens(rows, out, dk, accepted)
        if self._observers:
            _observe(self._observers, rows, out, accepted, self.model)
        step_s = time.perf_counter() - t
        drafted, n_acc = int(dk.sum()), int(accepted.sum())
        catch_up = getattr(drafter, "catch_up", 0) if drafter is not None else 0
        self._learn(
            state, strategy, rows, dk, accepted, drafted, n_acc, emitted, step_s, draft_s, verify_s, catch_up, trials
        )
        totals["steps"] += 1
        totals["drafted"] += drafted
        totals["accepted"] += n_acc
        if drafter is not None:
            totals["sd_emitted"] += emitted
            totals["sd_rows"] += len(rows)
            totals["rejected"] += rejected  # chains that stopped short (the estimator's trials)
            totals["draft_s"] += draft_s
        # fmt: off
        self.recorder.step(step_record(
            self.rl_step, self.instance, self.step_index, t - self._t0, "decode", len(rows), strategy.drafter,
            strategy.k, strategy.width, drafted, n_acc, emitted, draft_s * 1e3, verify_s * 1e3, step_s * 1e3,
            state.ctx_tokens, None if trials is not None else position_counts(dk.numpy(), accepted.numpy()),
        ))
        # fmt: on
        self.step_index += 1

    def _draft_verify(self, strategy: Strategy, rows: list[Row]):
        """Draft each row's length (`Strategy.row_lengths`: at most what the row may still emit
        and k_max, the cache's spare room) and verify in ONE target forward. Returns the step's
        start time, its result, the drafts each row verified, the draft seconds, a tree's rank-1
        trials (hits, misses: `_rank1_trials`; None for a chain) and the drafter (None: plain)."""
        slots = torch.tensor([r.seq.slot for r in rows], dtype=torch.long)
        last = torch.tensor([r.last for r in rows], dtype=torch.long)
        if strategy.is_tree and strategy.nodes > self.k_max:
            raise UserError(
                f"strategy {strategy.label} verifies {strategy.nodes} drafts a row, more than the "
                f"engine's k_max = {self.k_max}; lower N or raise k_max"
            )
        ks = strategy.row_lengths([r.remaining - 1 for r in rows], self.k_max)  # a step keeps accepted + 1
        k = int(ks.max(initial=0))
        t = time.perf_counter()
        if k == 0:
            out = decode_step(self.model, self._cache, slots, last, self.sampling, self.generator)
            return t, out, torch.zeros(len(rows), dtype=torch.long), 0.0, None, None
        drafter = self.drafters.get(strategy.drafter)
        if drafter is None:
            raise UserError(
                f"policy chose drafter '{strategy.drafter}', which this engine lacks "
                f"(it has: {', '.join(self.drafters) or 'none'})"
            )
        if not strategy.is_tree:
            d, dq, dk = drafter.propose([r.seq for r in rows], k)
            dk = torch.minimum(dk.cpu(), torch.as_tensor(ks))
            draft_s = time.perf_counter() - t
            out = step(self.model, self._cache, slots, last, self.sampling, d, dq, dk, self.generator)
            return t, out, dk, draft_s, None, drafter
        # a draft tree: the drafter's tree (the shape the policies price, `policies/tree.py`)
        if not hasattr(drafter, "propose_tree"):
            raise UserError(
                f"strategy {strategy.label}: drafter '{strategy.drafter}' drafts chains only; use static:K with it"
            )
        tree = self._trees.get(strategy)
        if tree is None:
            tree = self._trees[strategy] = DraftTree.from_shape(self._tree_ctx.tree(strategy.drafter, strategy))
        tokens, q, present = drafter.propose_tree([r.seq for r in rows], tree)
        draft_s = time.perf_counter() - t
        out = tree_step(self.model, self._cache, slots, last, self.sampling, tree, tokens, q, present, self.generator)
        present = present.cpu()
        return t, out, present.sum(1), draft_s, _rank1_trials(tree, out.path.cpu(), present), drafter

    def _learn(
        self,
        state,
        strategy,
        rows,
        dk,
        accepted,
        drafted,
        n_acc,
        emitted,
        step_s,
        draft_s,
        verify_s,
        catch_up=0,
        trials=None,
    ):
        """Feed the estimator (steps that drafted: a chain's accepted length, a tree's rank-1
        trials) and the policy's observe."""
        feeds = not strategy.is_off and drafted > 0 and getattr(self.policy, "needs_acceptance", True)
        observes = getattr(self.policy, "observes", True)
        if not (feeds or observes):  # static k, off: nothing to learn, no conversion
            return
        acc = accepted.numpy().astype(np.int64)
        if feeds:
            if trials is not None:
                self.estimator.update_trials(strategy.drafter, state.sample_ids, *trials)
            else:
                self.estimator.update(strategy.drafter, state.sample_ids, acc, dk.numpy().astype(np.int64))
        if observes:
            self.policy.observe(
                StepOutcome(
                    self.instance,
                    state.step,
                    strategy,
                    len(rows),
                    drafted,
                    n_acc,
                    emitted,
                    step_s,
                    draft_s,
                    verify_s,
                    state.sample_ids,
                    acc,
                    catch_up,
                )
            )

    # --- leaving ---------------------------------------------------------------------------

    def _retire(self, running: dict[int, Row]) -> list[tuple[int, SampleResult]]:
        """Finished rows leave: cache rows freed, drafters told, estimator folded, records
        written; returns them (dense index, result)."""
        done = [slot for slot, r in running.items() if r.done]
        if not done:
            return []
        rows = [running.pop(slot) for slot in done]
        self._cache.free(torch.tensor(done, dtype=torch.long))
        finish_s = time.perf_counter() - self._t0
        for d in self.drafters.values():
            if hasattr(d, "release"):
                d.release([r.seq for r in rows])
            if self.ngram_history and hasattr(d, "add_history"):
                for r in rows:
                    d.add_history(r.req.prompt_id, r.req.prompt + r.tokens)
        self.estimator.finish(np.array([r.index for r in rows], dtype=np.int64))
        out = []
        for r in rows:
            out.append(
                (
                    r.index,
                    SampleResult(
                        r.req.prompt_id, r.req.sample_id, r.tokens, r.logprobs, finish_s, r.steps, r.drafted, r.accepted
                    ),
                )
            )
            self._record_sample(r, finish_s)
        return out

    def _record_sample(self, r: Row, finish_s: float) -> None:
        """The sample's record, with each drafter's acceptance: the shared estimator's (shrunk to
        the prompt and the drafter), or where the policy fed none, the row's own chain trials."""
        if not self.recorder.on:
            return
        informed = getattr(self.policy, "needs_acceptance", True)
        acceptance = {
            name: float(self.estimator.estimates(name, np.array([r.index]), whole=True)[0])
            if informed
            else self.estimator.from_trials(r.accepted, r.rejected)
            for name in self.drafters
        }
        # fmt: off
        self.recorder.sample(sample_record(
            self.rl_step, r.req, self.instance, len(r.tokens), finish_s, 0, r.migrations, r.drafted, r.accepted,
            r.rejected, acceptance,
        ))
        # fmt: on

    # --- weights, checkpoints, closing -------------------------------------------------------

    def sync_weights(self, model, drafter_model=None) -> None:
        """New weights after an RL update: nothing to do, this engine runs the trainer's own
        modules (a Ray pool or vLLM copy them here)."""

    def policy_state(self) -> tuple:
        """(policy, estimator, n-gram history or None), for checkpoints: what the engine
        learnt while generating, handed back when it is rebuilt."""
        host = next((d for d in self.drafters.values() if hasattr(d, "add_history")), None)
        return self.policy, self.estimator, getattr(host, "history", None)

    def close(self) -> None:
        """Write the last trace parts (the journals hold every record until then)."""
        self.recorder.close()


def _as_list(drafter) -> list:
    if drafter is None:
        return []
    return list(drafter) if isinstance(drafter, (list, tuple)) else [drafter]


def _observe(observers: list, rows: list[Row], out, accepted: torch.Tensor, model) -> None:
    """Hand the drafters that draft from the target's states (EAGLE) the states of the
    positions each row kept in this step: its last token, then its accepted drafts (a
    tree's accepted path)."""
    path = getattr(out, "path", None)
    if path is None:
        kept = [list(range(a + 1)) for a in accepted.tolist()]
    else:
        kept = [[0] + [j + 1 for j in p[:a]] for p, a in zip(path.cpu().tolist(), accepted.tolist())]
    for d in observers:
        d.observe([r.seq for r in rows], model.captured, kept)


def _rank1_trials(tree: DraftTree, path: torch.Tensor, present: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The Bernoulli trials of the drafter's first choice that one tree step showed, per row
    (`policies/tree.draw_tree`): each accepted node is a hit if it was its parent's rank-1
    child and a miss if not, and where the walk stopped, a present rank-1 child was a miss.
    A rank-1 child is tried first, with the chain's acceptance probability, so these trials
    update a chain's acceptance estimate."""
    rank = np.asarray(tree.rank)
    first = np.full(tree.n + 1, -1, dtype=np.int64)  # each node's rank-1 child (index 0: the root)
    for j, (parent, r) in enumerate(zip(tree.parent, tree.rank)):
        if r == 1:
            first[parent + 1] = j
    p = path.numpy()
    on = p >= 0
    hits = (on & (rank[np.maximum(p, 0)] == 1)).sum(1)
    misses = (on & (rank[np.maximum(p, 0)] != 1)).sum(1)
    depth = on.sum(1)
    stop = np.where(depth > 0, p[np.arange(len(p)), np.maximum(depth - 1, 0)], -1)
    child = first[stop + 1]
    pres = present.numpy()
    misses += (child >= 0) & pres[np.arange(len(p)), np.maximum(child, 0)]
    return hits.astype(np.int64), misses.astype(np.int64)
