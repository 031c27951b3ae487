"""One inference instance as a SimPy process: continuous batching with speculative steps.

Running sequences are rows of numpy arrays (sample id, context length, tokens left, and
-1/log(acceptance) per drafter), updated in bulk each step. Each step asks the DraftPolicy
for a Strategy, advances simulated time by the cost model, and advances every row by its
sampled accepted drafts + 1, capped by what it has left.

Accepted drafts of a chain with per-token acceptance a: the count of successes before the
first failure, floor(E / -log a) with E ~ Exp(1), capped at k.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import numpy as np

from rlsched.policies.types import EngineState, StepOutcome
from rlsched.sim.timeline import KIND_DECODE, KIND_PREFILL

if TYPE_CHECKING:
    from rlsched.sim.cluster import GenerationStage

_EMPTY_I = np.zeros(0, dtype=np.int64)


class Instance:
    """A data-parallel inference instance (one TP group) inside a generation stage."""

    def __init__(self, idx: int, stage: "GenerationStage", policy, rng: np.random.Generator):
        self.idx, self.stage, self.policy, self.rng = idx, stage, policy, rng
        self.env = stage.env
        n_drafters = stage.ninv.shape[1]
        self.sid = _EMPTY_I
        self.ctx = _EMPTY_I
        self.rem = _EMPTY_I
        self.ninv = np.zeros((0, n_drafters))
        self.ctx_sum = 0
        self.waiting: deque[int] = deque()
        self.outbox: list = []  # migrations to carry out at the next step boundary
        self.wake = None
        self.steps = 0
        self.busy = 0.0
        self.below_threshold = False
        self._exp = np.zeros(0)
        self._exp_pos = 0

    # ------------------------------------------------------------------ helpers
    @property
    def batch(self) -> int:
        return len(self.sid)

    @property
    def kv_used(self) -> int:
        return self.ctx_sum

    def _exp_draws(self, n: int) -> np.ndarray:
        """n Exp(1) draws from a pre-drawn buffer (one RNG call per ~64k draws)."""
        if self._exp_pos + n > len(self._exp):
            self._exp = self.rng.standard_exponential(max(65536, n))
            self._exp_pos = 0
        out = self._exp[self._exp_pos:self._exp_pos + n]
        self._exp_pos += n
        return out

    def receive(self, ids, front: bool = False) -> None:
        """Queue sequences on this instance (initial assignment, migration, preemption)."""
        if front:
            self.waiting.extendleft(reversed(list(ids)))
        else:
            self.waiting.extend(ids)
        if self.wake is not None and not self.wake.triggered:
            self.wake.succeed()

    def take_rows(self, keep: np.ndarray) -> np.ndarray:
        """Remove the running rows where `keep` is False, saving their state; returns their ids."""
        st = self.stage
        gone = ~keep
        ids = self.sid[gone]
        st.ctx_g[ids] = self.ctx[gone]
        st.rem_g[ids] = self.rem[gone]
        self.ctx_sum -= int(self.ctx[gone].sum())
        self.sid, self.ctx, self.rem, self.ninv = self.sid[keep], self.ctx[keep], self.rem[keep], self.ninv[keep]
        return ids

    # ------------------------------------------------------------------ admission
    def _admit(self):
        """Move queued sequences into the batch while slots and KV tokens allow; charge
        their prefill (prompt, or whole context after a preemption or re-prefill migration)."""
        st = self.stage
        room = st.max_batch - self.batch
        kv_free = st.kv_capacity - st.kv_watermark - self.ctx_sum
        ids = []
        while self.waiting and room > 0:
            sid = self.waiting[0]
            need = int(st.ctx_g[sid])
            if need > kv_free:
                break
            self.waiting.popleft()
            ids.append(sid)
            kv_free -= need
            room -= 1
        if not ids:
            return 0.0, 0
        ids = np.asarray(ids, dtype=np.int64)
        pre = st.prefill_g[ids]
        st.prefill_g[ids] = 0
        self.sid = np.concatenate((self.sid, ids))
        self.ctx = np.concatenate((self.ctx, st.ctx_g[ids]))
        self.rem = np.concatenate((self.rem, st.rem_g[ids]))
        self.ninv = np.concatenate((self.ninv, st.ninv[ids]))
        self.ctx_sum += int(st.ctx_g[ids].sum())
        n_pre = int(pre.sum())
        return (st.cost.prefill_time(n_pre, int((pre * pre).sum())) if n_pre else 0.0), n_pre

    def _preempt_if_full(self) -> None:
        """Out of KV tokens: push the newest sequences back to the queue front to recompute."""
        st = self.stage
        over = self.ctx_sum - st.kv_capacity
        if over <= 0 or self.batch <= 1:
            return
        cum = np.cumsum(self.ctx[::-1])
        n = min(int(np.searchsorted(cum, over)) + 1, self.batch - 1)
        keep = np.ones(self.batch, dtype=bool)
        keep[-n:] = False
        ids = self.take_rows(keep)
        st.prefill_g[ids] = st.ctx_g[ids]
        st.preemptions[ids] += 1
        self.receive(ids.tolist(), front=True)

    # ------------------------------------------------------------------ the process
    def run(self):
        env, st, cost, policy, tl = self.env, self.stage, self.stage.cost, self.policy, self.stage.timeline
        est, rl_step, drafter_idx = st.estimator, st.rl_step, st.drafter_idx
        record = tl.append if tl.enabled else None
        while True:
            if self.outbox:
                st.carry_out(self)
            if self.waiting and self.batch < st.max_batch:
                t_pre, n_pre = self._admit()
                if n_pre:
                    t0 = env.now
                    yield env.timeout(t_pre)
                    self.busy += t_pre
                    if record:
                        record(rl_step, self.idx, self.steps, t0 - st.t0, KIND_PREFILL, self.batch, -1, 0, 1,
                               0, 0, 0, 0.0, t_pre, n_pre)
                    self.steps += 1
                if self.batch and self.below_threshold and self.batch >= st.realloc_threshold:
                    self.below_threshold = False
            b = self.batch
            if b == 0:
                if self.waiting:  # the queue head does not fit in KV: cannot happen (checked upfront)
                    raise RuntimeError(f"instance {self.idx}: sequence of {st.ctx_g[self.waiting[0]]} tokens "
                                       f"exceeds KV capacity {st.kv_capacity}")
                if st.done.triggered:
                    return
                st.report(self, "idle")
                if self.waiting or self.outbox:
                    continue
                self.wake = env.event()
                yield self.wake | st.done
                self.wake = None
                continue

            ctx_sum = self.ctx_sum
            state = EngineState(self.idx, self.steps, env.now - st.t0, self.sid, self.ctx, ctx_sum,
                                len(self.waiting), st.kv_capacity - ctx_sum, est)
            strat = policy.choose(state)
            t0 = env.now
            if strat.drafter is None:
                t_draft = 0.0
                t_verify = cost.verify_time(b, 1, ctx_sum)
                yield env.timeout(t_verify)
                adv = np.minimum(self.rem, 1)
                acc = None
                drafted = n_acc = 0
            else:
                k, w = strat.k, strat.width
                d = drafter_idx[strat.drafter]
                t_draft = cost.draft_time(strat.drafter, b, k, ctx_sum, w)
                t_verify = cost.verify_time(b, strat.tokens_per_seq, ctx_sum)
                ninv = self.ninv[:, d]
                if w > 1:  # a level passes if any of w candidates is accepted
                    ninv = -1.0 / np.log1p(-np.exp(w * np.log1p(-np.exp(-1.0 / np.maximum(ninv, 1e-300)))))
                acc = np.minimum(self._exp_draws(b) * ninv, k).astype(np.int64)
                yield env.timeout(t_draft + t_verify)
                adv = np.minimum(acc + 1, self.rem)
                drafted = b * k
                n_acc = int((adv - 1).sum())
                if w == 1:  # tree outcomes are per level, not per token: not fed to the estimator
                    est.update(strat.drafter, self.sid, acc, k)
            dt = t_draft + t_verify
            self.busy += dt
            self.ctx += adv
            self.rem -= adv
            emitted = int(adv.sum())
            self.ctx_sum += emitted
            policy.observe(StepOutcome(self.idx, self.steps, strat, b, drafted, n_acc, emitted, dt, t_draft,
                                       t_verify, self.sid, acc))
            if record:
                record(rl_step, self.idx, self.steps, t0 - st.t0, KIND_DECODE, b,
                       -1 if acc is None else d, strat.k, strat.width, drafted, n_acc, emitted,
                       t_draft, t_verify, ctx_sum)
            self.steps += 1
            if self.rem.min() == 0:
                done_ids = self.take_rows(self.rem > 0)
                st.finished(self, done_ids)
            if self.ctx_sum > st.kv_capacity:
                self._preempt_if_full()
            if st.realloc_active and 0 < self.batch < st.realloc_threshold and not self.below_threshold:
                self.below_threshold = True
                st.report(self, "drained")
