"""The oracle policies: yardsticks for reports that read the simulator's truth, never product
policies.

`oracle` plans the rest of its instance's rollout. It knows every row's true acceptance and
length, the rows queued behind them and what each drafter has not yet taken in, and prices the
remaining drain in expectation (`policies/fluid.py`). Its plan is a dynamic programme over the
drain's phases (the steps between two rows' finishes, last phase first): a strategy for each
phase, with the catch-up a model drafter pays for the tokens of the phases it did not draft
(`_phases`). Every fixed strategy is one such plan, as is every switch by batch size, so in
the fluid model the plan is at least as good as the best static setting, plain decoding and
any batch-size rule; it sees what a choice carries forward (the catch-up after an off stretch,
a shorter chain's extra steps, the batch left for the drain's tail). It follows the plan for a
stretch (until about 5% of the batch has finished, at most `HORIZON` steps) and plans again.
What the model leaves out: the spread of the acceptance draws about their means, a phase's
length measured by the best fixed strategy's steps (another strategy's speed against it is the
mean over the rows still running), and contexts growing within a stretch (`fluid.py`).

Within a stretch of chains the oracle also reads the draws ahead: before each step it knows how
many drafts each row would accept, and drafts the k (for every row, or for each row what it
will accept up to k, a ragged verify) whose tokens are worth most against its price. A token
is worth what it saves the plan's drain: the seconds its row's earlier finish takes off the
steps after it (the last row's finish saves a whole step of one row; with a queue, a slot's
share of a full step). Whether to draft at all stays the plan's: an off step takes no draws, so
it cannot skip the ones ahead. No policy without the draws can follow them, so the oracle is an
upper bound with room to spare, not a policy to match.

`oracle:seq` is the per-sequence rule with the true acceptance, re-derived every step (greedy per
step); `GreedyOraclePolicy` is the goodput rule likewise, kept to show what planning adds.
"""

from __future__ import annotations

import math
from typing import cast

import numpy as np

from rlsched.errors import UserError
from rlsched.policies.draft import GoodputPolicy, PolicyContext, SeqGoodputPolicy, tree_parts
from rlsched.policies.fluid import drain_seconds, grid_of_batches, schedule
from rlsched.policies.position import reach
from rlsched.policies.tree import GRID
from rlsched.policies.types import OFF, CostModel, EngineState, StepOutcome, Strategy

HORIZON = 64  # most steps one plan runs before the next
STRETCH = 0.05  # a plan runs until about this share of the batch has finished


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
        drafter_of = [-1]  # each option's drafter (index into ctx.drafters), -1: off
        self._first_chain: list[int] = []  # each drafter's option of k = 1 (its k's follow)
        for j, d in enumerate(ctx.drafters):
            self._first_chain.append(len(self.options))
            self.options += [Strategy(d, k) for k in range(1, ctx.k_max + 1)]
            drafter_of += [j] * ctx.k_max
            if (trees := ctx.trees(d)) is not None:
                self.options += trees[0]
                drafter_of += [j] * len(trees[0])
        self._drafter_of = np.array(drafter_of)
        self._grid = grid_of_batches(ctx.max_batch)
        self._prices: dict[int, np.ndarray] = {}  # context bucket -> (options, grid) seconds a step
        # (first step, last step + 1, batch, rows it may lose, {batch size: option})
        self._plan: tuple | None = None
        self._weights: tuple = (np.zeros(0, dtype=np.int64), np.zeros(0))  # sorted row ids, seconds a token
        self._table = np.zeros((0, 0))  # the plan's prices (options, grid)

    # ------------------------------------------------------------------ the choice
    def choose(self, state: EngineState) -> Strategy:
        p = self._plan
        if p is None or not (p[0] <= state.step < p[1] and abs(state.batch - p[2]) < p[3]):
            by_batch, steps, weights = self._decide(state)
            b = state.batch
            p = self._plan = (state.step, state.step + max(1, int(steps)), b, max(1, math.ceil(STRETCH * b)), by_batch)
            self._weights = weights
        s = self.options[p[4].get(state.batch, p[4][p[2]])]
        if s.is_off or s.is_tree:
            return s
        return self._step(state, s)

    def steady_steps(self, state: EngineState, strategy: Strategy, max_growth: int) -> int:
        p = self._plan
        if p is None or not (strategy.is_off or strategy.is_tree):
            return 0  # a chain's k is chosen step by step, from the draws ahead
        return max(0, p[1] - state.step - 1)  # (a run ends where the batch changes)

    def observe(self, outcome: StepOutcome) -> None:
        pass

    def _step(self, state: EngineState, planned: Strategy) -> Strategy:
        """The chain of the planned drafter whose tokens (from the draws ahead) are worth most
        against its price: k drafts for every row, or each row what it will accept, up to k (a
        ragged verify). Whether to draft at all is the plan's: an off step takes no draws, so
        it cannot skip the ones ahead."""
        d = cast(str, planned.drafter)
        first = self._first_chain[self.ctx.drafters.index(d)]
        ids, w = self._weights
        at = np.minimum(np.searchsorted(ids, state.sample_ids), len(ids) - 1)
        weight = np.where(ids[at] == state.sample_ids, w[at], w.mean())  # rows that joined since: the mean
        ks = np.arange(1, self.ctx.k_max + 1)
        b, c, cost = state.batch, state.ctx_tokens, self.cost
        ragged = np.minimum(self._truth.accepted_ahead(state.instance, d), ks[:, None])  # (k, rows)
        worth = ragged @ weight
        uniform = np.asarray(cost.draft_time(d, b, ks, c) + cost.verify_time(b, ks + 1, c), dtype=np.float64)
        each = np.asarray(cost.draft_time_per_row(d, ragged, c) + cost.verify_time(b, 1 + ragged.mean(axis=1), c))
        each[ragged.max(axis=1) == 0] = np.inf  # (no row drafts: not a chain)
        j = int(np.argmax(worth - np.minimum(uniform, each)))
        if each[j] < uniform[j]:
            return Strategy(d, int(ragged[j].max()), k_per_row=ragged[j])
        return self.options[first + j]

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
        j = int(self._drafter_of[option])
        if j < 0 or debt[j] <= 0:
            return 0.0
        n = int(debt[j])
        return float(self.cost.drafter_prefill_time(self.ctx.drafters[j], n, n * n // max(rows, 1)))

    def _decide(self, state: EngineState) -> tuple[dict, float, tuple]:
        """The plan for the next stretch: a strategy for each batch size it passes through, its
        length in steps, and what a token of each row is worth to the plan (its rows' ids
        sorted, seconds a token)."""
        rem, queued_ids, rem_q = self._truth.lengths_left(state.instance)
        debt = self._truth.unseen(state.instance)
        tok, tok_q = self._tokens(state.sample_ids), self._tokens(queued_ids)
        b = len(rem)
        slots = b if len(rem_q) else 0
        prices = self._table = self._price_table(float((state.ctx_lens + rem / 2).mean()))
        now = np.empty(len(self.options))
        for o in range(len(self.options)):  # each fixed strategy to the end
            start, finish = schedule(rem / tok[:, o], rem_q / tok_q[:, o], slots)
            now[o] = drain_seconds(start, finish, self._grid, prices[o]) + self._feed(o, debt, b)
        ref = int(np.argmin(now))
        by_batch, first = self._phases(rem, rem_q, np.concatenate((tok, tok_q)), ref, slots, debt)
        lose = max(1, math.ceil(STRETCH * b))
        steps = float(np.clip(np.partition(rem / tok[:, first], lose - 1)[lose - 1], 1, HORIZON))
        c = first if not self.options[first].is_off else ref
        worth = self._worth(state.sample_ids, rem / tok[:, c], tok[:, c], prices[c], slots)
        return by_batch, steps, worth

    def _phases(self, rem, rem_q, tok, ref: int, slots: int, debt) -> tuple[dict, int]:
        """The best strategy for each phase of the drain (the steps between two rows' finishes),
        by dynamic programming over the phases, last first. A phase is measured in steps of the
        reference strategy `ref` (the best fixed one); another strategy covers it in that many
        steps over its speed against `ref`, the mean over the rows not yet finished. The state is
        the drafter that drafts next (none: the rest runs off): an off phase's tokens, and a
        phase of another drafter's, are fed to it at its price a token. Returns the strategy for
        each batch size of the plan's phases, and the first phase's."""
        start, finish = schedule(rem / tok[: len(rem), ref], rem_q / tok[len(rem) :, ref], slots)
        order = np.argsort(finish, kind="stable")
        n = len(order)
        f = finish[order]
        delta = np.diff(np.concatenate(([0.0], f)))  # reference steps of each phase
        rows = np.searchsorted(np.sort(start), f, side="left") - np.arange(n)  # its batch size
        left = (n - np.arange(n))[:, None]
        speed = np.cumsum((tok[order] / tok[order, ref][:, None])[::-1], axis=0)[::-1] / left
        emitted = delta * rows * (np.cumsum(tok[order, ref][::-1])[::-1] / left[:, 0])
        cost = (delta[:, None] / speed) * np.stack([np.interp(rows, self._grid, p) for p in self._table], axis=1)
        drafters = len(self.ctx.drafters)
        per_token = np.array([0.0] + [self._feed_per_token(d, int(rows[0])) for d in self.ctx.drafters])
        of = self._drafter_of + 1  # each option's drafter, 1-based (0: off)
        best_of = [np.flatnonzero(of == y) for y in range(drafters + 1)]
        value = np.zeros(drafters + 1)  # phases after this one, by the drafter that drafts next
        pick = np.zeros((n, drafters + 1), dtype=np.int64)
        then = np.zeros((n, drafters + 1), dtype=np.int64)
        for j in range(n - 1, -1, -1):
            feed = per_token * emitted[j]
            new = np.empty(drafters + 1)
            new[0], pick[j, 0], then[j, 0] = cost[j, 0] + value[0], 0, 0
            for y in range(1, drafters + 1):
                off = cost[j, 0] + feed[y] + value[y]
                later = value + np.where((np.arange(drafters + 1) > 0) & (np.arange(drafters + 1) != y), feed, 0.0)
                z = int(np.argmin(later))
                o = best_of[y][int(np.argmin(cost[j, best_of[y]]))]
                if cost[j, o] + later[z] < off:
                    new[y], pick[j, y], then[j, y] = cost[j, o] + later[z], o, z
                else:
                    new[y], pick[j, y], then[j, y] = off, 0, y
            value = new
        start_feed = np.array([0.0] + [self._feed(self._first_chain[d], debt, len(rem)) for d in range(drafters)])
        y = int(np.argmin(value + start_feed))
        by_batch: dict[int, int] = {}
        for j in range(n):
            by_batch.setdefault(int(rows[j]), int(pick[j, y]))
            y = int(then[j, y])
        return by_batch, by_batch[int(rows[0])]

    def _feed_per_token(self, drafter: str, b: int) -> float:
        """What feeding the drafter one more token of b rows costs (as goodput prices it)."""
        price = self.cost.drafter_prefill_time
        return max(0.0, (price(drafter, 2 * b, 4 * b) - price(drafter, b, b)) / b)

    def _worth(self, ids: np.ndarray, steps: np.ndarray, tokens: np.ndarray, prices: np.ndarray, slots: int) -> tuple:
        """Seconds of the drain a token of each row saves, under a strategy of `prices` at which
        each row finishes after `steps` steps at `tokens` a step: finishing a step earlier saves the
        step's price with it against without it (the last row: a whole step of one row); with a
        queue, the full batch's price over its slots."""
        b = len(ids)
        if slots:
            saved = np.full(b, np.interp(slots, self._grid, prices) / slots)
        else:
            order = np.argsort(steps, kind="stable")
            left = b - np.arange(b)  # rows left just before each finish, in the order of finishing
            at = np.interp(left, self._grid, prices)
            below = np.where(left > 1, np.interp(left - 1, self._grid, prices), 0.0)
            saved = np.empty(b)
            saved[order] = at - below
        sort = np.argsort(ids)
        return ids[sort], (saved / tokens)[sort]


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
