"""Acceptance by draft position: the rate at which a drafter's i-th draft token is accepted,
given that the ones before it were.

The curve is geometric in the position: alpha_i = a x decay^(i - 1), where `a` is the rate of
the first draft token (a sequence's acceptance: `AcceptanceSpec.mean` is its drafter's mean
over prompts and samples) and `decay` is the drafter's (`AcceptanceSpec.position_decay`).
decay = 1 is a constant rate per token; below 1 each further draft token is less likely than
the one before, so the reach of a chain, P(accepted >= n) = a^n decay^(n(n-1)/2), falls faster
than geometrically and a long draft buys less than a constant rate promises. Above 1 (at most
MAX_DECAY) the rate rises with the position, each alpha_i at most 1: drafters that copy (n-gram,
suffix) miss where no match starts and then run on along it, and a population of rows whose
acceptance differs shows a rising curve too, its later positions reached by the rows that
accept well (`position_fit.py`).

Why a geometric decay: drafters that predict several tokens from one state of the target
(Medusa's heads, EAGLE's head fed its own features) lose accuracy with every step they take
from the target's last state, and EAGLE-2 (arXiv:2406.16858) builds its trees on the
observation that acceptance depends on the draft position (and the context); EAGLE-3's
training-time test (arXiv:2503.01840) exists to flatten that fall. A geometric factor has one
parameter, has the constant rate as its special case, and makes the chain's accepted count
an inversion of one Exp(1) draw (`accepted_drafts`), as the constant rate does;
`fit_position_curve` (policies/position_fit.py) estimates it from traces.

Formulas here take `decay` = 1 through the very arithmetic the constant rate always used, so
results without a curve are the same to the bit.
"""

from __future__ import annotations

import numpy as np

CONSTANT = 1.0
MAX_DECAY = 2.0  # the steepest rise a position


def position_rates(a, k: int, decay: float = CONSTANT) -> np.ndarray:
    """alpha_1..alpha_k for first-token rates `a`: shape (*a.shape, k) (at most 1 each)."""
    a = np.asarray(a, dtype=float)
    rates = a[..., None] * decay ** np.arange(k)
    return np.minimum(rates, 1.0) if decay > CONSTANT else rates


def reach(a, k: int, decay: float = CONSTANT) -> np.ndarray:
    """P(accepted >= n) for n = 0..k: prod_{i<=n} alpha_i, shape (*a.shape, k + 1)."""
    a = np.asarray(a, dtype=float)
    out = np.ones((*a.shape, k + 1))
    out[..., 1:] = position_rates(a, k, decay)
    return np.cumprod(out, axis=-1)


def expected_accepted(a, k: int, decay: float = CONSTANT) -> np.ndarray:
    """Expected accepted drafts of a chain of k: sum_{n=1..k} prod_{i<=n} alpha_i."""
    return reach(a, k, decay)[..., 1:].sum(axis=-1)


def chain_tokens(a, ks, decay: float = CONSTANT) -> np.ndarray:
    """Expected tokens of a chain step per row of first-token rate `a` (rows,) with draft
    lengths `ks` (rows,) or (candidates, rows): 1 + expected accepted drafts."""
    a = np.asarray(a, dtype=float)
    ks = np.asarray(ks, dtype=np.int64)
    tokens = np.cumsum(reach(a, int(ks.max(initial=0)), decay), axis=-1)  # (rows, k_max + 1)
    rows = np.arange(len(a))
    return tokens[rows, ks]


def accepted_drafts(exp: np.ndarray, ninv: np.ndarray, decay: float = CONSTANT) -> np.ndarray:
    """Accepted drafts of chains (before the cap at k) by inversion of Exp(1) draws `exp`
    (steps, rows), for rows of first-token rate a with `ninv` = -1 / log a (rows,).

    P(accepted >= n) = exp(-H(n)) with H(n) = n lam + mu n(n - 1) / 2, lam = -log a and
    mu = -log decay; H rises with n, so the count is the largest n with H(n) <= E: the
    positive root of mu/2 n^2 + (lam - mu/2) n - E, floored. At decay 1 that is floor(E / lam),
    computed as the constant rate always was. A rising curve (mu < 0) reaches rate 1 after
    m = ceil(lam / -mu) positions, from where every draft is accepted: H stops at H(m), and a
    draw above it accepts all."""
    if decay == CONSTANT:
        return (exp * ninv).astype(np.int64)
    mu = -np.log(decay)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        lam = 1.0 / ninv  # a = 0: ninv = 0, lam = inf, no draft accepted
        b = lam - mu / 2
        disc = np.sqrt(b * b + 2 * mu * exp)
        # two forms of the same root, each free of cancellation where it is used
        n = np.where(b > 0, 2 * exp / (b + disc), (disc - b) / mu)
        if mu < 0:  # past the position where the rate reaches 1, every draft
            m = np.ceil(lam / -mu)
            n = np.where(exp >= m * lam + mu * m * (m - 1) / 2, np.inf, n)
    return np.floor(np.nan_to_num(n, nan=0.0, posinf=1 << 30)).astype(np.int64)


def stage_decay(stage, d: int) -> float:
    """The position decay of drafter index `d` in a simulated generation stage (its
    `position_decay` list; a stage without one drafts at a constant rate a token)."""
    decays = getattr(stage, "position_decay", None)
    return CONSTANT if decays is None else float(decays[d])


def learned_trials(acc: np.ndarray, ks, decay: float = CONSTANT):
    """What the acceptance estimator (`policies/acceptance.py`) learns from chains that
    accepted `acc` of `ks` drafts: (accepted, k) for its `update`/`update_many`.

    Its trials are Bernoulli draws of one rate. At a constant rate every position is one; under
    a decaying curve only the first position is a draw of the first-token rate the policies
    read, so the estimator is given that trial alone (accepted >= 1 of 1)."""
    if decay == CONSTANT:
        return acc, ks
    return np.minimum(acc, 1), np.minimum(ks, 1)


def sample_accepted(rng: np.random.Generator, a, k: int, decay: float, size) -> np.ndarray:
    """Accepted drafts of chains of k at first-token rate `a` (scalar or broadcastable to
    `size`), drawn position by position: the reference the inversion is tested against and
    what synthetic traces are made of."""
    rates = position_rates(np.broadcast_to(np.asarray(a, dtype=float), size), k, decay)
    ok = rng.random((*np.shape(rates),)) < rates
    return np.cumprod(ok, axis=-1).sum(axis=-1)
