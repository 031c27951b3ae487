"""Policies that look their strategy up by batch size: ReSpec's two states, and learned tables.

Both are solved offline (from a cost model, refined in the simulator by `rlsched learn`) and
cost nothing per step but a lookup.
"""

from __future__ import annotations

from bisect import bisect_right

import numpy as np

from rlsched.errors import UserError
from rlsched.policies.draft import PolicyContext, expected_tokens, tree_times
from rlsched.policies.types import NEVER_CHANGES, OFF, EngineState, StepOutcome, Strategy

DRAIN_ACCEPTANCE = 0.8  # twostate's solve prices drafts at this share of the drafter's prior acceptance
SIZES_PER_OCTAVE = 4  # batch sizes twostate's solve prices per doubling


def batch_grid(max_batch: int) -> list[int]:
    """Powers of two up to max_batch: the lower edges of the batch-size buckets."""
    edges, b = [], 1
    while b <= max_batch:
        edges.append(b)
        b *= 2
    return edges


def rates(ctx: PolicyContext, drafter: str, batch: int, acceptance: float, per_row: int | None = None) -> np.ndarray:
    """Expected tokens/s of k = 0..k_max for a batch of `per_row` contexts (default: the
    typical context; k = 0 is off)."""
    cost = ctx.cost
    assert cost is not None, "pricing draft lengths needs a cost model"
    ks = np.arange(1, ctx.k_max + 1)
    ctx_tokens = batch * (ctx.typical_ctx if per_row is None else per_row)
    tokens = expected_tokens(np.full(batch, acceptance), ctx.k_max, ctx.decay(drafter))
    times = np.concatenate(
        (
            [cost.verify_time(batch, 1, ctx_tokens)],
            cost.draft_time(drafter, batch, ks, ctx_tokens) + cost.verify_time(batch, ks + 1, ctx_tokens),
        )
    )
    return tokens / times


def tree_rates(
    ctx: PolicyContext, drafter: str, batch: int, acceptance: float, per_row: int | None = None
) -> tuple[list[Strategy], np.ndarray]:
    """The tree strategies `ctx` allows for `drafter` and their expected tokens/s, as `rates`
    (none when it allows chains only)."""
    trees = ctx.trees(drafter)
    if trees is None:
        return [], np.zeros(0)
    options, table = trees
    assert ctx.cost is not None, "pricing draft trees needs a cost model"
    times = tree_times(ctx.cost, drafter, options, batch, batch * (ctx.typical_ctx if per_row is None else per_row))
    return options, table.tokens(np.full(batch, ctx.top1(drafter, acceptance))) / times


class TwoStatePolicy:
    """ReSpec's two-state scheduler: speculation off while the batch is above a threshold;
    at or below it, one draft length (or one tree)."""

    name = "twostate"
    needs_acceptance = False
    observes = False

    def __init__(self, ctx: PolicyContext, drafter: str, max_batch_on: int, k: int, width: int = 1, nodes: int = 0):
        self.drafter, self.max_batch_on = drafter, max_batch_on
        self.on = Strategy(drafter, k, width, nodes)  # the strategy at or below the threshold

    @property
    def k(self) -> int:
        return self.on.k

    @classmethod
    def solve(cls, ctx: PolicyContext, drafter: str | None = None) -> TwoStatePolicy:
        """ReSpec's offline solve over the cost model: the drafter, strategy (a chain's k, or a
        tree where the context allows them) and threshold that drain a batch fastest.

        A rollout's batch drains from `max_batch` to 1, emitting alike numbers of tokens at each
        batch size on the way (lengths without memory: each row's remaining length is alike
        whatever it has generated), so most of its tokens come at large batch, where
        verification is dear. The drain's time is the sum over batch sizes of those tokens over
        the tokens/s there: the strategy where the batch is at or below the threshold, off
        above it. The pair with the least time wins: the threshold is where off starts to beat
        the strategy, and the strategy is the one that wins over the whole drain, not the one
        that gains most at small batch (a deep draft there loses at the batch sizes that hold
        most of the tokens).

        Drafts are priced at DRAIN_ACCEPTANCE times the drafter's prior acceptance: the prior
        is the mean over rows when the drafter is fresh, while acceptance falls as the policy
        trains away from the drafter, and SD finishes the rows the drafter serves well first,
        leaving the drain's tail to the rows it serves worst. On the shipped presets this
        picks the best static draft length over the whole rollout, or within 1% of it."""
        if ctx.cost is None:
            return cls(ctx, drafter or ctx.drafters[0], 0, 1)  # a placeholder for name checks only
        key = (
            "twostate",
            drafter,
            id(ctx.cost),
            ctx.max_batch,
            ctx.k_max,
            ctx.typical_ctx,
            ctx.width_max,
            ctx.nodes_max,
            tuple(sorted(ctx.acceptance_prior.items())),
        )
        if key not in ctx.shared:  # the instances of one cluster share the solve
            ctx.shared[key] = cls._drain_solve(ctx, [drafter] if drafter else list(ctx.drafters))
        d, threshold, s = ctx.shared[key]
        return cls(ctx, d, threshold, s.k, s.width, s.nodes)

    @staticmethod
    def _drain_solve(ctx: PolicyContext, drafters: list[str]) -> tuple[str, int, Strategy]:
        """(drafter, max_batch_on, strategy) with the least drain time (`solve`)."""
        top = ctx.max_batch
        sizes = np.unique(np.geomspace(1, top, SIZES_PER_OCTAVE * max(1, top.bit_length() - 1) + 1).round().astype(int))
        edges = np.concatenate(([0.5], np.sqrt(sizes[:-1] * sizes[1:]), [top + 0.5]))
        tokens = np.diff(edges)  # the batch sizes each priced size stands for
        best: tuple[float, str, int, Strategy] | None = None
        for d in drafters:
            acceptance = DRAIN_ACCEPTANCE * ctx.prior(d)
            r = np.array([rates(ctx, d, int(b), acceptance) for b in sizes])  # (sizes, k_max + 1)
            trees = [tree_rates(ctx, d, int(b), acceptance) for b in sizes]
            options = [Strategy(d, k) for k in range(1, ctx.k_max + 1)] + trees[0][0]
            on = np.concatenate((r[:, 1:], np.array([t[1] for t in trees]).reshape(len(sizes), -1)), axis=1)
            t_on = np.vstack((np.zeros(len(options)), np.cumsum(tokens[:, None] / on, axis=0)))  # sizes[:i] on
            t_off = np.concatenate((np.cumsum((tokens / r[:, 0])[::-1])[::-1], [0.0]))  # sizes[i:] off
            total = t_on + t_off[:, None]  # (threshold index, option)
            i, j = np.unravel_index(int(np.argmin(total)), total.shape)
            if best is None or total[i, j] < best[0]:
                best = (float(total[i, j]), d, int(edges[i]) if i < len(sizes) else top, options[j])
        assert best is not None, "no drafter to solve for"
        return best[1], best[2], best[3]

    @classmethod
    def from_file(cls, pf, ctx: PolicyContext, k_max_name: str = "speculation.k_max") -> TwoStatePolicy:
        if pf.drafter not in ctx.drafters:
            raise UserError(f"two-state policy drafts with '{pf.drafter}', which this config lacks")
        if pf.params["k"] > ctx.k_max:
            raise UserError(f"two-state policy uses k = {pf.params['k']}, above {k_max_name} = {ctx.k_max}")
        width = pf.params.get("width", 1)
        if width > ctx.width_max:
            raise UserError(
                f"two-state policy drafts a tree {width} wide; this engine drafts chains "
                "(the simulator trees up to speculation.width_max)"
            )
        return cls(ctx, pf.drafter, pf.params["max_batch_on"], pf.params["k"], width, pf.params.get("nodes", 0))

    def choose(self, state: EngineState) -> Strategy:
        return self.on if state.batch <= self.max_batch_on else OFF

    def steady_steps(self, state: EngineState, strategy: Strategy, max_growth: int) -> int:
        return NEVER_CHANGES  # depends on the batch size only

    def observe(self, outcome: StepOutcome) -> None:
        pass

    def params(self) -> dict:
        out = {"max_batch_on": self.max_batch_on, "k": self.k}
        if self.on.is_tree:
            out |= {"width": self.on.width, "nodes": self.on.nodes}
        return out


def cell_strategy(drafter: str, cell) -> Strategy:
    """A table cell's strategy: a chain's k (0: off) or a tree [k, width, nodes]."""
    if isinstance(cell, list):
        return Strategy(drafter, *cell)
    return OFF if cell == 0 else Strategy(drafter, cell)


def strategy_cell(s: Strategy):
    """The table cell of a strategy (inverse of `cell_strategy`)."""
    return [s.k, s.width, s.nodes] if s.is_tree else s.k


class TablePolicy:
    """A lookup table (acceptance bucket x context bucket x batch-size bucket) -> draft length (or
    a draft tree where the context allows trees), as written by `rlsched learn`. The
    acceptance bucket is that of the batch's mean estimated acceptance, re-read when the
    batch changes or every `refresh` steps; the context bucket is that of the batch's mean
    context per sequence (at one batch size, verification is compute-bound while contexts
    are short and memory-bound, nearly free, once they are long). A table without
    `ctx_edges` has one context bucket (files written before it had one)."""

    name = "table"
    observes = False

    def __init__(
        self,
        ctx: PolicyContext,
        drafter: str,
        batch_edges: list[int],
        accept_edges: list[float],
        k: list,
        refresh: int = 32,
        ctx_edges: list[int] | None = None,
    ):
        if drafter not in ctx.drafters:
            raise UserError(
                f"table policy drafts with '{drafter}', which this config lacks ({', '.join(ctx.drafters)})"
            )
        self.ctx_edges = [0] if ctx_edges is None else list(ctx_edges)
        self.k = [[row] for row in k] if ctx_edges is None else k  # [acceptance][context][batch]
        cells = [cell_strategy(drafter, x) for plane in self.k for row in plane for x in row]
        top = max(s.k for s in cells)
        if top > ctx.k_max:
            raise UserError(f"table policy uses k up to {top}, above this config's speculation.k_max = {ctx.k_max}")
        wide = max(s.width for s in cells)
        if wide > ctx.width_max:
            raise UserError(
                f"table policy drafts trees {wide} wide; this engine drafts chains (the simulator trees "
                "up to speculation.width_max)"
            )
        self.drafter, self.batch_edges, self.accept_edges = drafter, list(batch_edges), list(accept_edges)
        self.refresh = refresh
        self.needs_acceptance = len(accept_edges) > 2
        self._strategies = [[[cell_strategy(drafter, x) for x in row] for row in plane] for plane in self.k]
        self._acc_row = self._row(ctx.prior(drafter))
        self._last: tuple[int, int] | None = None  # (batch, step) of the last acceptance read

    @classmethod
    def analytic(
        cls, ctx: PolicyContext, drafter: str, accept_edges=(0.0, 1.0), ctx_edges: list[int] | None = None
    ) -> TablePolicy:
        """Each bucket's best k (or tree, where the context allows trees) by the cost model at its
        middle batch, acceptance and context per sequence (without `ctx_edges`: the typical
        context)."""
        edges = batch_grid(ctx.max_batch)
        mids = (
            [ctx.typical_ctx]
            if ctx_edges is None
            else [
                max(1, round((lo * hi) ** 0.5)) if lo else hi // 2
                for lo, hi in zip(ctx_edges, [*ctx_edges[1:], 2 * ctx_edges[-1]])
            ]
        )
        table = []
        for lo, hi in zip(accept_edges[:-1], accept_edges[1:]):
            a = ctx.prior(drafter) if len(accept_edges) == 2 else (lo + hi) / 2
            plane = []
            for per_row in mids:
                row = []
                for i, b in enumerate(edges):
                    top = edges[i + 1] - 1 if i + 1 < len(edges) else ctx.max_batch
                    mid = max(1, round((b * top) ** 0.5))
                    chain = rates(ctx, drafter, mid, a, per_row)
                    trees, tree = tree_rates(ctx, drafter, mid, a, per_row)
                    j = int(np.argmax(np.concatenate((chain, tree))))
                    row.append(j if j < len(chain) else strategy_cell(trees[j - len(chain)]))
                plane.append(row)
            table.append(plane)
        return cls(
            ctx, drafter, edges, list(accept_edges), table if ctx_edges else [p[0] for p in table], ctx_edges=ctx_edges
        )

    @classmethod
    def from_file(cls, pf, ctx: PolicyContext, k_max_name: str = "speculation.k_max") -> TablePolicy:
        p = pf.params
        top = max(
            cell_strategy(pf.drafter, x).k
            for plane in (p["k"] if p.get("ctx_edges") else [p["k"]])
            for row in plane
            for x in row
        )
        if top > ctx.k_max:
            raise UserError(f"table policy uses k up to {top}, above {k_max_name} = {ctx.k_max}")
        return cls(ctx, pf.drafter, p["batch_edges"], p["accept_edges"], p["k"], ctx_edges=p.get("ctx_edges"))

    def params(self) -> dict:
        if len(self.ctx_edges) == 1:
            return {
                "batch_edges": self.batch_edges,
                "accept_edges": self.accept_edges,
                "k": [plane[0] for plane in self.k],
            }
        return {
            "batch_edges": self.batch_edges,
            "accept_edges": self.accept_edges,
            "ctx_edges": self.ctx_edges,
            "k": self.k,
        }

    def _row(self, acceptance: float) -> int:
        return min(max(bisect_right(self.accept_edges, acceptance) - 1, 0), len(self.accept_edges) - 2)

    def choose(self, state: EngineState) -> Strategy:
        b = state.batch
        if self.needs_acceptance:
            last = self._last
            if last is None or last[0] != b or not 0 <= state.step - last[1] < self.refresh:
                self._acc_row = self._row(float(state.accept_est(self.drafter).mean()))
                self._last = (b, state.step)
        col = min(bisect_right(self.batch_edges, b) - 1, len(self.batch_edges) - 1)
        plane = self._strategies[self._acc_row]
        if len(plane) == 1:
            return plane[0][max(col, 0)]
        return plane[bisect_right(self.ctx_edges, state.ctx_tokens / max(b, 1)) - 1][max(col, 0)]

    def steady_steps(self, state: EngineState, strategy: Strategy, max_growth: int) -> int:
        """Steps after this one with the same answer: until the acceptance is re-read, or the
        context per sequence reaches the next context bucket."""
        steps = NEVER_CHANGES
        if self.needs_acceptance:
            if self._last is None or state.step < self._last[1]:
                return 0
            steps = max(0, self.refresh - 1 - (state.step - self._last[1]))
        if len(self.ctx_edges) > 1 and max_growth > 0:
            j = bisect_right(self.ctx_edges, state.ctx_tokens / max(state.batch, 1))
            if j < len(self.ctx_edges):
                steps = min(steps, max(0, int((self.ctx_edges[j] * state.batch - state.ctx_tokens) // max_growth) - 1))
        return steps

    def observe(self, outcome: StepOutcome) -> None:
        pass
