"""A cost model read straight off measured step times (a `rlsched profile` table).

Verify and draft times are interpolated over the profiled grid: linearly in log2(batch),
in the number of tokens per row (q for verify, k for draft) and in the context per row;
outside the grid the nearest edge's slope is extended, never below the fastest measured
step. (The numbers of scipy's RegularGridInterpolator with fill_value=None, a test checks;
computed here because a policy prices a few points at a time, at every batch change, where
scipy's per-call checks would cost several times the lookup.) Prefill is a least-squares
line in the number of prompt tokens. It implements the `CostModel` protocol, so `goodput`
and the other priced policies run on the executor with the executor's own costs. (The
parametric fit, which also extrapolates past the grid, is `costs/fit.py`'s; its file loads
as `costs/costfile.py`'s `FittedCostModel`.)
"""

from __future__ import annotations

import bisect
import math

import numpy as np
import pandas as pd
from scipy.optimize import isotonic_regression

from rlsched.errors import UserError


class Grid:
    """Step time (seconds) over (log2 batch, tokens per row, context per row): trilinear, and
    linear past the edges from the edge cell."""

    def __init__(self, axes: list[np.ndarray], values: np.ndarray):
        self.axes, self.values = axes, values
        self._points = [a.tolist() for a in axes]  # bisect on a list: no numpy scalars
        self.floor = float(values.min())

    def _cell(self, dim: int, x):
        """Index of the cell along axis `dim` (clipped to the edge cells) and the weight of its
        upper corner."""
        axis = self.axes[dim]
        if np.ndim(x) == 0:
            i = min(max(bisect.bisect_right(self._points[dim], x) - 1, 0), len(axis) - 2)
            return i, float((x - axis[i]) / (axis[i + 1] - axis[i]))
        i = np.clip(np.searchsorted(axis, x, side="right") - 1, 0, len(axis) - 2)
        return i, (x - axis[i]) / (axis[i + 1] - axis[i])

    def __call__(self, log_batch, tokens, per_row) -> np.ndarray | float:
        """At points broadcast from the three coordinates (numbers or arrays)."""
        if np.ndim(log_batch) == 0 and np.ndim(per_row) == 0:
            # a policy's lookup: one batch and context, so those two axes fold to one line
            # over the tokens axis first (the same numbers, a tenth of the numpy calls)
            (i, u), (j, w) = self._cell(0, log_batch), self._cell(2, per_row)
            v = self.values
            line = (1 - u) * ((1 - w) * v[i, :, j] + w * v[i, :, j + 1]) + u * (
                (1 - w) * v[i + 1, :, j] + w * v[i + 1, :, j + 1]
            )
            t, r = self._cell(1, np.asarray(tokens, dtype=float))
            return (1 - r) * line[t] + r * line[t + 1]
        (i, u), (t, r), (j, w) = (
            self._cell(dim, np.asarray(x, dtype=float)) for dim, x in enumerate((log_batch, tokens, per_row))
        )
        v, out = self.values, 0.0
        for di, wi in ((0, 1 - u), (1, u)):
            for dt, wt in ((0, 1 - r), (1, r)):
                for dj, wj in ((0, 1 - w), (1, w)):
                    out = out + wi * wt * wj * v[i + di, t + dt, j + dj]
        return out


def measured_grid(df: pd.DataFrame, tokens_col: str, value_col: str, what: str, monotone: bool = False) -> Grid:
    """The median of `value_col` over (log2 batch, tokens per row, context per row); with
    `monotone`, made non-decreasing in the tokens per row (isotonic regression along that axis
    at each batch size and context). A step that computes more tokens a row is not faster, but
    a profile taken on a shared machine can say otherwise at many of its (batch, context)
    points (k = 3 priced below k = 2), and `goodput`, taking the best of k_max prices, picks
    the cell that noise made cheap and drafts deeper than pays. (The fit's interpolation
    fallback reads the grid back as measured.)"""
    df = df.assign(lb=np.log2(df["batch"]), per_row=df["ctx_tokens"] / df["batch"])
    table = df.groupby(["lb", tokens_col, "per_row"])[value_col].median()
    axes = [np.array(sorted(set(table.index.get_level_values(i))), dtype=float) for i in range(3)]
    full = pd.MultiIndex.from_product(axes)
    if len(table) != len(full):
        raise UserError(
            f"profile: the {what} measurements do not fill a grid of batch x tokens x "
            f"context ({len(table)} of {len(full)} points); re-run `rlsched profile`"
        )
    values = table.reindex(full).to_numpy().reshape([len(a) for a in axes]) / 1e3
    if monotone:
        for i in range(values.shape[0]):
            for j in range(values.shape[2]):
                values[i, :, j] = isotonic_regression(values[i, :, j]).x
    # A single point on an axis cannot be interpolated: repeat it one unit on.
    for i, a in enumerate(axes):
        if len(a) == 1:
            axes[i] = np.array([a[0], a[0] + 1.0])
            values = np.concatenate([values, values], axis=i)
    return Grid(axes, values)


def _line(records: pd.DataFrame) -> tuple[float, float]:
    """(intercept s, slope s a token) of step time against tokens (prefill, a drafter's feed)."""
    if len(records) < 2:
        return 0.0, 0.0
    slope, icept = np.polyfit(records["ctx_tokens"], records["step_ms"] / 1e3, 1)
    return max(icept, 0.0), max(slope, 0.0)


def mixed_ms(verify, prefill, j):
    """A mixed step's time (any unit) from its rows' verify and its chunks' prefill (either 0
    when absent): their sum less the joint part `j`, never below the larger of the two."""
    verify, prefill = np.asarray(verify, dtype=float), np.asarray(prefill, dtype=float)
    both = (verify > 0) & (prefill > 0)
    out = verify + prefill - np.where(both, np.minimum(j, np.minimum(verify, prefill)), 0.0)
    return out if out.ndim else float(out)


def chunk_pairs(chunk_prefix, chunk_len) -> tuple[float, float]:
    """(n, S) of prompt chunks: their tokens, and S = sum of c (c + 2 p) over chunks of c tokens
    after p cached ones (a chunk's query-key pairs, doubled: a prompt's squared length when
    nothing is cached)."""
    p, c = np.asarray(chunk_prefix, dtype=float), np.asarray(chunk_len, dtype=float)
    return float(c.sum()), float((c * (c + 2.0 * p)).sum())


def grid_time(grid: Grid, batch, tokens, ctx_tokens):
    """Seconds `grid` prices at `batch` rows of `tokens` tokens whose contexts total `ctx_tokens`;
    a number for numbers, an array shaped as `tokens` otherwise."""
    tokens = np.asarray(tokens, dtype=float)
    b = max(batch, 1)
    # no step is faster than the fastest measured one: a slope extended past the grid can
    # otherwise reach zero or below when noise made a larger context measure faster
    per_row = ctx_tokens / b if np.ndim(ctx_tokens) == 0 else np.asarray(ctx_tokens, dtype=float) / b
    out = np.maximum(grid(math.log2(b), tokens, per_row), grid.floor)
    return out if out.ndim else float(out)  # a number for a number, as the roofline model


class MeasuredCostModel:
    """CostModel from profile records (the STEP trace schema; kinds verify, draft, prefill, feed).

    A mixed step (decode/verify rows beside prompt chunks, vLLM's chunked prefill) is the rows'
    verify plus the chunks' prefill less the joint per-step part (`mixed_ms`), here the
    prefill line's intercept (at most the fastest verify measured): a profile times no mixed
    step. `step_overhead` is that per-step part plus `host_step`, the host work outside the
    timed forward (none in a profile)."""

    host_step = 0.0  # seconds of host work with every step, outside the timed forward

    def __init__(self, records: pd.DataFrame):
        need = {"kind", "batch", "k", "ctx_tokens", "drafter", "verify_ms", "draft_ms", "step_ms"}
        missing = need - set(records.columns)
        if missing:
            raise UserError(f"profile: missing column(s) {', '.join(sorted(missing))}")
        verify = records[records["kind"] == "verify"].assign(q=lambda d: d["k"] + 1)
        if verify.empty:
            raise UserError("profile: no verify measurements; re-run `rlsched profile`")
        self._verify = measured_grid(verify, "q", "verify_ms", "verify", monotone=True)
        self._draft, self._tree_draft = {}, {}
        drafts = records[records["kind"] == "draft"]
        wide = drafts["width"].fillna(1) > 1 if "width" in drafts else pd.Series(False, index=drafts.index)
        for name, d in drafts[~wide].groupby("drafter"):
            self._draft[str(name)] = measured_grid(d, "k", "draft_ms", f"draft ({name})", monotone=True)
        for (name, w), d in drafts[wide].groupby(["drafter", "width"]) if wide.any() else ():  # trees, as timed
            self._tree_draft[str(name), int(w)] = measured_grid(
                d, "k", "draft_ms", f"draft ({name}, width {w})", monotone=True
            )
        self._prefill = _line(records[records["kind"] == "prefill"])
        self._feed = {str(name): _line(d) for name, d in records[records["kind"] == "feed"].groupby("drafter")}
        self.drafters = tuple(self._draft)

    def verify_time(self, batch: int, q, ctx_tokens: int):
        return grid_time(self._verify, batch, q, ctx_tokens)

    def _rows_s(self, batch: int, q, ctx_tokens: int) -> float:
        """The verify forward of a mixed step's rows, without the host's per-step part."""
        return float(self.verify_time(batch, q, ctx_tokens)) - self.host_step if batch > 0 else 0.0

    def _chunks_s(self, n_tokens: float, sum_sq: float) -> float:
        """The prefill forward of a mixed step's chunks (n tokens, S as `chunk_pairs`)."""
        icept, slope = self._prefill
        return icept + slope * n_tokens

    def _joint_s(self) -> float:
        """What one forward over rows and chunks saves against two: the per-step constant."""
        return max(min(self._prefill[0], self._verify.floor), 0.0)

    @property
    def step_overhead(self) -> float:
        """Seconds of a step's fixed part, inside verify_time, prefill_time and mixed_time: the
        per-step constant and the host work outside the forward (vLLM's async scheduling
        overlaps it with the GPU)."""
        return self._joint_s() + self.host_step

    def mixed_time(self, batch: int, q: float, ctx_tokens: int, chunk_prefix, chunk_len) -> float:
        """One step of `batch` decode/verify rows (q tokens each, contexts summing to ctx_tokens)
        beside prompt chunks (`chunk_len` tokens after `chunk_prefix` cached, arrays): verify_time
        without chunks, prefill of the chunks without rows."""
        n, sq = chunk_pairs(chunk_prefix, chunk_len)
        if n <= 0:
            return float(self.verify_time(batch, q, ctx_tokens))
        rows = self._rows_s(batch, q, ctx_tokens)
        return float(mixed_ms(rows, self._chunks_s(n, sq), self._joint_s())) + self.host_step

    def draft_time(self, drafter: str, batch: int, k, ctx_tokens: int, width: int = 1):
        if drafter not in self._draft:
            raise UserError(
                f"profile has no draft measurements for drafter '{drafter}' "
                f"(has: {', '.join(self._draft) or 'none'}); profile with it"
            )
        k = np.asarray(k, dtype=float)
        tree = self._tree_draft.get((drafter, int(width))) if width > 1 else None
        if tree is not None:  # the tree's drafting as timed
            t = grid_time(tree, batch, np.maximum(k, 1), ctx_tokens)
        else:  # a tree not timed: width rows a row
            t = grid_time(self._draft[drafter], batch * width, np.maximum(k, 1), ctx_tokens * width)
        return np.where(k > 0, t, 0.0) if np.ndim(t) else (t if k > 0 else 0.0)

    def draft_time_per_row(self, drafter: str, ks: np.ndarray, ctx_tokens):
        """The executor drafts the longest row's length for every drafting row."""
        ks = np.asarray(ks)
        rows = (ks > 0).sum(axis=-1)
        k = ks.max(axis=-1, initial=0)
        if ks.ndim == 1:
            return self.draft_time(drafter, int(rows), int(k), ctx_tokens) if k > 0 else 0.0
        return np.array(
            [
                self.draft_time(drafter, int(r), int(kk), c) if kk > 0 else 0.0
                for r, kk, c in zip(rows, k, np.broadcast_to(ctx_tokens, rows.shape))
            ]
        )

    def prefill_time(self, n_tokens: int, sum_sq_tokens: int | None = None) -> float:
        icept, slope = self._prefill
        return icept + slope * n_tokens

    def drafter_prefill_time(self, drafter: str, n_tokens: int, sum_sq_tokens: int | None = None) -> float:
        """The drafter's catch-up, linear in its tokens as prefill is; zero where the profile
        did not time that drafter's feed."""
        icept, slope = self._feed.get(drafter, (0.0, 0.0))
        return icept + slope * n_tokens if n_tokens > 0 else 0.0

    def kv_transfer_time(self, ctx_tokens: int, n_seqs: int) -> float:
        return 0.0  # one engine: nothing moves
