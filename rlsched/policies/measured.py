"""A cost model read straight off measured step times (a `rlsched profile` table).

Verify and draft times are interpolated over the profiled grid: linearly in log2(batch),
in the number of tokens per row (q for verify, k for draft) and in the context per row;
outside the grid the nearest edge's slope is extended, never below the fastest measured
step. Prefill is a least-squares line in the number of prompt tokens. It implements the
`CostModel` protocol, so `goodput` and the other priced policies run on the executor with the
executor's own costs. (A parametric fit that also extrapolates to other models and hardware
is the analysis layer's job.)
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from scipy.interpolate import RegularGridInterpolator

from rlsched.errors import UserError


def _grid(df: pd.DataFrame, tokens_col: str, value_col: str, what: str) -> RegularGridInterpolator:
    """Interpolator over (log2 batch, tokens per row, context per row) of the mean of `value_col`."""
    df = df.assign(lb=np.log2(df["batch"]), per_row=df["ctx_tokens"] / df["batch"])
    table = df.groupby(["lb", tokens_col, "per_row"])[value_col].median()
    axes = [np.array(sorted(set(table.index.get_level_values(i)))) for i in range(3)]
    full = pd.MultiIndex.from_product(axes)
    if len(table) != len(full):
        raise UserError(f"profile: the {what} measurements do not fill a grid of batch x tokens x "
                        f"context ({len(table)} of {len(full)} points); re-run `rlsched profile`")
    values = table.reindex(full).to_numpy().reshape([len(a) for a in axes]) / 1e3
    # A single point on an axis cannot be interpolated: repeat it one unit on.
    for i, a in enumerate(axes):
        if len(a) == 1:
            axes[i] = np.array([a[0], a[0] + 1.0])
            values = np.concatenate([values, values], axis=i)
    return RegularGridInterpolator(axes, values, bounds_error=False, fill_value=None)


class MeasuredCostModel:
    """CostModel from profile records (the STEP trace schema; kinds verify, draft, prefill)."""

    def __init__(self, records: pd.DataFrame):
        need = {"kind", "batch", "k", "ctx_tokens", "drafter", "verify_ms", "draft_ms", "step_ms"}
        missing = need - set(records.columns)
        if missing:
            raise UserError(f"profile: missing column(s) {', '.join(sorted(missing))}")
        verify = records[records["kind"] == "verify"].assign(q=lambda d: d["k"] + 1)
        if verify.empty:
            raise UserError("profile: no verify measurements; re-run `rlsched profile`")
        self._verify = _grid(verify, "q", "verify_ms", "verify")
        self._draft = {}
        drafts = records[records["kind"] == "draft"]
        for name, d in drafts.groupby("drafter"):
            self._draft[str(name)] = _grid(d, "k", "draft_ms", f"draft ({name})")
        prefill = records[records["kind"] == "prefill"]
        if len(prefill) >= 2:
            slope, icept = np.polyfit(prefill["ctx_tokens"], prefill["step_ms"] / 1e3, 1)
            self._prefill = (max(icept, 0.0), max(slope, 0.0))
        else:
            self._prefill = (0.0, 0.0)
        self.drafters = tuple(self._draft)

    @staticmethod
    def _at(interp, batch, tokens, ctx_tokens):
        tokens = np.asarray(tokens, dtype=float)
        b = np.broadcast_to(np.log2(max(batch, 1)), tokens.shape)
        per_row = np.broadcast_to(np.asarray(ctx_tokens, dtype=float) / max(batch, 1), tokens.shape)
        # no step is faster than the fastest measured one: a slope extended past the grid can
        # otherwise reach zero or below when noise made a larger context measure faster
        out = np.maximum(interp(np.stack([b, tokens, per_row], axis=-1)), interp.values.min()).reshape(tokens.shape)
        return out if out.ndim else float(out)  # a number for a number, as the roofline model

    def verify_time(self, batch: int, q, ctx_tokens: int):
        return self._at(self._verify, batch, q, ctx_tokens)

    def draft_time(self, drafter: str, batch: int, k, ctx_tokens: int, width: int = 1):
        if drafter not in self._draft:
            raise UserError(f"profile has no draft measurements for drafter '{drafter}' "
                            f"(has: {', '.join(self._draft) or 'none'}); profile with it")
        k = np.asarray(k, dtype=float)
        t = self._at(self._draft[drafter], batch * width, np.maximum(k, 1), ctx_tokens * width)
        return np.where(k > 0, t, 0.0) if np.ndim(t) else (t if k > 0 else 0.0)

    def draft_time_per_seq(self, drafter: str, ks: np.ndarray, ctx_tokens):
        """The executor drafts the longest row's length for every drafting row."""
        ks = np.asarray(ks)
        rows = (ks > 0).sum(axis=-1)
        k = ks.max(axis=-1, initial=0)
        if ks.ndim == 1:
            return self.draft_time(drafter, int(rows), int(k), ctx_tokens) if k > 0 else 0.0
        return np.array([self.draft_time(drafter, int(r), int(kk), c) if kk > 0 else 0.0
                         for r, kk, c in zip(rows, k, np.broadcast_to(ctx_tokens, rows.shape))])

    def prefill_time(self, n_tokens: int, sum_sq_tokens: int | None = None) -> float:
        icept, slope = self._prefill
        return icept + slope * n_tokens

    def kv_transfer_time(self, ctx_tokens: int, n_seqs: int) -> float:
        return 0.0  # one engine: nothing moves
