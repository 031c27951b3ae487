"""Maximum-likelihood fit of a drafter's position curve (`policies/position.py`) to traces.

Two kinds of record inform it:

- step records (one per engine step: `drafter`, `k`, `width`, `batch`, `drafted`, `accepted`):
  a chain step of `batch` rows each drafting k is the sum of `batch` counts, each n with
  P(n) = R(n) - R(n + 1) (R(k + 1) = 0), R(n) = prod_{i<=n} alpha_i; the sum's distribution is
  that law convolved `batch` times. Steps of ragged per-row lengths (drafted is not
  batch x k) and trees are left out. Steps of one k alone pin down the mean and spread of each
  row's count; steps at several k pin the curve down well.
- per-position counts (vLLM's `spec_decode_num_accepted_tokens_per_pos`, `rlsched import-vllm`'s
  `accepted_per_position`): of `drafts` chains, c_i accepted position i, so c_i given c_{i-1}
  is Binomial(c_{i-1}, alpha_i), exactly.

Sample records count a sample's accepted drafts and rejections over all positions together:
under a decaying curve they pool positions and identify no curve, so the fit does not read
them. Rows' acceptance differs (by prompt and sample); the fit treats them as alike, so it
measures the population's curve, in which rows that accept their first drafts are the likelier
ones: spread between rows makes the fitted decay higher (flatter) than any one row's.

The errors are the square roots of the inverse Hessian's diagonal of the negative
log-likelihood at the optimum (NaN where the optimum is on a bound, decay = 1 say).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass

import numpy as np
from scipy.optimize import minimize

from rlsched.policies.position import reach

_BOUNDS = ((1e-4, 1 - 1e-6), (1e-3, 1.0))  # alpha (first-token rate), decay


@dataclass(frozen=True)
class PositionFit:
    """One drafter's fitted curve: alpha_i = alpha x decay^(i - 1), with standard errors."""

    drafter: str
    alpha: float
    decay: float
    alpha_se: float
    decay_se: float
    steps: int  # step records used
    skipped: int  # step records of the drafter left out (trees, ragged lengths)
    positions: int  # per-position count records used
    log_likelihood: float

    def as_dict(self) -> dict:
        return asdict(self)


def _row_pmf(alpha: float, decay: float, k: int) -> np.ndarray:
    r = np.append(reach(alpha, k, decay), 0.0)
    return np.maximum(r[:-1] - r[1:], 0.0)


def _sum_logpmfs(pmf: np.ndarray, batches) -> dict[int, np.ndarray]:
    """log P(sum of b independent counts of law `pmf` = s), s = 0..b x k, for each b in
    `batches`: one row convolved in at a time (sums of positive terms, so every probability
    keeps its relative precision), rescaled at each row."""
    out, cur, log_scale = {}, np.ones(1), 0.0
    want = set(batches)
    for b in range(1, max(want) + 1):
        cur = np.convolve(cur, pmf)
        top = cur.max()
        cur /= top
        log_scale += np.log(top)
        if b in want:
            out[b] = np.log(np.maximum(cur, 1e-300)) + log_scale
    return out


class _Data:
    """One drafter's records, grouped: (batch, k) -> (accepted sums, how often each)."""

    def __init__(self, steps, positions: Iterable[tuple[int, Iterable[int]]]):
        self.groups: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        self.used = self.skipped = 0
        if steps is not None and len(steps):
            k = np.asarray(steps["k"], dtype=np.int64)
            batch = np.asarray(steps["batch"], dtype=np.int64)
            width = np.asarray(steps["width"], dtype=np.int64) if "width" in steps else np.ones_like(k)
            drafted = np.asarray(steps["drafted"], dtype=np.int64)
            accepted = np.asarray(steps["accepted"], dtype=np.int64)
            ok = (k >= 1) & (width == 1) & (batch >= 1) & (drafted == batch * k) & (accepted <= drafted)
            self.used, self.skipped = int(ok.sum()), int((~ok).sum())
            keys = np.stack((batch[ok], k[ok], accepted[ok]), axis=1)
            uniq, counts = np.unique(keys, axis=0, return_counts=True) if len(keys) else (keys, keys[:, 0])
            for (b, kk), idx in _group(uniq[:, :2]).items():
                self.groups[(b, kk)] = (uniq[idx, 2], counts[idx])
        self.positions = [(int(d), np.asarray(list(c), dtype=float)) for d, c in positions]
        self.batches: dict[int, list[int]] = {}
        for rows, depth in self.groups:
            self.batches.setdefault(depth, []).append(rows)

    def nll(self, theta) -> float:
        alpha, decay = float(theta[0]), float(theta[1])
        total = 0.0
        for k, batches in self.batches.items():
            logpmfs = _sum_logpmfs(_row_pmf(alpha, decay, k), batches)
            for b in batches:
                sums, counts = self.groups[(b, k)]
                total += float(counts @ logpmfs[b][sums])
        for drafts, c in self.positions:
            rates = np.clip(alpha * decay ** np.arange(len(c)), 1e-12, 1 - 1e-12)
            before = np.concatenate(([drafts], c[:-1]))
            total += float(c @ np.log(rates) + (before - c) @ np.log1p(-rates))
        return -total


def _group(keys: np.ndarray) -> dict[tuple[int, int], np.ndarray]:
    out: dict[tuple[int, int], list[int]] = {}
    for i, (b, k) in enumerate(keys.tolist()):
        out.setdefault((b, k), []).append(i)
    return {key: np.array(v) for key, v in out.items()}


def _hessian(f, x: np.ndarray, h: float = 1e-4) -> np.ndarray:
    """Central-difference Hessian of f at x (each step kept inside the bounds)."""
    n = len(x)
    out = np.zeros((n, n))
    steps = [min(h, x[i] - _BOUNDS[i][0], _BOUNDS[i][1] - x[i]) for i in range(n)]
    for i in range(n):
        for j in range(i, n):
            hi, hj = steps[i], steps[j]
            if hi <= 0 or hj <= 0:
                out[i, j] = out[j, i] = np.nan
                continue
            ei, ej = np.eye(n)[i] * hi, np.eye(n)[j] * hj
            val = (f(x + ei + ej) - f(x + ei - ej) - f(x - ei + ej) + f(x - ei - ej)) / (4 * hi * hj)
            out[i, j] = out[j, i] = val
    return out


def fit_drafter(drafter: str, steps=None, positions: Iterable[tuple[int, Iterable[int]]] = ()) -> PositionFit:
    """Fit one drafter's curve to its step records (a frame or mapping of columns `k`,
    `batch`, `drafted`, `accepted` and optionally `width`) and per-position counts
    ((drafts, [accepted at position 1, 2, ..]) per record). Raises ValueError when no record
    is usable."""
    data = _Data(steps, positions)
    if not data.groups and not data.positions:
        raise ValueError(f"drafter '{drafter}': no chain step of uniform k and no per-position counts to fit")
    # start from the first position's rate as the pooled rate would give it, and a flat curve
    start = np.array([0.6, 0.95])
    res = min(
        (minimize(data.nll, x0, method="L-BFGS-B", bounds=_BOUNDS) for x0 in (start, np.array([0.9, 0.7]))),
        key=lambda r: r.fun,
    )
    x = res.x
    se = np.full(2, np.nan)
    hess = _hessian(data.nll, x)
    if np.all(np.isfinite(hess)):
        with np.errstate(invalid="ignore"):
            try:
                cov = np.linalg.inv(hess)
                se = np.where(np.diag(cov) > 0, np.sqrt(np.abs(np.diag(cov))), np.nan)
            except np.linalg.LinAlgError:
                pass
    return PositionFit(
        drafter=drafter,
        alpha=float(x[0]),
        decay=float(x[1]),
        alpha_se=float(se[0]),
        decay_se=float(se[1]),
        steps=data.used,
        skipped=data.skipped,
        positions=len(data.positions),
        log_likelihood=float(-res.fun),
    )


def fit_position_curves(steps, positions: dict | None = None) -> dict[str, PositionFit]:
    """Each drafter's fit from a frame of step records (column `drafter` names it; plain steps,
    with no drafter, are ignored) and per-position counts by drafter
    ({drafter: [(drafts, [c_1, c_2, ..]), ..]})."""
    positions = positions or {}
    names = set(positions)
    if steps is not None and len(steps):
        names |= {str(d) for d in steps["drafter"] if isinstance(d, str) and d}
    out = {}
    for name in sorted(names):
        mine = None
        if steps is not None and len(steps):
            mine = steps[np.asarray([d == name for d in steps["drafter"]])]
        out[name] = fit_drafter(name, mine, positions.get(name, ()))
    return out
