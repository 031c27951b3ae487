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
  is Binomial(c_{i-1}, alpha_i), exactly. Chains of different lengths give the rows that tried
  each position instead of one `drafts`: t_i, the rows that drafted position i and had every
  draft before it accepted, and c_i given t_i is Binomial(t_i, alpha_i). Step records that
  hold them (`accepted_by_position`, `tried_by_position`: `traces/schema.py`) are read as such,
  the ragged ones too, and not as sums; the others are read as sums.

The counts' likelihood depends on them only through their totals per position (sum_i C_i log
alpha_i + (T_i - C_i) log(1 - alpha_i)): records of counts are pooled before the fit.

Sample records count a sample's accepted drafts and rejections over all positions together:
under a decaying curve they pool positions and identify no curve, so the fit does not read
them. Rows' acceptance differs (by prompt and sample); the fit treats them as alike, so it
measures the population's curve, in which rows that accept their first drafts are the likelier
ones: spread between rows makes the fitted decay higher (flatter) than any one row's.

The errors are the square roots of the inverse Hessian's diagonal of the negative
log-likelihood at the optimum (NaN where the optimum is on a bound).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass

import numpy as np
from scipy.optimize import minimize

from rlsched.policies.position import MAX_DECAY, reach

_BOUNDS = ((1e-4, 1 - 1e-6), (1e-3, MAX_DECAY))  # alpha (first-token rate), decay


@dataclass(frozen=True)
class PositionFit:
    """One drafter's fitted curve: alpha_i = alpha x decay^(i - 1), with standard errors."""

    drafter: str
    alpha: float
    decay: float
    alpha_se: float
    decay_se: float
    steps: int  # step records used as sums
    skipped: int  # step records of the drafter left out (trees, ragged lengths without counts)
    positions: int  # per-position count records used (step records that hold counts among them)
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


def _counts(tried, accepted) -> tuple[np.ndarray, np.ndarray] | None:
    """One record's (tried, accepted) by position as float arrays; `tried` a whole number is
    a uniform chain's drafts (t_1 = drafts, t_i = c_{i-1}). None where they do not make a chain
    (lengths differ, a count is negative, c_i > t_i or t_{i+1} > c_i)."""
    if tried is None:
        return None
    try:
        c = np.asarray(list(accepted), dtype=float)
        uniform = np.ndim(tried) == 0
        t = np.concatenate(([float(tried)], c[:-1])) if uniform else np.asarray(list(tried), dtype=float)
    except (TypeError, ValueError):
        return None
    if c.ndim != 1 or t.shape != c.shape or not np.all(np.isfinite(t) & np.isfinite(c)):
        return None
    if np.any(c < 0) or np.any(c > t) or np.any(t[1:] > c[:-1]):
        return None
    return t, c


def step_counts(steps) -> tuple[list[tuple[np.ndarray, np.ndarray]], np.ndarray]:
    """The per-position counts of step records (columns `accepted_by_position` and
    `tried_by_position`; without the latter, a step whose rows all drafted k has `batch` drafts),
    and which records gave usable ones."""
    n = len(steps) if steps is not None else 0
    has = np.zeros(n, dtype=bool)
    out: list[tuple[np.ndarray, np.ndarray]] = []
    if not n or "accepted_by_position" not in steps:
        return out, has
    none = [None] * n
    tried = list(steps["tried_by_position"]) if "tried_by_position" in steps else none
    uniform = [None if d != b * k else b for b, k, d in zip(steps["batch"], steps["k"], steps["drafted"])]
    for j, (c, t, b) in enumerate(zip(steps["accepted_by_position"], tried, uniform)):
        if c is None or np.ndim(c) != 1 or not len(c):
            continue
        got = _counts(t if t is not None and np.ndim(t) == 1 else b, c)
        if got is not None:
            has[j] = True
            out.append(got)
    return out, has


class _Data:
    """One drafter's records: step sums grouped (batch, k) -> (accepted sums, how often each),
    and the per-position counts pooled (rows that tried, accepted, by position)."""

    def __init__(self, steps, positions: list[tuple]):
        self.groups: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        self.used = self.skipped = 0
        counted, has = step_counts(steps)
        given = [_counts(d, c) for d, c in positions]
        pos = [g for g in given if g is not None] + counted
        self.skipped = sum(g is None for g in given)
        if steps is not None and len(steps):
            k = np.asarray(steps["k"], dtype=np.int64)
            batch = np.asarray(steps["batch"], dtype=np.int64)
            width = np.asarray(steps["width"], dtype=np.int64) if "width" in steps else np.ones_like(k)
            drafted = np.asarray(steps["drafted"], dtype=np.int64)
            accepted = np.asarray(steps["accepted"], dtype=np.int64)
            ok = (k >= 1) & (width == 1) & (batch >= 1) & (drafted == batch * k) & (accepted <= drafted) & ~has
            self.used, self.skipped = int(ok.sum()), self.skipped + int((~ok & ~has).sum())
            keys = np.stack((batch[ok], k[ok], accepted[ok]), axis=1)
            uniq, counts = np.unique(keys, axis=0, return_counts=True) if len(keys) else (keys, keys[:, 0])
            for (b, kk), idx in _group(uniq[:, :2]).items():
                self.groups[(b, kk)] = (uniq[idx, 2], counts[idx])
        self.positions = len(pos)
        depth = max((len(c) for _, c in pos), default=0)
        self.tried, self.accepted = np.zeros(depth), np.zeros(depth)
        for t, c in pos:
            self.tried[: len(t)] += t
            self.accepted[: len(c)] += c
        self.batches: dict[int, list[int]] = {}
        for rows, kk in self.groups:
            self.batches.setdefault(kk, []).append(rows)

    def nll(self, theta) -> float:
        alpha, decay = float(theta[0]), float(theta[1])
        total = 0.0
        for k, batches in self.batches.items():
            logpmfs = _sum_logpmfs(_row_pmf(alpha, decay, k), batches)
            for b in batches:
                sums, counts = self.groups[(b, k)]
                total += float(counts @ logpmfs[b][sums])
        if len(self.tried):
            rates = np.clip(alpha * decay ** np.arange(len(self.tried)), 1e-12, 1 - 1e-12)
            total += float(self.accepted @ np.log(rates) + (self.tried - self.accepted) @ np.log1p(-rates))
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
    """Fit one drafter's curve to its step records (a frame of columns `k`, `batch`,
    `drafted`, `accepted` and optionally `width`, `accepted_by_position`, `tried_by_position`:
    a record with counts is read by its counts, one without by its sum) and per-position counts
    ((drafts, [accepted at position 1, 2, ..]) per record, or ([tried at position 1, 2, ..],
    [accepted ..])). Raises ValueError when no record is usable."""
    data = _Data(steps, list(positions))
    if not data.groups and not data.tried.any():
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
        positions=data.positions,
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
