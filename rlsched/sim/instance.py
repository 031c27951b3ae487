"""One inference instance as a SimPy process: continuous batching with speculative steps.

Running sequences are rows of numpy arrays (sample id, context length, final length, and
-1/log(acceptance) per drafter), updated in bulk each step. Each step asks the DraftPolicy
for a Strategy, advances simulated time by the cost model, and advances every row by its
sampled accepted drafts + 1, capped by what it has left.

Accepted drafts of a chain with per-token acceptance a: the count of successes before the
first failure, floor(E / -log a) with E ~ Exp(1), capped at k.

A model drafter keeps its own cache of each row, which the executor brings up to date inside
its next propose: a row that joined is fed its whole context, and after steps decoded without
that drafter every row is fed the tokens since. `seen` holds, per row and drafter, how much
of the row the drafter has taken in; a drafting step pays `drafter_prefill_time` for the rest
(the steady feed of one or two tokens a row is in `draft_time`). While a drafter drafts every
step its rows are current and nothing is tracked (`current`; one drafter at a time).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import numpy as np

from rlsched.policies.position import accepted_drafts, learned_trials, stage_decay
from rlsched.policies.probe import prober_for
from rlsched.policies.tree import draw_tree
from rlsched.policies.types import EngineState, StepOutcome
from rlsched.sim.timeline import KIND_DECODE, KIND_PREFILL

if TYPE_CHECKING:
    import simpy

    from rlsched.sim.cluster import GenerationStage

_EMPTY_I = np.zeros(0, dtype=np.int64)


class Instance:
    """A data-parallel inference instance (one TP group) inside a generation stage."""

    def __init__(self, idx: int, stage: GenerationStage, policy, rng: np.random.Generator):
        self.idx, self.stage, self.policy, self.rng = idx, stage, policy, rng
        self.prober = prober_for(policy, tuple(stage.drafter_idx), stage.probe_every)
        self.env = stage.env
        n_drafters = stage.ninv.shape[1]
        self.sid = _EMPTY_I
        self.ctx = _EMPTY_I
        self.tot = _EMPTY_I  # context length at which each row is finished
        self.ninv = np.zeros((0, n_drafters))
        self.seen = np.zeros((0, n_drafters), dtype=np.int64)  # context each drafter has taken in
        self.current = -1  # the drafter that drafted the last step (its `seen` is ctx), or -1
        self.ctx_sum = 0
        self.min_rem = 0
        self.waiting: deque[int] = deque()
        self.outbox: list = []  # migrations to carry out at the next step boundary
        self.wake: simpy.Event | None = None
        self.steps = 0
        self.busy = 0.0
        self._exp = np.zeros(0)
        self._exp_pos = 0

    # ------------------------------------------------------------------ helpers
    @property
    def batch(self) -> int:
        return len(self.sid)

    @property
    def kv_used(self) -> int:
        return self.ctx_sum

    def _exp_draws(self, n: int, peek: bool = False) -> np.ndarray:
        """The next n Exp(1) draws of this instance's stream, pre-drawn in chunks; the stream
        is the same however it is sliced (n single steps or one run of n steps). `peek` reads
        them and leaves them to be drawn (the oracle's view of the draws ahead)."""
        if self._exp_pos + n > len(self._exp):
            fresh = self.rng.standard_exponential(max(65536, n))
            self._exp = np.concatenate((self._exp[self._exp_pos :], fresh))
            self._exp_pos = 0
        out = self._exp[self._exp_pos : self._exp_pos + n]
        self._exp_pos += 0 if peek else n
        return out

    def _draw_accepted(self, d: int, k, n: int) -> np.ndarray:
        """Accepted drafts of each row of a chain for n steps, shape (n, batch); `k` is one
        draft length or one per row."""
        exp = self._exp_draws(n * self.batch).reshape(n, -1)
        acc = accepted_drafts(exp, self.ninv[:, d], stage_decay(self.stage, d))
        np.minimum(acc, k, out=acc)
        return acc

    def _draw_tree(self, d: int, strat, n: int):
        """A tree strategy's n steps: accepted drafts (n, batch), and the rank-1 trials each row
        showed (hits, misses), summed over the steps (`policies/tree.draw_tree`)."""
        shape = self.stage.tree(d, strat)
        a = np.exp(-1.0 / np.maximum(self.ninv[:, d], 1e-300)) * self.stage.tree_top1[d]  # rank 1's rate
        u = np.exp(-self._exp_draws(n * self.batch * shape.k)).reshape(shape.k, -1)  # uniforms
        acc, hits, misses = draw_tree(shape, np.tile(a, n), self.stage.tree_gain[d], u)
        b = self.batch
        return acc.reshape(n, b), hits.reshape(n, b).sum(axis=0), misses.reshape(n, b).sum(axis=0)

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
        st.estimator.retire(self.sid)
        st.ctx_g[ids] = self.ctx[gone]
        self._settle_seen()
        st.seen_g[ids] = self.seen[gone]
        self.ctx_sum -= int(self.ctx[gone].sum())
        self.sid, self.ctx, self.tot, self.ninv = self.sid[keep], self.ctx[keep], self.tot[keep], self.ninv[keep]
        self.seen = self.seen[keep]
        return ids

    # ------------------------------------------------------------------ drafter caches
    def _settle_seen(self) -> None:
        """Write out the current drafter's `seen`: the rows are about to change without it (a
        step without it, rows joining or leaving). A Python int test: this runs every step."""
        if self.current >= 0:
            self.seen[:, self.current] = self.ctx
            self.current = -1

    def _catch_up(self, d: int) -> tuple[float, int]:
        """(Seconds, tokens) drafter d spends taking in what it has not seen of the rows,
        before it drafts; the rows are then current for it. Fresh rows of one prompt are fed
        once (the executor's drafter copies that row's cache)."""
        if self.current == d:
            return 0.0, 0
        self._settle_seen()
        self.current = d
        st = self.stage
        seen = self.seen[:, d]
        feed = self.ctx - seen
        if not feed.any():
            return 0.0, 0
        fresh = np.flatnonzero((seen == 0) & (self.ctx == st.rollout.prompt_len[self.sid]))
        if len(fresh) > 1:
            _, first = np.unique(st.rollout.prompt_of[self.sid[fresh]], return_index=True)
            feed[np.delete(fresh, first)] = 0
        n = int(feed.sum())
        return float(st.cost.drafter_prefill_time(st.rollout.drafters[d], n, int((feed * feed).sum()))), n

    # ------------------------------------------------------------------ admission
    def _admit(self):
        """Move queued sequences into the batch while slots and KV tokens allow; charge
        their prefill (prompt, or whole context after a preemption or re-prefill migration)."""
        st = self.stage
        room = st.max_batch - self.batch
        kv_free = st.kv_capacity - st.kv_watermark - self.ctx_sum
        admitted: list[int] = []
        while self.waiting and room > 0:
            sid = self.waiting[0]
            need = int(st.ctx_g[sid])
            if need > kv_free:
                break
            self.waiting.popleft()
            admitted.append(sid)
            kv_free -= need
            room -= 1
        if not admitted:
            return 0.0, 0
        ids = np.asarray(admitted, dtype=np.int64)
        pre = st.prefill_g[ids]
        st.prefill_g[ids] = 0
        if st.share_prompts:
            pre = self._shared_prefill(ids, pre)
        st.estimator.retire(self.sid)
        self._settle_seen()
        self.seen = np.concatenate((self.seen, st.seen_g[ids]))
        self.sid = np.concatenate((self.sid, ids))
        self.ctx = np.concatenate((self.ctx, st.ctx_g[ids]))
        self.tot = np.concatenate((self.tot, st.tot_g[ids]))
        self.ninv = np.concatenate((self.ninv, st.ninv[ids]))
        self.ctx_sum += int(st.ctx_g[ids].sum())
        self.min_rem = int((self.tot - self.ctx).min())
        n_pre = int(pre.sum())
        return (st.cost.prefill_time(n_pre, int((pre * pre).sum())) if n_pre else 0.0), n_pre

    def _shared_prefill(self, ids: np.ndarray, pre: np.ndarray) -> np.ndarray:
        """The prefill tokens of joining sequences when samples of a prompt share one: a fresh
        sequence (context = its prompt) whose prompt a running sequence holds, or one that
        joins before it in this step, costs nothing (the executor copies that prompt's KV)."""
        st = self.stage
        prompt_of = st.rollout.prompt_of
        fresh = (pre > 0) & (st.ctx_g[ids] == st.rollout.prompt_len[ids])
        if not fresh.any():
            return pre
        held = set(prompt_of[self.sid].tolist())
        pre = pre.copy()
        for j in np.flatnonzero(fresh):
            p = int(prompt_of[ids[j]])
            if p in held:
                pre[j] = 0
            else:
                held.add(p)
        return pre

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
        st.seen_g[ids] = 0  # (the drafters' rows are freed too)
        st.preemptions[ids] += 1
        self.receive(ids.tolist(), front=True)

    # ------------------------------------------------------------------ steady runs
    def _steady_run_length(self, state: EngineState, strat, steady) -> int:
        """How many steps, starting now, are certain to repeat `strat` with the same batch:
        the policy promises its choice, no row can finish, the KV cache cannot overflow."""
        st, step_tokens = self.stage, strat.k + 1
        growth = self.batch * step_tokens
        if self.min_rem <= 2 * step_tokens:  # the cheap bound is too loose to allow a run: tighten it
            self.min_rem = int((self.tot - self.ctx).min())
        n = min(st.max_run, (self.min_rem - 1) // step_tokens, (st.kv_capacity - self.ctx_sum) // growth)
        if n < 2:
            return 0
        return min(n, 1 + steady(state, strat, growth))

    def _steady_run(self, strat, n: int, learn_acceptance: bool, record):
        """n steps of one strategy over an unchanged batch, priced and drawn in one go; the
        random draws are consumed in the same order as n single steps would. The acceptance
        outcomes reach the shared estimator when the run ends: other instances reading it in
        between see them later than step by step."""
        st, cost, env, b = self.stage, self.stage.cost, self.env, self.batch
        t0 = env.now
        if strat.drafter is None:
            self._settle_seen()
            emitted = np.full(n, b, dtype=np.int64)
            ctx_at = self.ctx_sum + b * np.arange(n)
            t_draft = np.zeros(n)
            t_verify = cost.verify_time(b, 1, ctx_at)
            advance = n
            d = -1
        else:
            d = st.drafter_idx[strat.drafter]
            ks = strat.k if strat.k_per_row is None else strat.k_per_row
            if strat.is_tree:
                acc, hits, misses = self._draw_tree(d, strat, n)
            else:
                acc = self._draw_accepted(d, ks, n)
            emitted = acc.sum(axis=1) + b
            ctx_at = self.ctx_sum + np.concatenate(([0], np.cumsum(emitted[:-1])))
            if strat.k_per_row is None:
                t_draft = cost.draft_time(strat.drafter, b, strat.k, ctx_at, strat.width)
            else:
                t_draft = cost.draft_time_per_row(strat.drafter, strat.k_per_row, ctx_at)
            # one price a step, a copy (the catch-up goes on the first; a host drafter's price
            # of per-row lengths comes back as one number for every step)
            t_draft = np.broadcast_to(np.asarray(t_draft, dtype=float), (n,)).copy()
            t_draft[0] += self._catch_up(d)[0]
            t_verify = cost.verify_time(b, strat.tokens_per_row, ctx_at)
            advance = acc.sum(axis=0) + n
            if st.chains is not None:
                st.chains += (n * round(b * strat.drafted_per_row), acc.sum(), (acc < ks).sum(), n * b)
        dt = t_draft + t_verify
        total = float(dt.sum())
        yield env.timeout(total)
        self.ctx += advance
        if strat.drafter is not None and learn_acceptance:  # outcomes known only now
            if strat.is_tree:
                self.stage.estimator.update_trials(strat.drafter, self.sid, hits, misses)
            else:
                self.stage.estimator.update_many(strat.drafter, self.sid, *learned_trials(acc, ks, stage_decay(st, d)))
        self.busy += total
        self.ctx_sum += int(emitted.sum())
        self.min_rem -= n * (strat.k + 1)
        if record:
            starts = t0 - st.t0 + np.concatenate(([0.0], np.cumsum(dt[:-1])))
            st.timeline.append_run(
                (
                    st.rl_step,
                    self.idx,
                    np.arange(self.steps, self.steps + n),
                    starts,
                    KIND_DECODE,
                    b,
                    d,
                    strat.k,
                    strat.width,
                    round(b * strat.drafted_per_row),
                    emitted - b if d >= 0 else 0,
                    emitted,
                    t_draft,
                    t_verify,
                    ctx_at,
                ),
                n,
            )
        self.steps += n

    # ------------------------------------------------------------------ the process
    def run(self):
        """The instance's process: admit and prefill queued sequences, decode the batch a step
        (or a steady run of steps) at a time, and wait while it has nothing to run."""
        st, policy = self.stage, self.policy
        self._record = st.timeline.append if st.timeline.enabled else None
        self._learn_acceptance = getattr(policy, "needs_acceptance", True)
        self._observes = getattr(policy, "observes", True)
        # runs of identical steps are simulated at once when the policy can promise them
        self._steady = getattr(policy, "steady_steps", None) if not self._observes and st.max_run > 1 else None
        while True:
            if self.outbox:
                st.carry_out(self)
            if self.waiting and self.batch < st.max_batch:
                yield from self._prefill()
            if self.batch:
                yield from self._decode()
            elif (yield from self._idle()):
                return

    def _prefill(self):
        """Admit what the queue head allows and spend their prefill, a step of its own."""
        t_pre, n_pre = self._admit()
        if not n_pre:
            return
        st, t0 = self.stage, self.env.now
        yield self.env.timeout(t_pre)
        self.busy += t_pre
        if self._record:
            self._record(
                (
                    st.rl_step,
                    self.idx,
                    self.steps,
                    t0 - st.t0,
                    KIND_PREFILL,
                    self.batch,
                    -1,
                    0,
                    1,
                    0,
                    0,
                    0,
                    0.0,
                    t_pre,
                    n_pre,
                )
            )
        self.steps += 1

    def _idle(self):
        """No rows: returns True when the stage is done, else waits for work (or goes on at once
        when some is queued or waits in the outbox)."""
        st = self.stage
        if self.waiting:  # the queue head does not fit in KV: cannot happen (checked upfront)
            raise RuntimeError(
                f"instance {self.idx}: sequence of {st.ctx_g[self.waiting[0]]} tokens "
                f"exceeds KV capacity {st.kv_capacity}"
            )
        if st.done.triggered:
            return True
        st.report(self, "idle")
        if self.waiting or self.outbox:
            return False
        self.wake = self.env.event()
        yield self.wake | st.done
        self.wake = None
        return False

    def _decode(self):
        """Ask the policy for a strategy and run one step of it, or a steady run of identical
        steps when the policy promises one and nothing can change the batch in between."""
        st, b, ctx_sum = self.stage, self.batch, self.ctx_sum
        # new work can arrive between steps (migrations) or be admitted: step one by one
        block_blocked = st.realloc_active or (self.waiting and b < st.max_batch)
        state = EngineState(
            self.idx,
            self.steps,
            self.env.now - st.t0,
            self.sid,
            self.ctx,
            ctx_sum,
            len(self.waiting),
            st.kv_capacity - ctx_sum,
            st.estimator,
        )
        strat = self.prober(self.policy.choose(state))
        if self._steady is not None and not block_blocked and not self.prober.probed:
            n = self._steady_run_length(state, strat, self._steady)
            if strat.is_off:
                n = min(n, 1 + self.prober.off_steps_left())  # stop short of the next probe
            if n >= 2:
                if strat.is_off:
                    self.prober.skip(n - 1)
                yield from self._steady_run(strat, n, self._learn_acceptance, self._record)
                return
        yield from self._step(strat)

    def _step(self, strat):
        """One step of `strat`: draft, verify and advance every row by its accepted drafts + 1."""
        env, st, cost = self.env, self.stage, self.stage.cost
        b, ctx_sum, sid, t0 = self.batch, self.ctx_sum, self.sid, env.now
        caught, d = 0, -1
        if strat.drafter is None:
            self._settle_seen()
            t_draft = 0.0
            t_verify = cost.verify_time(b, 1, ctx_sum)
            yield env.timeout(t_verify)
            self.ctx += 1
            emitted, acc, drafted, max_adv = b, None, 0, 1
        else:
            k, w, ks = strat.k, strat.width, strat.k_per_row
            d = st.drafter_idx[strat.drafter]
            if ks is None:
                t_draft, drafted, ks = cost.draft_time(strat.drafter, b, k, ctx_sum, w), b * strat.nodes, k
            else:
                t_draft, drafted = float(cost.draft_time_per_row(strat.drafter, ks, ctx_sum)), int(np.add.reduce(ks))
            if self.current != d:
                t_feed, caught = self._catch_up(d)
                t_draft += t_feed
            t_verify = cost.verify_time(b, strat.tokens_per_row, ctx_sum)
            if w > 1:
                acc, hits, misses = self._draw_tree(d, strat, 1)
                acc = acc[0]
            else:
                acc = self._draw_accepted(d, ks, 1)[0]
            if st.chains is not None:
                st.chains += (drafted, acc.sum(), (acc < ks).sum(), b)
            yield env.timeout(t_draft + t_verify)
            if self._learn_acceptance:
                if w > 1:
                    st.estimator.update_trials(strat.drafter, sid, hits, misses)
                else:
                    st.estimator.update(strat.drafter, sid, *learned_trials(acc, ks, stage_decay(st, d)))
            adv = acc + 1
            self.ctx += adv  # may overshoot a row's end; trimmed in `_finish_rows` when it finishes
            emitted, max_adv = int(np.add.reduce(adv)), k + 1
        dt = t_draft + t_verify
        self.busy += dt
        emitted = self._finish_rows(emitted, max_adv)
        n_acc = emitted - b if acc is not None else 0
        if self._observes:
            self.policy.observe(
                StepOutcome(
                    self.idx, self.steps, strat, b, drafted, n_acc, emitted, dt, t_draft, t_verify, sid, acc, caught
                )
            )
        if self._record:
            self._record(
                (
                    st.rl_step,
                    self.idx,
                    self.steps,
                    t0 - st.t0,
                    KIND_DECODE,
                    b,
                    d,
                    strat.k,
                    strat.width,
                    drafted,
                    n_acc,
                    emitted,
                    t_draft,
                    t_verify,
                    ctx_sum,
                )
            )
        self.steps += 1
        if self.ctx_sum > st.kv_capacity:
            self._preempt_if_full()

    def _finish_rows(self, emitted: int, max_adv: int) -> int:
        """After a step that advanced the rows by up to `max_adv` tokens: trim the rows that
        overshot their end, hand the finished ones to the stage; returns the tokens emitted."""
        self.min_rem -= max_adv  # a lower bound on every row's tokens left: skip the scan while > 0
        left = None
        if self.min_rem <= 0:
            left = self.tot - self.ctx
            if left.min() <= 0:
                emitted += int(left[left < 0].sum())  # tokens past a row's end were never emitted
                np.minimum(self.ctx, self.tot, out=self.ctx)
            else:
                left = None
        self.ctx_sum += emitted
        if left is not None:  # some rows finished this step
            self.stage.finished(self, self.take_rows(left > 0))
        if self.min_rem <= 0:
            self.min_rem = int((self.tot - self.ctx).min()) if self.batch else 0
        return emitted
