"""The roofline cost model's physics, and the policies driven by hand-built engine states."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlsched.config import load_config
from rlsched.errors import UserError
from rlsched.policies import (OFF, AcceptanceEstimator, EngineState, PolicyContext, Strategy, expected_tokens,
                              make_draft_policy)
from rlsched.sim.costmodel import RooflineCostModel


@pytest.fixture(scope="module")
def cost():
    return RooflineCostModel.from_config(load_config("default"))


def test_verify_is_nearly_free_at_small_batch_and_linear_at_large(cost):
    small = cost.verify_time(1, 9, 1000) / cost.verify_time(1, 1, 1000)
    large = cost.verify_time(512, 9, 512 * 1000) / cost.verify_time(512, 1, 512 * 1000)
    assert small < 1.1
    assert large > 3.0


def test_array_and_scalar_prices_agree(cost):
    ks = np.arange(1, 9)
    np.testing.assert_allclose(cost.verify_time(64, ks + 1, 64000), [cost.verify_time(64, k + 1, 64000) for k in ks])
    np.testing.assert_allclose(cost.draft_time("model", 64, ks, 64000), [cost.draft_time("model", 64, k, 64000) for k in ks])
    ctx = np.array([1000, 5000, 9000])
    np.testing.assert_allclose(cost.verify_time(8, 3, ctx), [cost.verify_time(8, 3, c) for c in ctx])


def test_tensor_parallel_splits_work_and_adds_allreduce():
    cfg = load_config("default")
    tp1 = RooflineCostModel(cfg.hardware, cfg.model, cfg.drafters, tp=1)
    tp4 = RooflineCostModel(cfg.hardware, cfg.model, cfg.drafters, tp=4)
    t1, t4 = tp1.verify_time(32, 1, 32000), tp4.verify_time(32, 1, 32000)
    assert t1 / 4 < t4 < t1  # faster, but not 4x: all-reduces cost something
    assert tp4.kv_capacity_tokens() > 4 * tp1.kv_capacity_tokens()  # weights are sharded too


def test_kv_capacity_is_realistic_for_7b_on_h100(cost):
    assert 500_000 < cost.kv_capacity_tokens() < 1_200_000


def test_migration_by_kv_beats_reprefill_for_long_contexts(cost):
    assert cost.kv_transfer_time(8000, 1) < cost.prefill_time(8000)


@given(st.floats(0.0, 0.99), st.integers(1, 12))
@settings(max_examples=50, deadline=None)
def test_expected_tokens_closed_form(a, k):
    got = expected_tokens(np.array([a, a]), k)
    want = [2 * (1 - a ** (j + 1)) / (1 - a) for j in range(k + 1)]
    np.testing.assert_allclose(got, want, rtol=1e-9)


def _state(batch, ctx_per_seq, est, accept=None):
    ids = np.arange(batch)
    est.begin_rollout(batch, np.arange(batch))
    if accept is not None:  # teach the estimator: many outcomes at this acceptance
        rng = np.random.default_rng(0)
        for _ in range(200):
            est.update("model", ids, np.minimum(rng.geometric(1 - accept, batch) - 1, 8), 8)
    ctx = np.full(batch, ctx_per_seq)
    return EngineState(0, 0, 0.0, ids, ctx, int(ctx.sum()), 0, 10**6, est)


def test_goodput_drafts_long_at_small_batch_and_stops_at_large(cost):
    ctx = PolicyContext(cost, ("model",), 8)
    est = AcceptanceEstimator(["model"], prior_mean=0.8)
    small = make_draft_policy("goodput", ctx).choose(_state(2, 1000, est, accept=0.8))
    assert small.drafter == "model" and small.k >= 3
    large = make_draft_policy("goodput", ctx).choose(_state(1024, 2000, est, accept=0.8))
    assert large.k < small.k
    hopeless = make_draft_policy("goodput", ctx).choose(_state(256, 1000, est, accept=0.05))
    assert hopeless == OFF


def test_estimator_learns_per_sample_acceptance():
    est = AcceptanceEstimator(["model"], prior_mean=0.5)
    est.begin_rollout(2, np.array([0, 1]))
    ids = np.array([0, 1])
    truth = np.array([0.9, 0.2])
    rng = np.random.default_rng(1)
    for _ in range(400):
        acc = np.minimum(rng.geometric(1 - truth) - 1, 4)
        est.update("model", ids, acc, 4)
    np.testing.assert_allclose(est.estimates("model", ids), truth, atol=0.05)


def test_static_and_off_and_errors(cost):
    ctx = PolicyContext(cost, ("model",), 8)
    est = AcceptanceEstimator(["model"])
    s = _state(4, 100, est)
    assert make_draft_policy("static:3", ctx).choose(s) == Strategy("model", 3)
    assert make_draft_policy("off", ctx).choose(s) == OFF
    assert make_draft_policy("static:0", ctx).choose(s) == OFF
    for bad in ["static:x", "static:3:nope", "greedy", "goodput:0"]:
        with pytest.raises(UserError):
            make_draft_policy(bad, ctx)
    with pytest.raises(ValueError):
        Strategy("model", 0)
