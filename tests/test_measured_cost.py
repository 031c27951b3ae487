"""MeasuredCostModel: interpolation of profile tables, against closed forms."""

import numpy as np
import pandas as pd
import pytest

from rlsched.costs.measured import MeasuredCostModel
from rlsched.errors import UserError


def _records(verify, draft, batches=(1, 2, 4, 8), ks=range(0, 4), per_row=(32, 96)):
    rows = []
    for b in batches:
        for L in per_row:
            for k in ks:
                base = dict(batch=b, k=k, ctx_tokens=b * L, drafter="", draft_ms=0.0, verify_ms=0.0, step_ms=0.0)
                rows.append({**base, "kind": "verify", "verify_ms": verify(b, k + 1, L)})
                if k:
                    rows.append({**base, "kind": "draft", "drafter": "model", "draft_ms": draft(b, k, L)})
            rows.append(
                dict(
                    kind="prefill",
                    batch=b,
                    k=0,
                    ctx_tokens=b * L,
                    drafter="",
                    draft_ms=0.0,
                    verify_ms=0.0,
                    step_ms=2.0 + 0.01 * b * L,
                )
            )
    return pd.DataFrame(rows)


def test_grid_points_are_exact_and_between_is_linear():
    def verify(b, q, L):  # linear in the model's axes
        return 1.0 + 0.5 * np.log2(b) + 0.25 * q + 0.01 * L

    def draft(b, k, L):
        return 0.2 * k + 0.1 * np.log2(b)

    m = MeasuredCostModel(_records(verify, draft))
    assert m.verify_time(4, 3, 4 * 32) == pytest.approx(verify(4, 3, 32) / 1e3)
    assert isinstance(m.verify_time(4, 3, 4 * 32), float)  # a number for a number (twostate's solve needs it)
    # between grid points (batch 3, context 64 per row) and beyond them (batch 16): linear
    assert m.verify_time(3, 2, 3 * 64) == pytest.approx(verify(3, 2, 64) / 1e3)
    assert m.verify_time(16, 4, 16 * 96) == pytest.approx(verify(16, 4, 96) / 1e3)
    q = np.arange(1, 5)
    assert np.allclose(m.verify_time(2, q, 2 * 32), [verify(2, x, 32) / 1e3 for x in q])
    ks = np.arange(0, 4)
    d = m.draft_time("model", 8, ks, 8 * 96)
    assert d[0] == 0.0 and np.allclose(d[1:], [draft(8, k, 96) / 1e3 for k in ks[1:]])
    assert m.prefill_time(1000) == pytest.approx((2.0 + 0.01 * 1000) / 1e3)
    assert m.drafter_prefill_time("model", 1000) == 0.0  # no feed timed: no catch-up priced
    feed = pd.DataFrame(
        [
            dict(
                kind="feed",
                batch=b,
                k=0,
                ctx_tokens=b * 32,
                drafter="model",
                draft_ms=0.0,
                verify_ms=0.0,
                step_ms=0.5 + 0.002 * b * 32,
            )
            for b in (1, 2, 4, 8)
        ]
    )
    fed = MeasuredCostModel(pd.concat([_records(verify, draft), feed], ignore_index=True))
    assert fed.drafter_prefill_time("model", 1000) == pytest.approx((0.5 + 0.002 * 1000) / 1e3)
    assert fed.drafter_prefill_time("model", 0) == 0.0 and fed.prefill_time(1000) == m.prefill_time(1000)
    # the executor drafts the longest row's length for every drafting row
    assert m.draft_time_per_row("model", np.array([0, 2, 3]), 96) == pytest.approx(m.draft_time("model", 2, 3, 96))


def test_lookups_are_scipys_trilinear_interpolation_and_extrapolation():
    """The hand-rolled lookup (fast enough for goodput's every batch change) gives scipy's
    RegularGridInterpolator numbers, inside the grid and past its edges, for numbers and arrays."""
    from scipy.interpolate import RegularGridInterpolator

    def verify(b, q, L):  # not linear
        return 1.0 + 0.3 * b**1.3 * q**0.7 + 0.002 * L * np.sqrt(b)

    m = MeasuredCostModel(_records(verify, lambda b, k, L: 0.2 * k))
    axes = [np.log2([1, 2, 4, 8]), np.arange(1.0, 5.0), np.array([32.0, 96.0])]
    table = np.array([[[verify(b, q, L) for L in axes[2]] for q in axes[1]] for b in (1, 2, 4, 8)]) / 1e3
    ref = RegularGridInterpolator(axes, table, bounds_error=False, fill_value=None)
    rng = np.random.default_rng(0)
    for _ in range(200):
        b, L = int(rng.integers(1, 24)), float(rng.uniform(4, 200))
        q = rng.uniform(0.5, 7.0, size=3)
        want = np.maximum(ref(np.stack([np.full(3, np.log2(b)), q, np.full(3, L)], axis=-1)), table.min())
        assert np.allclose(m.verify_time(b, q, b * L), want, rtol=1e-12)
        assert m.verify_time(b, float(q[0]), b * L) == pytest.approx(want[0], rel=1e-12)
    ctx = np.array([3 * 20.0, 3 * 150.0])  # contexts as an array too (the CostModel protocol allows it)
    want = np.maximum(ref(np.stack([np.full(2, np.log2(3)), [2.0, 2.0], ctx / 3], axis=-1)), table.min())
    assert np.allclose(m.verify_time(3, 2, ctx), want, rtol=1e-12)


def test_extrapolation_never_prices_a_step_below_the_fastest_measured():
    # noise made the longer context measure faster: the slope extended far past the grid
    # would reach zero and below (goodput divided by it)
    def verify(b, q, L):
        return 2.0 + 0.1 * q - 0.015 * L

    m = MeasuredCostModel(_records(verify, lambda b, k, L: 0.2 * k))
    fastest = min(verify(b, q, L) for b in (1, 2, 4, 8) for q in range(1, 5) for L in (32, 96)) / 1e3
    assert m.verify_time(1, 1, 1000) == pytest.approx(fastest)
    assert m.verify_time(4, 2, 4 * 64) > fastest  # inside the grid: interpolated as before


def test_goodput_runs_on_a_measured_model():
    from rlsched.policies import PolicyContext, make_draft_policy
    from rlsched.policies.acceptance import AcceptanceEstimator
    from rlsched.policies.types import EngineState

    # verify nearly free at batch 1, ~q times dearer at batch 8: SD at small batch only
    def verify(b, q, L):
        return 1.0 + (0.05 if b == 1 else 1.0) * b * q

    m = MeasuredCostModel(_records(verify, lambda b, k, L: 0.05 * k))
    pol = make_draft_policy(
        "goodput", PolicyContext(cost=m, drafters=("model",), k_max=3, acceptance_prior={"model": 0.8})
    )
    est = AcceptanceEstimator(("model",))
    est.begin_rollout(8, np.arange(8))

    def state(b):
        return EngineState(0, 0, 0.0, np.arange(b), np.full(b, 32), 32 * b, 0, 10_000, est)

    assert pol.choose(state(1)).k >= 2
    assert pol.choose(state(8)).k == 0


def test_a_broken_profile_is_refused():
    df = _records(lambda b, q, L: 1.0, lambda b, k, L: 1.0)
    with pytest.raises(UserError, match="no verify measurements"):
        MeasuredCostModel(df[df.kind != "verify"])
    with pytest.raises(UserError, match="grid"):
        MeasuredCostModel(df.drop(index=df.index[(df.kind == "verify")][:1]))
    with pytest.raises(UserError, match="missing column"):
        MeasuredCostModel(df.drop(columns=["ctx_tokens"]))
    with pytest.raises(UserError, match="no draft measurements for drafter 'ngram'"):
        MeasuredCostModel(df).draft_time("ngram", 1, 2, 10)


def test_noise_that_prices_more_tokens_cheaper_is_smoothed_out():
    """A profile where noise made q = 3 measure below q = 2 (as on this shared machine at more
    than half of a profile's points): the price never falls as the tokens a row grow, and the
    pooled cells take the mean of the measurements they pool."""
    noisy = {1: 1.0, 2: 2.0, 3: 1.6, 4: 3.0}
    m = MeasuredCostModel(_records(lambda b, q, L: noisy[q] * b, lambda b, k, L: 0.2 * k))
    prices = m.verify_time(4, np.arange(1, 5), 4 * 32) * 1e3
    assert np.all(np.diff(prices) >= 0)
    assert prices == pytest.approx([4.0, 7.2, 7.2, 12.0])  # q = 2, 3 pooled: (8 + 6.4) / 2
    assert m.verify_time(4, 1, 4 * 96) == pytest.approx(4.0 / 1e3)  # monotone cells untouched


def test_calibrated_goodput_charges_a_plain_step_for_the_drafter_feed_it_defers():
    """Off is 5% faster than k = 1 at batch 8 by the prices; once a catch-up step has shown that
    feeding the drafter costs 0.2 ms a token, a plain step's 8 tokens carry 1.6 ms of deferred
    feeding and drafting wins. Without calibration (the simulator) nothing is learned, and the
    price is the cost model's: none without feed records, the profile's with them."""
    from dataclasses import replace

    from rlsched.policies import PolicyContext, make_draft_policy
    from rlsched.policies.acceptance import AcceptanceEstimator
    from rlsched.policies.types import EngineState, StepOutcome

    def verify(b, q, L):  # SD pays at batch 1 only
        return 1.0 + (0.05 if b == 1 else 1.0) * b * q

    m = MeasuredCostModel(_records(verify, lambda b, k, L: 0.05 * k))
    ctx = PolicyContext(cost=m, drafters=("model",), k_max=3, acceptance_prior={"model": 0.8})
    live = make_draft_policy("goodput:1", replace(ctx, calibrate=True))
    est = AcceptanceEstimator(("model",), prior_mean=0.8, prior_strength=1e6)
    est.begin_rollout(8, np.arange(8))

    def state(b, step):
        return EngineState(0, step, 0.0, np.arange(b), np.full(b, 32), 32 * b, 0, 10_000, est)

    assert live.choose(state(8, 0)).is_off
    s = live.choose(state(1, 1))
    assert s.k >= 1
    draft, v = m.draft_time("model", 1, s.k, 32), m.verify_time(1, s.k + 1, 32)
    live.observe(StepOutcome(0, 1, s, 1, s.k, 0, 1, draft + 0.02 + v, draft + 0.02, v, catch_up=100))
    assert live._feed["model"] == pytest.approx(0.2e-3)
    assert live.choose(state(8, 2)).k >= 1
    assert make_draft_policy("goodput:1", ctx).choose(state(8, 3)).is_off
    feed = pd.DataFrame(
        [
            dict(
                kind="feed",
                batch=b,
                k=0,
                ctx_tokens=b * 32,
                drafter="model",
                draft_ms=0.0,
                verify_ms=0.0,
                step_ms=0.5 + 0.2 * b * 32,
            )
            for b in (1, 2, 4, 8)
        ]
    )
    fed = MeasuredCostModel(pd.concat([_records(verify, lambda b, k, L: 0.05 * k), feed], ignore_index=True))
    assert make_draft_policy("goodput:1", replace(ctx, cost=fed)).choose(state(8, 4)).k >= 1


def test_trees_are_priced_as_timed_where_profiled_else_as_width_rows_a_row():
    """Draft records of width 2 (a profile's trees) price width-2 trees and leave the chain's
    grid as it was; a width not timed is priced as drafts of batch x width rows."""

    def verify(b, q, L):
        return 1.0 + 0.25 * q

    def draft(b, k, L):
        return 0.2 * k + 0.1 * np.log2(b)

    def tree(b, k, L):  # a tree's drafting, as timed: dearer than a chain's at the same batch
        return 0.5 * k + 0.3 * np.log2(b)

    chains = _records(verify, draft)
    wide = chains[chains.kind == "draft"].assign(width=2, draft_ms=lambda d: tree(d.batch, d.k, 0))
    m = MeasuredCostModel(pd.concat([chains.assign(width=1), wide], ignore_index=True))
    plain = MeasuredCostModel(chains)
    ks = np.arange(1, 4)
    assert np.allclose(m.draft_time("model", 4, ks, 4 * 32), plain.draft_time("model", 4, ks, 4 * 32))
    assert np.allclose(m.draft_time("model", 4, ks, 4 * 32, width=2), [tree(4, k, 32) / 1e3 for k in ks])
    assert np.allclose(m.draft_time("model", 2, ks, 2 * 32, width=3), plain.draft_time("model", 6, ks, 6 * 32))
