"""Policies that look their strategy up by batch size: ReSpec's two states, and learned tables.

Both are solved offline (from a cost model, refined in the simulator by `rlsched learn`) and
cost nothing per step but a lookup.
"""

from __future__ import annotations

from bisect import bisect_right

import numpy as np

from rlsched.errors import UserError
from rlsched.policies.draft import PolicyContext, expected_tokens
from rlsched.policies.types import NEVER_CHANGES, OFF, EngineState, StepOutcome, Strategy


def batch_grid(max_batch: int) -> list[int]:
    """Powers of two up to max_batch: the lower edges of the batch-size buckets."""
    edges, b = [], 1
    while b <= max_batch:
        edges.append(b)
        b *= 2
    return edges


def rates(ctx: PolicyContext, drafter: str, batch: int, acceptance: float) -> np.ndarray:
    """Expected tokens/s of k = 0..k_max for a batch of typical contexts (k = 0 is off)."""
    ks = np.arange(1, ctx.k_max + 1)
    ctx_tokens = batch * ctx.typical_ctx
    tokens = expected_tokens(np.full(batch, acceptance), ctx.k_max)
    times = np.concatenate(([ctx.cost.verify_time(batch, 1, ctx_tokens)],
                            ctx.cost.draft_time(drafter, batch, ks, ctx_tokens) +
                            ctx.cost.verify_time(batch, ks + 1, ctx_tokens)))
    return tokens / times


class TwoStatePolicy:
    """ReSpec's two-state scheduler: speculation off while the batch is above a threshold;
    at or below it, one draft length."""

    name = "twostate"
    needs_acceptance = False
    observes = False

    def __init__(self, ctx: PolicyContext, drafter: str, max_batch_on: int, k: int):
        self.drafter, self.max_batch_on, self.k = drafter, max_batch_on, k
        self._on = Strategy(drafter, k)

    @classmethod
    def solve(cls, ctx: PolicyContext, drafter: str | None = None) -> "TwoStatePolicy":
        """The offline solve over the cost model: the k with the largest gain over the batch
        sizes where speculation pays, each batch size weighted by its tokens per step (a
        rollout makes most of its tokens at large batch), then the largest batch where that k
        still beats off."""
        if ctx.cost is None:
            return cls(ctx, drafter or ctx.drafters[0], 0, 1)  # a placeholder for name checks only
        best = None
        for d in ([drafter] if drafter else ctx.drafters):
            grid = batch_grid(ctx.max_batch)
            r = np.array([rates(ctx, d, b, ctx.prior(d)) for b in grid])  # (batches, k_max + 1)
            gain = r[:, 1:] / r[:, :1]
            weight = np.asarray(grid, dtype=float)[:, None]
            k = int(np.argmax((weight * np.log(np.maximum(gain, 1))).sum(axis=0))) + 1
            pays = [b for b, g in zip(grid, gain[:, k - 1]) if g > 1]
            threshold = max(pays) if pays else 0
            score = float((weight[:, 0] * np.log(np.maximum(gain[:, k - 1], 1))).sum())
            if best is None or score > best[0]:
                best = (score, d, threshold, k)
        return cls(ctx, best[1], best[2], best[3])

    @classmethod
    def from_file(cls, pf, ctx: PolicyContext) -> "TwoStatePolicy":
        if pf.drafter not in ctx.drafters:
            raise UserError(f"two-state policy drafts with '{pf.drafter}', which this config lacks")
        if pf.params["k"] > ctx.k_max:
            raise UserError(f"two-state policy uses k = {pf.params['k']}, above this config's "
                            f"speculation.k_max = {ctx.k_max}")
        return cls(ctx, pf.drafter, pf.params["max_batch_on"], pf.params["k"])

    def choose(self, state: EngineState) -> Strategy:
        return self._on if state.batch <= self.max_batch_on else OFF

    def steady_steps(self, state: EngineState, strategy: Strategy, max_growth: int) -> int:
        return NEVER_CHANGES  # depends on the batch size only

    def observe(self, outcome: StepOutcome) -> None:
        pass

    def params(self) -> dict:
        return {"max_batch_on": self.max_batch_on, "k": self.k}


class TablePolicy:
    """A lookup table (batch-size bucket x acceptance bucket) -> draft length, as written by
    `rlsched learn`. The acceptance bucket is that of the batch's mean estimated acceptance,
    re-read when the batch changes or every `refresh` steps."""

    name = "table"
    observes = False

    def __init__(self, ctx: PolicyContext, drafter: str, batch_edges: list[int], accept_edges: list[float],
                 k: list[list[int]], refresh: int = 32):
        if drafter not in ctx.drafters:
            raise UserError(f"table policy drafts with '{drafter}', which this config lacks ({', '.join(ctx.drafters)})")
        if max(max(row) for row in k) > ctx.k_max:
            raise UserError(f"table policy uses k up to {max(max(row) for row in k)}, above this config's "
                            f"speculation.k_max = {ctx.k_max}")
        self.drafter, self.batch_edges, self.accept_edges, self.k = drafter, list(batch_edges), list(accept_edges), k
        self.refresh = refresh
        self.needs_acceptance = len(accept_edges) > 2
        self._strategies = [[OFF if kk == 0 else Strategy(drafter, kk) for kk in row] for row in k]
        self._acc_row = self._row(ctx.prior(drafter))
        self._last = None  # (batch, step) of the last acceptance read

    @classmethod
    def analytic(cls, ctx: PolicyContext, drafter: str, accept_edges=(0.0, 1.0)) -> "TablePolicy":
        """Each bucket's best k by the cost model at its middle batch and acceptance."""
        edges = batch_grid(ctx.max_batch)
        table = []
        for lo, hi in zip(accept_edges[:-1], accept_edges[1:]):
            a = ctx.prior(drafter) if len(accept_edges) == 2 else (lo + hi) / 2
            row = []
            for i, b in enumerate(edges):
                top = edges[i + 1] - 1 if i + 1 < len(edges) else ctx.max_batch
                row.append(int(np.argmax(rates(ctx, drafter, max(1, round((b * top) ** 0.5)), a))))
            table.append(row)
        return cls(ctx, drafter, edges, list(accept_edges), table)

    @classmethod
    def from_file(cls, pf, ctx: PolicyContext) -> "TablePolicy":
        p = pf.params
        return cls(ctx, pf.drafter, p["batch_edges"], p["accept_edges"], p["k"])

    def params(self) -> dict:
        return {"batch_edges": self.batch_edges, "accept_edges": self.accept_edges, "k": self.k}

    def with_k(self, row: int, col: int, k: int) -> "TablePolicy":
        """A copy with one cell changed (for the simulator's search)."""
        table = [list(r) for r in self.k]
        table[row][col] = k
        new = object.__new__(TablePolicy)
        new.__dict__.update(self.__dict__)
        new.k = table
        new._strategies = [[OFF if kk == 0 else Strategy(self.drafter, kk) for kk in r] for r in table]
        new._last = None
        return new

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
        return self._strategies[self._acc_row][max(col, 0)]

    def steady_steps(self, state: EngineState, strategy: Strategy, max_growth: int) -> int:
        if not self.needs_acceptance:
            return NEVER_CHANGES
        if self._last is None or state.step < self._last[1]:
            return 0
        return max(0, self.refresh - 1 - (state.step - self._last[1]))

    def observe(self, outcome: StepOutcome) -> None:
        pass
