"""One inference instance run as vLLM V1's engine (`engine.kind: vllm`).

A model of vLLM V1's scheduler (vllm/v1/core/sched/scheduler.py, `Scheduler.schedule`, vLLM
0.32.0), one engine step at a time:

- a token budget per step (`max_num_batched_tokens`). Running requests come first, in the
  order they were admitted: each decode row its token plus its drafts (a row verifying k drafts
  takes k + 1 tokens; when the budget runs short a row verifies fewer drafts, and a row the
  budget cannot reach waits), then the requests part-way through their prompt, a chunk each;
- then waiting requests, oldest first, while the budget, the batch limit (`max_num_seqs`,
  `cluster.max_batch`) and free KV blocks allow: a prompt in chunks when chunked prefill is on
  (the rest continues next step, so a rollout starts with a run of mixed steps), whole or not
  at all when it is off. The step that completes a prompt samples its first token;
- prefix caching: a prompt's full blocks, once scheduled, are shared by the samples of its
  group; a fresh sample is prefilled from the last cached block boundary (at most its prompt
  less one token, block-aligned), so a group of n is prefilled once plus n partial blocks. The
  cache holds a prompt's blocks for the rest of the rollout (no eviction is modelled);
- KV blocks of `block_size` tokens: a running request holds the blocks of its context and of
  the drafts a step may add (`speculation.k_max` lookahead slots, as vLLM reserves); when they
  run out the newest running request is preempted, back to the head of the queue, and later
  recomputed (its whole context prefilled again). No waiting request is admitted in a step that
  preempted;
- a step with decode/verify rows only runs at the next CUDA-graph capture size of its token
  count (above the largest size, eagerly at its own count); a step with prompt chunks runs at
  its own count, priced as one forward over rows and chunks (`mixed_time` of the cost model);
- host work (the cost model's `step_overhead` and host-side drafting) adds to the GPU's time,
  or, with async scheduling, overlaps it: the step takes the longer of the two.

The DraftPolicy is asked before every step with decode rows, as in rlsched's engine. A
stretch of pure decode/verify steps nothing can change (no prompt chunk, admission, preemption
or finished row; the policy promising its choice: `steady_steps`) is priced in one go, then
stepped through at the same times with the same draws and estimator updates as step by step:
the same results to the last bit. Reallocation moves decode rows and queued requests;
a request part-way through its prompt stays where it is until its prefill completes.
"""

from __future__ import annotations

import numpy as np

from rlsched.errors import UserError
from rlsched.policies.position import learned_trials, stage_decay
from rlsched.policies.types import EngineState, StepOutcome
from rlsched.sim.instance import Instance
from rlsched.sim.timeline import KIND_DECODE, KIND_MIXED, KIND_PREFILL

# per-instance counters, summed in a run's summary under `vllm_engine`
STATS = ("prefill_tokens", "cached_tokens", "preempted_tokens", "padded_tokens", "mixed_steps")
_PREFILL, _CACHED, _PREEMPTED, _PADDED, _MIXED = range(len(STATS))


def check_engine(stage, longest: int) -> None:
    """Refuse, before any step, an engine that could never schedule the longest sequence."""
    eng = stage.engine
    blocks = -(-(longest + stage.lookahead) // eng.block_size)
    if blocks > stage.kv_capacity // eng.block_size:
        raise UserError(
            f"engine.block_size: a sequence of {longest} tokens (+{stage.lookahead} draft slots) needs {blocks} "
            f"KV blocks of {eng.block_size} but an instance holds {stage.kv_capacity // eng.block_size}; "
            "lower the block size or workload.*_len.max, or raise the KV capacity"
        )
    if not eng.chunked_prefill and longest > eng.max_num_batched_tokens:
        raise UserError(
            f"engine.max_num_batched_tokens: with chunked prefill off a step must hold a whole sequence "
            f"({longest} tokens), not {eng.max_num_batched_tokens}; raise it or set engine.enable_chunked_prefill=true"
        )


class VllmInstance(Instance):
    """An instance whose steps follow vLLM V1's scheduler (module docstring)."""

    def __init__(self, idx, stage, policy, rng):
        super().__init__(idx, stage, policy, rng)
        self.eng = stage.engine
        self.pre: list[list[int]] = []  # [sample id, tokens computed, tokens to compute], admission order
        self.cached: dict[int, int] = {}  # prompt id -> its tokens in the prefix cache (whole blocks)
        self.cap_blocks = stage.kv_capacity // self.eng.block_size
        self.used_blocks = 0
        self.arrived: list[int] = []  # admitted with their KV cache: decode rows after this step
        self.stats = np.zeros(len(STATS), dtype=np.int64)
        self._oh = float(getattr(stage.cost, "step_overhead", 0.0))
        self._now: EngineState | None = None  # the state the policy was last asked with
        self._preempted = False  # whether the last schedule preempted

    # ------------------------------------------------------------------ KV blocks
    def _blocks(self, sids: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """KV blocks of requests (running order) holding `tokens` each: its blocks past its
        prompt's shared full blocks, and each prompt's shared blocks once, on its first request."""
        bs = self.eng.block_size
        own = -(-np.asarray(tokens, dtype=np.int64) // bs)
        if self.eng.prefix_caching and len(sids):
            ro = self.stage.rollout
            full = ro.prompt_len[sids].astype(np.int64) // bs
            own = np.maximum(own - full, 0)
            _, first = np.unique(ro.prompt_of[sids], return_index=True)
            own[first] += full[first]
        return own

    def _fit(self, pre_tokens: list[int]) -> int:
        """How many running requests, in running order (decode rows, then those mid-prompt
        holding `pre_tokens`), fit in the KV blocks; records the blocks they use."""
        sids = np.concatenate((self.sid, np.asarray([r[0] for r in self.pre], dtype=np.int64)))
        tokens = np.concatenate((self.ctx + self.stage.lookahead, np.asarray(pre_tokens, dtype=np.int64)))
        cum = np.cumsum(self._blocks(sids, tokens))
        if not len(cum) or cum[-1] <= self.cap_blocks:
            self.used_blocks = int(cum[-1]) if len(cum) else 0
            return len(cum)
        m = max(int(np.searchsorted(cum, self.cap_blocks, side="right")), 1)
        self.used_blocks = int(cum[m - 1])
        return m

    def _preempt_tail(self, keep: int) -> None:
        """Preempt every running request after the first `keep` (the newest): back to the head of
        the queue, in running order, to be recomputed from its whole context."""
        st, b = self.stage, self.batch
        gone_pre = self.pre[max(keep - b, 0) :]
        self.pre = self.pre[: max(keep - b, 0)]
        rows = self.take_rows(np.arange(b) < keep) if keep < b else np.zeros(0, dtype=np.int64)
        held = int(st.ctx_g[rows].sum()) + sum(r[1] for r in gone_pre)
        ids = np.concatenate((rows, np.asarray([r[0] for r in gone_pre], dtype=np.int64)))
        st.prefill_g[ids] = st.ctx_g[ids]
        st.seen_g[ids] = 0  # (the drafters' rows are freed too)
        st.preemptions[ids] += 1
        self.stats[_PREEMPTED] += held
        self.receive(ids.tolist(), front=True)

    # ------------------------------------------------------------------ the process
    def run(self):
        """The instance's process: engine steps while it has requests, else wait for work."""
        st, policy = self.stage, self.policy
        self._record = st.timeline.append if st.timeline.enabled else None
        self._learn_acceptance = getattr(policy, "needs_acceptance", True)
        self._observes = getattr(policy, "observes", True)
        self._steady = getattr(policy, "steady_steps", None) if not self._observes and st.max_run > 1 else None
        while True:
            if self.outbox:
                st.carry_out(self)
            if (self.batch or self.pre or self.waiting) and (yield from self._engine_step()):
                continue
            if (yield from self._idle()):
                return

    def _engine_step(self):
        """One scheduler step and its forward; False when nothing could be scheduled."""
        strat, n, prefix, chunks = self._schedule()
        if not n.any() and not chunks.any():
            if self.arrived:
                self._join(self.arrived, [int(self.stage.ctx_g[s]) for s in self.arrived])
                self.arrived = []
                self._finish_rows(0, 0)
            return bool(self.batch)
        m = self._stretch_length(strat, n) if not len(chunks) and not self.arrived else 0
        if m >= 2:
            yield from self._stretch(strat, n, m)
        else:
            yield from self._forward(strat, n, prefix, chunks)
        return True

    def _schedule(self):
        """vLLM's `schedule()`: make room in the KV blocks (preempting the newest), ask the
        policy, split the token budget between the decode rows (`n` tokens each), the prompts
        under way and, when nothing was preempted, queued requests (a chunk each, after
        `prefix` tokens computed or cached); returns (strategy, n, prefix, chunks)."""
        budget = self.eng.max_num_batched_tokens
        keep = self._fit([r[1] for r in self.pre])
        preempted = keep < self.batch + len(self.pre)
        if preempted:
            self._preempt_tail(keep)
        self._now = self._state() if self.batch else None
        strat = self.prober(self.policy.choose(self._now)) if self._now is not None else None
        want = self._wanted(strat)
        n = np.minimum(want, np.clip(budget - (np.cumsum(want) - want), 0, None))
        if strat is not None and strat.is_tree:
            n = np.where(n < want, np.minimum(n, 1), n)  # a tree is verified whole, or the row decodes
        budget -= int(n.sum())
        chunks = []
        for r in self.pre:
            chunks.append(min(r[2] - r[1], budget))
            budget -= chunks[-1]
        keep = self._fit([r[1] + c for r, c in zip(self.pre, chunks)])
        if keep < self.batch + len(self.pre):
            self._preempt_tail(keep)
            chunks, preempted = chunks[: len(self.pre)], True
        prefix = [r[1] for r in self.pre]
        if not preempted:
            self._admit_waiting(budget, chunks, prefix)
        for r, c in zip(self.pre, chunks):
            self._cache(r[0], r[1] + c)
            r[1] += c
        self.stats[_PREFILL] += sum(chunks)
        self._preempted = preempted
        return strat, n, np.asarray(prefix, dtype=np.int64), np.asarray(chunks, dtype=np.int64)

    def _state(self) -> EngineState:
        st = self.stage
        return EngineState(
            self.idx,
            self.steps,
            self.env.now - st.t0,
            self.sid,
            self.ctx,
            self.ctx_sum,
            len(self.waiting) + len(self.pre),
            (self.cap_blocks - self.used_blocks) * self.eng.block_size,
            st.estimator,
        )

    def _wanted(self, strat) -> np.ndarray:
        """Tokens each decode row asks of this step: 1, plus its drafts."""
        if strat is None:
            return np.zeros(0, dtype=np.int64)
        if strat.drafter is None:
            return np.ones(self.batch, dtype=np.int64)
        if strat.k_per_row is not None:
            return np.asarray(strat.k_per_row, dtype=np.int64) + 1
        return np.full(self.batch, 1 + strat.nodes, dtype=np.int64)

    # ------------------------------------------------------------------ prompts
    def _cache(self, sid: int, computed: int) -> None:
        """The prompt's full blocks scheduled so far enter the prefix cache."""
        if self.eng.prefix_caching:
            ro, bs = self.stage.rollout, self.eng.block_size
            p = int(ro.prompt_of[sid])
            full = min(computed, int(ro.prompt_len[sid])) // bs * bs
            if full > self.cached.get(p, 0):
                self.cached[p] = full

    def _hit(self, sid: int, total: int) -> int:
        """Tokens of a request found in the prefix cache: its prompt's cached blocks, at most
        `total` - 1 tokens, block-aligned (vLLM computes at least the last token)."""
        if not self.eng.prefix_caching:
            return 0
        bs = self.eng.block_size
        return min(self.cached.get(int(self.stage.rollout.prompt_of[sid]), 0), (total - 1) // bs * bs)

    def _admit_waiting(self, budget: int, chunks: list[int], prefix: list[int]) -> None:
        """Admit queued requests while the budget, the batch limit and free KV blocks allow;
        their first chunks go to `chunks` (computed before it: `prefix`). A request that arrives
        with its KV cache (a migration) joins the decode rows at once."""
        st, bs = self.stage, self.eng.block_size
        ro = st.rollout
        free = self.cap_blocks - self.used_blocks
        groups = set(ro.prompt_of[self.sid].tolist()) | {int(ro.prompt_of[r[0]]) for r in self.pre}
        while self.waiting and budget > 0 and self.batch + len(self.pre) < st.max_batch:
            sid = self.waiting[0]
            total, need = int(st.ctx_g[sid]), int(st.prefill_g[sid])
            hit = self._hit(sid, total) if need else total
            chunk = min(total - hit, budget)
            if not self.eng.chunked_prefill and chunk < total - hit:
                break
            p = int(ro.prompt_of[sid])
            blocks = int(self._blocks(np.asarray([sid]), np.asarray([hit + chunk + (0 if need else st.lookahead)]))[0])
            if self.eng.prefix_caching and p in groups:
                blocks -= int(ro.prompt_len[sid]) // bs
            if blocks > free:
                break
            self.waiting.popleft()
            st.prefill_g[sid] = 0
            free -= blocks
            self.used_blocks += blocks
            groups.add(p)
            if not need:  # arrived with its KV: a decode row from the next step
                self.arrived.append(sid)
                continue
            self.stats[_CACHED] += hit
            self._cache(sid, hit + chunk)  # (vLLM caches a block when it allocates it)
            self.pre.append([sid, hit, total])
            chunks.append(chunk)
            prefix.append(hit)
            budget -= chunk

    def _join(self, ids: list[int], ctx: list[int]) -> None:
        """Requests whose prompt is in the KV cache become decode rows (after those running)."""
        st = self.stage
        ids_a = np.asarray(ids, dtype=np.int64)
        st.estimator.retire(self.sid)
        self._settle_seen()
        self.seen = np.concatenate((self.seen, st.seen_g[ids_a]))
        self.sid = np.concatenate((self.sid, ids_a))
        self.ctx = np.concatenate((self.ctx, np.asarray(ctx, dtype=np.int64)))
        self.tot = np.concatenate((self.tot, st.tot_g[ids_a]))
        self.ninv = np.concatenate((self.ninv, st.ninv[ids_a]))
        self.ctx_sum += int(sum(ctx))
        self.min_rem = 0  # rescan: a joining row may finish at once

    # ------------------------------------------------------------------ the forward
    def _price(self, rows: int, tokens: int, ctx_rows: int, prefix: np.ndarray, chunks: np.ndarray) -> float:
        """The target's step over `rows` decode/verify rows of `tokens` in all beside prompt
        chunks: at the next capture size without chunks, one mixed forward with them."""
        cost = self.stage.cost
        q = tokens / rows if rows else 1.0
        if not chunks.sum():
            size = self.eng.padded(tokens)
            self.stats[_PADDED] += size - tokens
            return float(cost.verify_time(rows if size == tokens else rows * size / tokens, q, ctx_rows))
        self.stats[_MIXED] += rows > 0
        mixed = getattr(cost, "mixed_time", None)
        if mixed is not None:
            return float(mixed(rows, q, ctx_rows, prefix, chunks))
        # a cost model without a mixed price: the rows' verify and the chunks' prefill, apart
        verify = float(cost.verify_time(rows, q, ctx_rows)) if rows else 0.0
        return verify + float(cost.prefill_time(int(chunks.sum()), int((chunks * chunks).sum())))

    def _draft(self, strat, n: np.ndarray):
        """Drafting for the rows (what the policy asked, as vLLM proposed it last step), the
        accepted drafts of the scheduled ones (a row verifies the n - 1 drafts the budget
        allowed) and the rank-1 trials of a tree: (seconds, drafted, caught, d, acc, ks, trials)."""
        st, cost, b, ctx_sum = self.stage, self.stage.cost, self.batch, self.ctx_sum
        d = st.drafter_idx[strat.drafter]
        if strat.k_per_row is None:
            t_draft, drafted = float(cost.draft_time(strat.drafter, b, strat.k, ctx_sum, strat.width)), b * strat.nodes
        else:
            t_draft = float(cost.draft_time_per_row(strat.drafter, strat.k_per_row, ctx_sum))
            drafted = int(np.add.reduce(strat.k_per_row))
        caught = 0
        if self.current != d:
            t_feed, caught = self._catch_up(d)
            t_draft += t_feed
        ks = np.maximum(n - 1, 0)
        trials = None
        if strat.is_tree:
            acc, hits, misses = self._draw_tree(d, strat, 1)
            whole = n == 1 + strat.nodes
            acc = np.where(whole, acc[0], 0)
            trials = (np.where(whole, hits, 0), np.where(whole, misses, 0))
        else:
            acc = self._draw_accepted(d, ks, 1)[0]
        return t_draft, drafted, caught, d, acc, ks, trials

    def _forward(self, strat, n: np.ndarray, prefix: np.ndarray, chunks: np.ndarray):
        """Run the step: draft, one forward over rows and chunks, advance the rows, turn
        completed prompts (and KV arrivals) into decode rows."""
        env, st = self.env, self.stage
        t0, b, sid, ctx_sum = env.now, self.batch, self.sid, self.ctx_sum
        sched = n > 0
        rows, tokens = int(sched.sum()), int(n.sum())
        ctx_rows = ctx_sum if rows == b else int(self.ctx[sched].sum())
        price = self._price(rows, tokens, ctx_rows, prefix, chunks)
        t_draft, drafted, caught, d, acc, ks, trials = 0.0, 0, 0, -1, None, None, None
        if strat is not None and strat.drafter is not None:
            t_draft, drafted, caught, d, acc, ks, trials = self._draft(strat, n)
        if self.eng.async_scheduling:  # host work beside the GPU's
            on_host = strat is not None and strat.drafter in st.host_drafters
            gpu = price - self._oh + (0.0 if on_host else t_draft)
            dt = max(gpu, self._oh + (t_draft if on_host else 0.0))
        else:
            dt = price + t_draft
        yield env.timeout(dt)
        if acc is not None and self._learn_acceptance:
            if trials is not None:
                st.estimator.update_trials(strat.drafter, sid, *trials)
            else:
                st.estimator.update(strat.drafter, sid, *learned_trials(acc, ks, stage_decay(st, d)))
        adv = np.where(sched, (acc if acc is not None else 0) + 1, 0)
        self.ctx += adv
        emitted = int(adv.sum())
        done = [r for r in self.pre if r[1] >= r[2]]
        first = len(done)
        if done or self.arrived:  # a completed prompt samples its first token
            self.pre = [r for r in self.pre if r[1] < r[2]]
            self._join(
                [r[0] for r in done] + self.arrived, [r[2] + 1 for r in done] + [int(st.ctx_g[s]) for s in self.arrived]
            )
            self.arrived = []
        self.busy += dt
        emitted = (self._finish_rows(emitted, int(n.max(initial=0))) if self.batch else 0) + first
        t_verify = dt - t_draft
        n_acc = int(acc.sum()) if acc is not None else 0
        if strat is not None and self._observes:
            self.policy.observe(
                StepOutcome(
                    self.idx, self.steps, strat, b, drafted, n_acc, emitted, dt, t_draft, t_verify, sid, acc, caught
                )
            )
        if self._record:
            n_chunks = int((chunks > 0).sum())
            kind = (KIND_MIXED if n_chunks else KIND_DECODE) if rows else KIND_PREFILL
            k, w = (strat.k, strat.width) if strat is not None else (0, 1)
            shape = (b, ctx_sum) if rows else (n_chunks, int(chunks.sum()))
            self._log(t0, kind, shape[0], d, k, w, drafted, n_acc, emitted, t_draft, t_verify, shape[1])
        self.steps += 1

    # ------------------------------------------------------------------ steady stretches
    def _stretch_length(self, strat, n: np.ndarray) -> int:
        """How many steps, this one (pure decode/verify, scheduled with nothing admitted or
        preempted) first, are certain to schedule the same: every row whole within the budget,
        no row able to finish, the KV blocks holding every row's growth (so no preemption, and
        a queue head that did not fit still does not), the policy promising its choice."""
        st = self.stage
        if self._steady is None or strat is None or self._preempted or st.realloc_active or self.prober.probed:
            return 0
        if int(n.sum()) != int(self._wanted(strat).sum()):  # the budget cut a row short
            return 0
        step, b = strat.k + 1, self.batch
        if self.min_rem <= 2 * step:  # the cheap bound is too loose to allow a stretch: tighten it
            self.min_rem = int((self.tot - self.ctx).min())
        # a row's blocks grow by at most ceil(g / block_size) over g tokens
        free = (self.cap_blocks - self.used_blocks) // b * self.eng.block_size
        m = min(st.max_run, (self.min_rem - 1) // step, 1 + free // step)
        if strat.is_off:
            m = min(m, 1 + self.prober.off_steps_left())  # stop short of the next probe
        if m < 2:
            return 0
        return min(m, 1 + self._steady(self._now, strat, b * step))

    def _stretch_draws(self, strat, d: int, ks: np.ndarray, m: int):
        """Accepted drafts (m, batch) and each step's tree trials (or None), drawn as m single steps draw."""
        if not strat.is_tree:
            return self._draw_accepted(d, ks, m), None
        steps = [self._draw_tree(d, strat, 1) for _ in range(m)]
        return np.concatenate([s[0] for s in steps]), [(s[1], s[2]) for s in steps]

    def _stretch(self, strat, n: np.ndarray, m: int):
        """m steps of `strat` over the unchanged batch, each as `_forward` runs it: priced at
        once, then stepped through at the same times with the same estimator updates."""
        env, st, cost, b = self.env, self.stage, self.stage.cost, self.batch
        if strat.is_off:
            self.prober.skip(m - 1)
        tokens = int(n.sum())
        size = self.eng.padded(tokens)
        self.stats[_PADDED] += m * (size - tokens)
        d, acc, trials, drafted, ks = -1, np.zeros((m, b), dtype=np.int64), None, 0, np.maximum(n - 1, 0)
        t_draft: float | np.ndarray = 0.0
        if strat.drafter is None:
            emitted = np.full(m, b, dtype=np.int64)
        else:
            d = st.drafter_idx[strat.drafter]
            acc, trials = self._stretch_draws(strat, d, ks, m)
            emitted = acc.sum(axis=1) + b
        ctx_at = self.ctx_sum + np.concatenate(([0], np.cumsum(emitted[:-1])))
        price = cost.verify_time(b if size == tokens else b * size / tokens, tokens / b, ctx_at)
        if strat.drafter is not None:
            if strat.k_per_row is None:
                t_draft, drafted = cost.draft_time(strat.drafter, b, strat.k, ctx_at, strat.width), b * strat.nodes
            else:
                t_draft = cost.draft_time_per_row(strat.drafter, strat.k_per_row, ctx_at)
                drafted = int(np.add.reduce(strat.k_per_row))
            t_draft = np.broadcast_to(np.asarray(t_draft, dtype=float), (m,)).copy()
            if self.current != d:
                t_draft[0] += self._catch_up(d)[0]
        if self.eng.async_scheduling:  # host work beside the GPU's
            on_host = strat.drafter in st.host_drafters
            dt = np.maximum(price - self._oh + (0.0 if on_host else t_draft), self._oh + (t_draft if on_host else 0.0))
        else:
            dt = price + t_draft
        dt_l, draft_l = dt.tolist(), np.broadcast_to(t_draft, (m,)).tolist()
        emit_l, ctx_l = emitted.tolist(), ctx_at.tolist()
        learn = d >= 0 and self._learn_acceptance
        decay = stage_decay(st, d) if learn else 1.0
        same = (KIND_DECODE, b, d, strat.k, strat.width, drafted)
        for j in range(m):
            t0 = env.now
            yield env.timeout(dt_l[j])
            if learn:
                if trials is not None:
                    st.estimator.update_trials(strat.drafter, self.sid, *trials[j])
                else:
                    st.estimator.update(strat.drafter, self.sid, *learned_trials(acc[j], ks, decay))
            self.busy += dt_l[j]
            if self._record:
                n_acc = emit_l[j] - b if d >= 0 else 0
                self._log(t0, *same, n_acc, emit_l[j], draft_l[j], dt_l[j] - draft_l[j], ctx_l[j])
            self.steps += 1
        self.ctx += acc.sum(axis=0) + m
        self.ctx_sum += int(emitted.sum())
        self.min_rem -= m * int(n.max())

    def _log(self, t0: float, kind: int, rows: int, d: int, k: int, w: int, *tail) -> None:
        """One step's timeline record (`sim/timeline.COLUMNS`); `tail`: drafted, accepted,
        emitted, draft seconds, verify seconds and the context (or chunk) tokens."""
        self.stage.timeline.append(
            (self.stage.rl_step, self.idx, self.steps, t0 - self.stage.t0, kind, rows, d, k, w, *tail)
        )
