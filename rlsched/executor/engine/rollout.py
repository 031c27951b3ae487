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
5. appends one step record to the trace (journaled every step: a crash loses at most the step
   in flight); a finished sample gets one sample record.

KV room is reserved per request (prompt + token budget), so a running row never runs out of
cache and nothing is ever preempted; a request that could never fit is refused up front.

Sample ids inside a rollout: the estimator indexes its arrays by sample id, so the engine
numbers the requests of one `run` 0..n-1 (their order) for `EngineState.sample_ids`,
`StepOutcome.sample_ids` and the estimator; the caller's own ids come back in the results and
in the sample trace.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from rlsched.errors import UserError
from rlsched.executor.decode.sampling import SamplingParams
from rlsched.executor.decode.speculative import Seq, decode_step, prefill, step, tree_step
from rlsched.executor.decode.tree_verify import DraftTree
from rlsched.policies.acceptance import AcceptanceEstimator
from rlsched.policies.draft import PolicyContext
from rlsched.policies.probe import PROBE_EVERY, prober_for
from rlsched.policies.registry import GENERATE, Words, make_draft_policy, parse_policy
from rlsched.policies.types import EngineState, StepOutcome, Strategy
from rlsched.traces.writer import TraceWriter

# The weight a sample's earlier steps keep in its acceptance estimate, step to step
# (`AcceptanceEstimator.sample_decay`; 1: its whole response so far, as the simulator's
# per-sample constants). Accepted drafts a step fall near an answer's end only because k is
# capped at the tokens left; the per-token acceptance barely moves along an answer.
SAMPLE_DECAY = 1.0


@dataclass
class Request:
    """One sample to generate."""

    prompt: list[int]
    prompt_id: int
    sample_id: int
    max_new_tokens: int
    eos_id: int | None = None


@dataclass
class SampleResult:
    """A finished sample: its tokens, their target log-probs and how it went."""

    prompt_id: int
    sample_id: int
    tokens: list[int]
    logprobs: list[float]
    finish_s: float
    steps: int  # engine steps the sample took part in
    drafted: int
    accepted: int

    @property
    def mean_accept_len(self) -> float:
        """Tokens emitted per step of this sample (1.0 without speculation)."""
        return len(self.tokens) / self.steps if self.steps else 0.0


@dataclass
class RolloutResult:
    samples: list[SampleResult]  # in the order of the requests
    # tokens, seconds, tokens_per_s, steps, drafted, accepted, mean_accept_len
    stats: dict = field(default_factory=dict)


@dataclass
class _Row:
    """A running sample: its request, its Seq (prompt + generated, as drafters see it), the
    dense rollout index, and what it has produced."""

    req: Request
    index: int
    seq: Seq
    last: int  # the last token, not yet in the target's cache
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    rejected: int = 0  # speculative steps that ended in a rejection (a chain's failed trial)
    migrations: int = 0  # times it moved to another instance
    done: bool = False

    @property
    def remaining(self) -> int:
        return self.req.max_new_tokens - len(self.tokens)


def reserve(r: Request) -> int:
    """KV tokens a request may occupy at most (a step writes no further than the budget)."""
    return len(r.prompt) + r.max_new_tokens


def check_requests(requests: list[Request], cache_capacity: int) -> None:
    """Refuse requests that are malformed or could never fit the KV budget."""
    for r in requests:
        if not r.prompt:
            raise UserError(f"sample {r.sample_id}: the prompt is empty")
        if r.max_new_tokens < 1:
            raise UserError(f"sample {r.sample_id}: max_new_tokens must be >= 1 (got {r.max_new_tokens})")
        if reserve(r) > cache_capacity:
            raise UserError(
                f"sample {r.sample_id}: prompt + max_new_tokens ({reserve(r)} tokens) exceed "
                f"the KV cache capacity ({cache_capacity}); raise cache_capacity or lower max_new_tokens"
            )


def build_policy(spec, drafters: tuple[str, ...], cost=None, words: Words = GENERATE, **ctx_kwargs):
    """A DraftPolicy from a name or policy file, for the executor's drafters; a policy that
    needs a cost model without one is refused with a UserError. Step times here are measured,
    so priced policies calibrate to them."""
    p = parse_policy(spec)
    if cost is None and p.priced:
        raise UserError(
            f"policy '{p.text}' needs a cost model; pass one (a fitted or analytic CostModel) "
            "or choose a policy without one: off, static:K, bandit, table:FILE"
        )
    ctx_kwargs.setdefault("calibrate", True)
    return make_draft_policy(p, PolicyContext(cost=cost, drafters=drafters, **ctx_kwargs), words)


class RolloutEngine:
    """Continuous-batching speculative rollouts on one model (one instance); a RolloutBackend
    (`executor/backends.py`).

    model: the target (`Transformer`); drafter: a drafter, a list of them, or None (names
    are what Strategy.drafter refers to); cache_capacity: the KV budget in tokens, shared by
    the running rows; max_batch: rows at once; sampling: SamplingParams; policy: a DraftPolicy
    or a name/policy file (built with `build_policy`, `cost` given or None); estimator: the
    shared AcceptanceEstimator (a fresh one over the drafters when None); trace_dir: where
    `steps/` and `samples/` trace parts go (none when None; `trace_tag` names this engine's
    parts where several engines write into one folder); share_prompts: samples of one prompt
    share its prefill (`_plan_prefill`); probe_every: off steps in a row (across rollouts)
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
        self.drafters = {d.name: d for d in self._as_list(drafter) if d.name != "off"}
        names = tuple(self.drafters)
        self.cache_capacity, self.max_batch, self.k_max = cache_capacity, max_batch, k_max
        if isinstance(policy, str):
            policy = build_policy(policy, names, cost, k_max=k_max, max_batch=max_batch)
        self.policy = policy
        self.estimator = estimator if estimator is not None else AcceptanceEstimator(names, sample_decay=SAMPLE_DECAY)
        self.instance, self.rl_step = instance, rl_step
        self.ngram_history = ngram_history
        self.share_prompts = share_prompts
        self.trace_dir = None if trace_dir is None else Path(trace_dir)
        self._steps_w = self._samples_w = None
        if self.trace_dir is not None:
            self._steps_w = TraceWriter(self.trace_dir, "steps", flush_every=256, journal=True, tag=trace_tag)
            self._samples_w = TraceWriter(self.trace_dir, "samples", flush_every=256, journal=True, tag=trace_tag)
        self._cache = None
        self.step_index = 0
        self._prober = prober_for(self.policy, names, probe_every)
        self._observers = [d for d in self.drafters.values() if hasattr(d, "observe")]  # they read the target's states
        self._tree_ctx = PolicyContext(cost=None, drafters=names)  # the tree shapes, as the policies build them
        self._trees: dict[Strategy, DraftTree] = {}
        self._draft_s = 0.0

    @property
    def probes(self) -> int:
        """Probing steps run so far (`policies/probe.py`)."""
        return self._prober.probes

    @staticmethod
    def _as_list(drafter) -> list:
        if drafter is None:
            return []
        return list(drafter) if isinstance(drafter, (list, tuple)) else [drafter]

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
        return RolloutResult(list(results), self._summary(results, self._totals, seconds))

    # --- the rollout one step at a time (what `run` and a pool instance drive) ---------------

    def begin(self, prompt_of: np.ndarray, longest_reserve: int) -> None:
        """Start a rollout of len(prompt_of) samples (dense indices 0..n-1, sample i of prompt
        prompt_of[i]); this instance may get any of them (`submit`, `import_rows`)."""
        self.estimator.begin_rollout(len(prompt_of), prompt_of)
        self._ensure_cache(longest_reserve)
        for d in self.drafters.values():
            if hasattr(d, "reset"):
                d.reset()
        self._queue: list[_Row] = []  # waiting rows: fresh requests, or migrated ones to re-prefill
        self._running: dict[int, _Row] = {}  # cache slot -> row
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
            self._queue.append(_Row(req, i, Seq(list(req.prompt), -1, req.prompt_id), req.prompt[-1]))

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

    def _compact(self) -> None:
        """Running rows in cache slots 0..n-1, in slot order, so that every layer reads the
        cache as views: rows finish (or leave) at different times, and the holes they leave
        would make every step gather all rows' keys and values in every layer. A row moves by
        copying its cached tokens, in the target's cache and in a model drafter's."""
        running = self._running
        n = len(running)
        movers = sorted(s for s in running if s >= n)
        holes = [s for s in range(n) if s not in running]
        for src, dst in zip(movers, holes):
            self._cache.move(src, dst)
            for d in self.drafters.values():
                if hasattr(d, "move"):
                    d.move(src, dst)
            row = running.pop(src)
            row.seq.slot = dst
            running[dst] = row
        self._running = dict(sorted(running.items()))

    def view(self) -> dict:
        """What a reallocation policy sees of this instance (InstanceView's fields)."""
        rows = list(self._running.values())
        return dict(
            running_ids=np.array([r.index for r in rows], dtype=np.int64),
            running_ctx=np.array([len(r.seq.tokens) for r in rows], dtype=np.int64),
            waiting_ids=[r.index for r in self._queue],
            kv_free_tokens=self.cache_capacity
            - self._kv_reserved(self._running)
            - sum(reserve(r.req) for r in self._queue),
            max_batch=self.max_batch,
        )

    # --- migration: rows leave with their tokens (and KV), and join elsewhere -------------------

    def export_rows(self, indices, with_kv: set | frozenset = frozenset()) -> list[dict]:
        """Take these samples off this instance (those still here: a sample that finished
        meanwhile has been reported and stays). Each leaves as a dict: its request, tokens,
        log-probs, counters, acceptance counts and, for indices in `with_kv`, its KV cache rows."""
        with torch.inference_mode():
            return self._export_rows(set(int(i) for i in indices), with_kv)

    def _export_rows(self, want: set, with_kv) -> list[dict]:
        self.estimator.retire(self._ids)  # apply pending acceptance counts before reading them
        out = []
        for row in [r for r in self._queue if r.index in want]:
            self._queue.remove(row)
            out.append(self._moved(row, None))
        leaving = [(slot, r) for slot, r in self._running.items() if r.index in want]
        for slot, row in leaving:
            kv = None
            if row.index in with_kv:
                n = int(self._cache.lengths[slot])
                kv = self._cache.kv[:, :, slot, :, :n].to("cpu", copy=True)  # travels between processes
            del self._running[slot]
            out.append(self._moved(row, kv))
        if leaving:
            self._cache.free(torch.tensor([s for s, _ in leaving], dtype=torch.long))
            for d in self.drafters.values():
                if hasattr(d, "release"):
                    d.release([r.seq for _, r in leaving])
        return out

    def _moved(self, row: _Row, kv) -> dict:
        counts = {d: self.estimator.take_sample_counts(d, row.index) for d in self.estimator.drafters}
        return dict(
            req=row.req,
            index=row.index,
            seq_tokens=list(row.seq.tokens),
            last=row.last,
            tokens=row.tokens,
            logprobs=row.logprobs,
            steps=row.steps,
            drafted=row.drafted,
            accepted=row.accepted,
            rejected=row.rejected,
            migrations=row.migrations + 1,
            counts=counts,
            kv=kv,
        )

    def import_rows(self, moved: list[dict]) -> None:
        """Rows from another instance: with KV they run at once in a free slot (their cache
        rows copied in); without (or when no slot is free) they queue to be re-prefilled."""
        with torch.inference_mode():
            self._import_rows(moved)

    def _import_rows(self, moved: list[dict]) -> None:
        for m in moved:
            row = _Row(
                m["req"],
                m["index"],
                Seq(list(m["seq_tokens"]), -1, m["req"].prompt_id),
                m["last"],
                list(m["tokens"]),
                list(m["logprobs"]),
                m["steps"],
                m["drafted"],
                m["accepted"],
                m["rejected"],
                migrations=m["migrations"],
            )
            for d, (succ, fail) in m["counts"].items():
                if d in self.estimator.drafters:
                    self.estimator.add_sample_counts(d, row.index, succ, fail)
            free = [s for s in range(self.max_batch) if s not in self._running]
            kv = m["kv"]
            fits = self._kv_reserved(self._running) + reserve(row.req) <= self.cache_capacity
            if kv is not None and free and fits and kv.shape[3] + self.k_max + 1 <= self._cache.max_len:
                slot = free[0]
                n = kv.shape[3]
                self._cache.kv[:, :, slot, :, :n] = kv.to(self._cache.kv.device, self._cache.kv.dtype)
                self._cache.lengths[slot] = n
                row.seq.slot = slot
                self._running[slot] = row
            else:
                self._queue.append(row)

    def _ensure_cache(self, longest_reserve: int) -> None:
        """A cache of max_batch rows long enough for the longest request plus k_max (a ragged
        verify writes K + 1 positions in every row, padding included; reused if it is)."""
        need = longest_reserve + self.k_max
        if self._cache is None or self._cache.max_len < need:
            self._cache = self.model.new_cache(self.max_batch, need)
        self._cache.free(torch.arange(self.max_batch))
        for name, d in self.drafters.items():
            c = getattr(d, "cache", None)  # a model drafter's own cache must hold as much
            if c is not None and (c.max_batch < self.max_batch or c.max_len < need):
                raise UserError(
                    f"drafter '{name}': its KV cache ({c.max_batch} rows x {c.max_len}) is smaller than "
                    f"the engine needs ({self.max_batch} rows x {need}); build it with max_batch >= "
                    f"{self.max_batch} and max_len >= {need}"
                )

    def _kv_reserved(self, running: dict[int, _Row]) -> int:
        return sum(reserve(r.req) for r in running.values())

    # --- joining ---------------------------------------------------------------------------

    def _admit(self) -> int:
        """Queued rows join (in order) while slots and KV room allow; one ragged prefill of
        their tokens so far (the prompt, or a migrated row's prompt and response). Returns the
        KV tokens the running rows then reserve."""
        running = self._running
        free_slots = [s for s in range(self.max_batch) if s not in running]
        room = self.cache_capacity - self._kv_reserved(running)
        joining: list[_Row] = []
        while self._queue and free_slots and reserve(self._queue[0].req) <= room:
            row = self._queue.pop(0)
            room -= reserve(row.req)
            row.seq.slot = free_slots.pop(0)
            joining.append(row)
        if not joining:
            return self.cache_capacity - room
        t = time.perf_counter()
        computed, copies = self._plan_prefill(joining)
        if computed:
            states = {} if self._observers else None
            prefill(
                self.model, self._cache, [r.seq.slot for r in computed], [r.seq.tokens for r in computed], states=states
            )
            for i, st in (states or {}).items():
                for d in self._observers:
                    d.remember(computed[i].seq.tokens[:-1], st)
        for row, src in copies:
            self._cache.copy_prefix(src, row.seq.slot, len(row.seq.tokens) - 1)
        ms = (time.perf_counter() - t) * 1e3
        for row in joining:
            row.last = row.seq.tokens[-1]
            running[row.seq.slot] = row
        if computed:  # the tokens computed: what a prefill's time is a function of
            self._record_step(
                t, "prefill", len(computed), None, 0, 0, 0, 0, 0.0, ms, ms, sum(len(r.seq.tokens) for r in computed)
            )
        return self.cache_capacity - room

    def _plan_prefill(self, joining: list[_Row]) -> tuple[list[_Row], list[tuple[_Row, int]]]:
        """(rows to prefill, (row, source slot) pairs whose prompt's KV is copied instead).

        GRPO samples every prompt `group_size` times: with `share_prompts`, a fresh row whose
        prompt another row of this engine already holds (running, or prefilled in this same
        step) copies that row's prompt KV, as vLLM's prefix cache lets a group share one
        prefill. Rows that bring generated tokens (migrated ones) are prefilled whole."""
        if not self.share_prompts:
            return joining, []
        holder = {tuple(r.req.prompt): slot for slot, r in self._running.items()}
        computed, copies = [], []
        for row in joining:
            key = tuple(row.req.prompt)
            fresh = len(row.seq.tokens) == len(row.req.prompt)
            if fresh and key in holder:
                copies.append((row, holder[key]))
                continue
            computed.append(row)
            if fresh:
                holder.setdefault(key, row.seq.slot)
        return computed, copies

    # --- one engine step ---------------------------------------------------------------------

    def _state(self, running: dict[int, _Row], waiting: int) -> EngineState:
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

    def _row_lengths(self, strategy: Strategy, rows: list[_Row]) -> np.ndarray:
        """Each row's draft length: the strategy's k (or k_per_row), at most remaining - 1 (a step
        emits accepted + 1 tokens, so more drafts could never be kept) and at most k_max (the
        cache's spare room)."""
        if strategy.is_off:
            return np.zeros(len(rows), dtype=np.int64)
        if strategy.is_tree:
            if strategy.nodes > self.k_max:
                raise UserError(
                    f"strategy {strategy.label} verifies {strategy.nodes} drafts a row, more than the "
                    f"engine's k_max = {self.k_max}; lower N or raise k_max"
                )
            return np.full(len(rows), strategy.k, dtype=np.int64)
        want = (
            np.asarray(strategy.k_per_row, dtype=np.int64)
            if strategy.k_per_row is not None
            else np.full(len(rows), strategy.k, dtype=np.int64)
        )
        cap = np.minimum(np.array([r.remaining - 1 for r in rows], dtype=np.int64), self.k_max)
        return np.clip(np.minimum(want, cap), 0, None)

    def _decode(self, running: dict[int, _Row], totals: dict, waiting: int) -> None:
        """One step over the running rows: choose, draft, verify, learn, record."""
        state = self._state(running, waiting)
        strategy = self._prober(self.policy.choose(state))
        rows = list(running.values())
        slots = torch.tensor([r.seq.slot for r in rows], dtype=torch.long)
        last = torch.tensor([r.last for r in rows], dtype=torch.long)
        ks = self._row_lengths(strategy, rows)
        k = int(ks.max(initial=0))
        t = time.perf_counter()
        if k == 0:
            draft_s = 0.0
            out = decode_step(self.model, self._cache, slots, last, self.sampling, self.generator)
            dk = torch.zeros(len(rows), dtype=torch.long)
        else:
            drafter = self.drafters.get(strategy.drafter)
            if drafter is None:
                raise UserError(
                    f"policy chose drafter '{strategy.drafter}', which this engine lacks "
                    f"(it has: {', '.join(self.drafters) or 'none'})"
                )
            if strategy.is_tree:
                out, dk, trials = self._tree_step(strategy, drafter, rows, slots, last, t)
                draft_s = self._draft_s
            else:
                d, dq, dk = drafter.propose([r.seq for r in rows], k)
                dk = torch.minimum(dk.cpu(), torch.as_tensor(ks))
                draft_s = time.perf_counter() - t
                out = step(self.model, self._cache, slots, last, self.sampling, d, dq, dk, self.generator)
        accepted = out.accepted.cpu()  # waits for the device: the clock below then sees the verify
        verify_s = time.perf_counter() - t - draft_s
        emitted, rejected = self._append(rows, out, dk, accepted)
        if self._observers:
            self._observe(rows, out, accepted)
        step_s = time.perf_counter() - t
        drafted, n_acc = int(dk.sum()), int(accepted.sum())
        catch_up = getattr(drafter, "catch_up", 0) if k > 0 else 0
        self._learn(
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
            catch_up,
            trials if strategy.is_tree and k > 0 else None,
        )
        totals["steps"] += 1
        totals["drafted"] += drafted
        totals["accepted"] += n_acc
        if k > 0:
            totals["sd_emitted"] += emitted
            totals["sd_rows"] += len(rows)
            totals["rejected"] += rejected  # chains that stopped short (the estimator's trials)
            totals["draft_s"] += draft_s
        self._record_step(
            t,
            "decode",
            len(rows),
            strategy.drafter,
            strategy.k,
            strategy.width,
            drafted,
            n_acc,
            draft_s * 1e3,
            verify_s * 1e3,
            step_s * 1e3,
            state.ctx_tokens,
            emitted,
        )
        self.step_index += 1

    def _tree_step(self, strategy: Strategy, drafter, rows: list[_Row], slots, last, t: float):
        """A draft tree's step: the drafter's tree (the shape the policies price, `policies/tree.py`),
        verified in one target forward. Returns the result, the drafts each row verified, and the
        rank-1 trials its accepted path showed (hits, misses: `_rank1_trials`)."""
        if not hasattr(drafter, "propose_tree"):
            raise UserError(
                f"strategy {strategy.label}: drafter '{strategy.drafter}' drafts chains only; use static:K with it"
            )
        tree = self._trees.get(strategy)
        if tree is None:
            tree = self._trees[strategy] = DraftTree.from_shape(self._tree_ctx.tree(strategy.drafter, strategy))
        tokens, q, present = drafter.propose_tree([r.seq for r in rows], tree)
        self._draft_s = time.perf_counter() - t
        out = tree_step(self.model, self._cache, slots, last, self.sampling, tree, tokens, q, present, self.generator)
        present = present.cpu()
        return out, present.sum(1), _rank1_trials(tree, out.path.cpu(), present)

    def _observe(self, rows: list[_Row], out, accepted: torch.Tensor) -> None:
        """Hand the drafters that draft from the target's states (EAGLE) the states of the
        positions each row kept in this step: its last token, then its accepted drafts (a
        tree's accepted path)."""
        path = getattr(out, "path", None)
        if path is None:
            kept = [list(range(a + 1)) for a in accepted.tolist()]
        else:
            kept = [[0] + [j + 1 for j in p[:a]] for p, a in zip(path.cpu().tolist(), accepted.tolist())]
        for d in self._observers:
            d.observe([r.seq for r in rows], self.model.captured, kept)

    def _append(self, rows: list[_Row], out, dk: torch.Tensor, accepted: torch.Tensor) -> tuple[int, int]:
        """Give each row its new tokens (cut at its budget and at eos) and its chain trial; returns
        the tokens emitted and the rows whose chain stopped short (a rejection)."""
        all_tokens, all_lps = out.tokens.cpu().tolist(), out.logprobs.cpu().tolist()  # one conversion
        n_acc, n_draft = accepted.tolist(), dk.tolist()
        emitted = rejected = 0
        for r, row_toks, row_lps, a, d in zip(rows, all_tokens, all_lps, n_acc, n_draft):
            new = row_toks[: a + 1]
            toks, lps = new[: r.remaining], row_lps[: a + 1][: r.remaining]
            if r.req.eos_id is not None and r.req.eos_id in toks:
                cut = toks.index(r.req.eos_id) + 1
                toks, lps = toks[:cut], lps[:cut]
                r.done = True
            r.tokens.extend(toks)
            r.logprobs.extend(lps)
            r.seq.tokens.extend(new)
            r.last = new[-1]
            r.steps += 1
            r.drafted += d
            r.accepted += a
            r.rejected += a < d
            rejected += a < d
            r.done = r.done or r.remaining <= 0
            emitted += len(toks)
        return emitted, rejected

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

    def _retire(self, running: dict[int, _Row]) -> list[tuple[int, SampleResult]]:
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

    # --- traces and stats ------------------------------------------------------------------

    def _record_step(
        self,
        t,
        kind,
        batch,
        drafter,
        k,
        width,
        drafted,
        accepted,
        draft_ms,
        verify_ms,
        step_ms,
        ctx_tokens,
        emitted=None,
    ) -> None:
        if self._steps_w is None:
            return
        self._steps_w.append(
            dict(
                rl_step=self.rl_step,
                instance=self.instance,
                step=self.step_index,
                time_s=t - self._t0,
                kind=kind,
                batch=batch,
                drafter=drafter or "off",
                k=k,
                width=width,
                drafted=drafted,
                accepted=accepted,
                emitted=0 if emitted is None else emitted,
                draft_ms=draft_ms,
                verify_ms=verify_ms,
                step_ms=step_ms,
                ctx_tokens=ctx_tokens,
            )
        )

    def _record_sample(self, r: _Row, finish_s: float) -> None:
        if self._samples_w is None:
            return
        rec = dict(
            rl_step=self.rl_step,
            sample_id=r.req.sample_id,
            prompt_id=r.req.prompt_id,
            instance=self.instance,
            prompt_len=len(r.req.prompt),
            response_len=len(r.tokens),
            finish_s=finish_s,
            preemptions=0,
            migrations=r.migrations,
            drafted=r.drafted,
            accepted=r.accepted,
            rejected=r.rejected,
        )
        informed = getattr(self.policy, "needs_acceptance", True)
        for name in self.drafters:
            if informed:  # the shared estimator's (shrunk to the prompt and the drafter)
                a = float(self.estimator.estimates(name, np.array([r.index]), whole=True)[0])
            else:  # the policy fed no estimator: the row's own chain trials, from the same prior
                e = self.estimator
                a = (r.accepted + e.prior_mean * e.sample_strength) / (r.accepted + r.rejected + e.sample_strength)
            rec[f"acceptance_{name}"] = a
        self._samples_w.append(rec)

    @staticmethod
    def _summary(results: list[SampleResult], totals: dict, seconds: float) -> dict:
        tokens = sum(len(s.tokens) for s in results)
        return dict(
            samples=len(results),
            tokens=tokens,
            seconds=seconds,
            tokens_per_s=tokens / seconds if seconds > 0 else 0.0,
            steps=totals["steps"],
            drafted=totals["drafted"],
            accepted=totals["accepted"],
            rejected=totals["rejected"],
            sd_rows=totals["sd_rows"],
            mean_accept_len=totals["sd_emitted"] / totals["sd_rows"] if totals["sd_rows"] else 1.0,
            kv_peak_tokens=totals["kv_peak_tokens"],
            max_running=totals["max_running"],
            draft_s=totals.get("draft_s", 0.0),
        )

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
        for w in (self._steps_w, self._samples_w):
            if w is not None:
                w.close()


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
