"""The oracle policies: yardsticks for reports that read the simulator's truth, never product
policies.

`oracle` plans the rest of its instance's rollout. It knows every row's true acceptance and
length, the rows queued behind them and what each drafter has not yet taken in, and prices the
remaining drain in expectation (`policies/fluid.py`). At each decision point it weighs every
strategy for the next stretch of steps (until about 5% of the batch finishes, at most
`HORIZON` steps) followed by the best fixed strategy for the rest, the catch-up a model
drafter pays on resuming included, and runs the best first stretch; then it plans again.
This is policy improvement over the fixed strategies (one-step lookahead with them as the base
policies): in the fluid model each plan is at least as good as keeping any fixed strategy to
the end, so the policy is at least as good as the best static setting and plain decoding, and
it sees what a choice carries forward (the catch-up after an off stretch, a shorter chain's
extra steps, the batch left for the drain's tail). What it leaves out is the spread of the
acceptance draws about their means and contexts growing within a stretch (`fluid.py`).

`oracle:seq` is the per-sequence rule with the true acceptance, re-derived every step (greedy per
step); `GreedyOraclePolicy` is the goodput rule likewise, kept to show what planning adds.
"""

from __future__ import annotations

import math
from typing import cast

import numpy as np

from rlsched.errors import UserError
from rlsched.policies.draft import GoodputPolicy, PolicyContext, SeqGoodputPolicy, tree_parts
from rlsched.policies.fluid import drain_seconds, grid_of_batches, progress, schedule
from rlsched.policies.position import reach
from rlsched.policies.tree import GRID
from rlsched.policies.types import OFF, CostModel, EngineState, StepOutcome, Strategy

HORIZON = 64  # most steps one plan runs before the next
STRETCH = 0.05  # a plan runs until about this share of the batch has finished
CONTINUATIONS = 4  # fixed strategies (besides off) a plan weighs after its first stretch


def _truth_of(ctx: PolicyContext, name: str):
    if ctx.true_acceptance is None:
        raise UserError(f"policy '{name}' needs the true acceptance of every sequence: only the simulator has it")
    return ctx.true_acceptance


class OraclePolicy:
    """Plans the rest of the rollout with the truth (see the module's docstring)."""

    name = "oracle"
    needs_acceptance = False
    observes = False

    def __init__(self, ctx: PolicyContext):
        self._truth = _truth_of(ctx, self.name)
        self.cost, self.ctx = cast(CostModel, ctx.cost), ctx
        self.options: list[Strategy] = [OFF]
        self._drafter_of: list[int] = [-1]  # each option's drafter (index into ctx.drafters), -1: off
        for j, d in enumerate(ctx.drafters):
            self.options += [Strategy(d, k) for k in range(1, ctx.k_max + 1)]
            self._drafter_of += [j] * ctx.k_max
            if (trees := ctx.trees(d)) is not None:
                self.options += trees[0]
                self._drafter_of += [j] * len(trees[0])
        self._drafter_of_arr = np.array(self._drafter_of)
        self._grid = grid_of_batches(ctx.max_batch)
        self._prices: dict[int, np.ndarray] = {}  # context bucket -> (options, grid) seconds a step
        self._plan: tuple | None = None  # (first step, last step + 1, batch, rows it may lose, strategy)

    # ------------------------------------------------------------------ the choice
    def choose(self, state: EngineState) -> Strategy:
        p = self._plan
        if p is not None and p[0] <= state.step < p[1] and abs(state.batch - p[2]) < p[3]:
            return p[4]
        strategy, steps = self._decide(state)
        b = state.batch
        self._plan = (state.step, state.step + max(1, int(steps)), b, max(1, math.ceil(STRETCH * b)), strategy)
        return strategy

    def steady_steps(self, state: EngineState, strategy: Strategy, max_growth: int) -> int:
        p = self._plan
        if p is None or p[4] is not strategy:
            return 0
        return max(0, p[1] - state.step - 1)

    def observe(self, outcome: StepOutcome) -> None:
        pass

    # ------------------------------------------------------------------ the plan
    def _tokens(self, ids: np.ndarray) -> np.ndarray:
        """Each row's expected tokens a step under every option: (rows, options)."""
        ctx, out = self.ctx, [np.ones((len(ids), 1))]
        for d in ctx.drafters:
            a = np.clip(self._truth(d, ids), 0.0, 1.0)
            out.append(np.cumsum(reach(a, ctx.k_max, ctx.decay(d)), axis=1)[:, 1:])
            if (trees := ctx.trees(d)) is not None:
                level = np.rint(np.clip(ctx.top1(d, a), 0.0, 1.0) * (len(GRID) - 1)).astype(np.int64)
                out.append(1.0 + trees[1].accepted[:, level].T)
        return np.concatenate(out, axis=1)

    def _price_table(self, ctx_per_row: float) -> np.ndarray:
        """Seconds a step of every option at every grid batch size, at `ctx_per_row` (cached by
        tenths of an octave of context)."""
        key = round(math.log(max(ctx_per_row, 1.0)) / math.log(1.07))
        if (hit := self._prices.get(key)) is not None:
            return hit
        r, cost, ctx = 1.07**key, self.cost, self.ctx
        ks = np.arange(1, ctx.k_max + 1)
        table = np.empty((len(self.options), len(self._grid)))
        for g, b in enumerate(self._grid.astype(int)):
            c = b * r
            verify = np.asarray(cost.verify_time(b, np.arange(1, ctx.k_max + 2), c), dtype=np.float64)
            col = [verify[:1]]
            for d in ctx.drafters:
                col.append(np.asarray(cost.draft_time(d, b, ks, c), dtype=np.float64) + verify[1:])
                if (trees := ctx.trees(d)) is not None:
                    draft, ver = tree_parts(cost, d, trees[0], b, c)
                    col.append(draft + ver)
            table[:, g] = np.concatenate(col)
        self._prices[key] = table
        return table

    def _feed(self, option: int, debt: np.ndarray, rows: int) -> float:
        """Seconds the option's drafter spends taking in what it has not seen (off: none)."""
        j = self._drafter_of[option]
        if j < 0 or debt[j] <= 0:
            return 0.0
        n = int(debt[j])
        return float(self.cost.drafter_prefill_time(self.ctx.drafters[j], n, n * n // max(rows, 1)))

    def _decide(self, state: EngineState) -> tuple[Strategy, float]:
        """The first stretch of the best plan: its strategy and length in steps."""
        rem, queued_ids, rem_q = self._truth.lengths_left(state.instance)
        debt = self._truth.unseen(state.instance)
        tok, tok_q = self._tokens(state.sample_ids), self._tokens(queued_ids)
        b = len(rem)
        slots = b if len(rem_q) else 0
        prices = self._price_table(float((state.ctx_lens + rem / 2).mean()))

        def value(o: int, rem, tok, rem_q, tok_q, debt) -> float:
            start, finish = schedule(rem / tok[:, o], rem_q / tok_q[:, o], slots)
            return drain_seconds(start, finish, self._grid, prices[o]) + self._feed(o, debt, len(rem))

        now = np.array([value(o, rem, tok, rem_q, tok_q, debt) for o in range(len(self.options))])
        keep = np.argsort(now)[:CONTINUATIONS].tolist()
        shortlist = sorted(set(keep) | {0})
        lose = max(1, math.ceil(STRETCH * b))
        best, best_s, best_steps = 0, np.inf, 1.0
        for s in shortlist:
            steps = float(np.clip(np.partition(rem / tok[:, s], lose - 1)[lose - 1], 1, HORIZON))
            start, finish = schedule(rem / tok[:, s], rem_q / tok_q[:, s], slots)
            first = drain_seconds(start, finish, self._grid, prices[s], until=steps) + self._feed(s, debt, b)
            left, emitted = progress(rem, tok[:, s], steps)
            alive = left > 0.5
            joins = min(b - int(alive.sum()), len(rem_q)) if slots else 0
            rem2 = np.concatenate((left[alive], rem_q[:joins]))
            tok2 = np.concatenate((tok[alive], tok_q[:joins]))
            debt2 = debt + emitted
            if self._drafter_of[s] >= 0:
                debt2[self._drafter_of[s]] = 0.0
            rest = min(value(c, rem2, tok2, rem_q[joins:], tok_q[joins:], debt2) for c in shortlist)
            if first + rest < best_s:
                best, best_s, best_steps = s, first + rest, steps
        return self.options[best], best_steps


class _Truth(GoodputPolicy):
    """Mixin: the simulator's true acceptance instead of estimates, re-derived every step."""

    needs_acceptance = False

    def __init__(self, ctx: PolicyContext):
        truth = _truth_of(ctx, self.name)
        super().__init__(ctx, refresh=1, ctx_tolerance=0.0)
        self._truth = truth

    def _acceptance(self, state: EngineState, drafter: str) -> np.ndarray:
        return self._truth(drafter, state.sample_ids)


class GreedyOraclePolicy(_Truth, GoodputPolicy):
    """The goodput rule (one k per step) with every sequence's true acceptance and the true
    costs: the best choice one step at a time, blind to what a choice carries forward."""

    name = "oracle:greedy"


class SeqOraclePolicy(_Truth, SeqGoodputPolicy):
    """The per-sequence rule with the true acceptance: a yardstick for per-sequence policies
    (per-step greedy, so not a bound on the stage's makespan)."""

    name = "oracle:seq"


def greedy_oracle(ctx: PolicyContext) -> GreedyOraclePolicy:
    """`plugin:rlsched.policies.oracle.greedy_oracle`: the per-step oracle, to set beside `oracle`."""
    return GreedyOraclePolicy(ctx)
