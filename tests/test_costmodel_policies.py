"""The roofline cost model's physics, and the policies driven by hand-built engine states."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlsched.config import eagle_head, load_config
from rlsched.costs.roofline import RooflineCostModel
from rlsched.errors import UserError
from rlsched.policies import (
    OFF,
    AcceptanceEstimator,
    EngineState,
    PolicyContext,
    Strategy,
    expected_tokens,
    make_draft_policy,
)
from rlsched.policies.draft import drain_tokens
from rlsched.policies.types import StepOutcome


@pytest.fixture(scope="module")
def cost():
    return RooflineCostModel.from_config(load_config("default"))


def test_verify_is_nearly_free_at_small_batch_and_linear_at_large(cost):
    small = cost.verify_time(1, 9, 1000) / cost.verify_time(1, 1, 1000)
    large = cost.verify_time(512, 9, 512 * 1000) / cost.verify_time(512, 1, 512 * 1000)
    assert small < 1.1
    assert large > 3.0


def test_an_eagle3_head_is_priced_with_its_real_shapes():
    cfg = load_config("default", overrides=["drafters.0.kind=eagle"])
    head, m = eagle_head(cfg.model, 32000), cfg.model
    # one decoder layer, the projection of three fused hidden states, a QKV over 2 x hidden, a 32k LM head
    fused = 3 * m.hidden * m.hidden + m.hidden * (m.heads + 2 * m.kv_heads) * m.head_dim
    assert head.params == m.layer_params + fused + 32000 * m.hidden
    assert 0.3e9 < head.params < 0.45e9  # for Qwen2.5-7B: not a 0.78B full-vocabulary head
    eagle = RooflineCostModel.from_config(cfg)
    model = RooflineCostModel.from_config(load_config("default"))
    for b in (1, 64):
        # a draft forward of the head costs less than one of the 0.5B draft model, far less than the target's
        assert eagle.draft_time("model", b, 1, b * 1000) < model.draft_time("model", b, 1, b * 1000)
        assert eagle.draft_time("model", b, 1, b * 1000) < 0.25 * eagle.verify_time(b, 1, b * 1000)
    # a smaller draft vocabulary is cheaper at many tokens, where the LM head's compute counts
    big = load_config("default", overrides=["drafters.0.kind=eagle", "drafters.0.draft_vocab=152064"])
    assert RooflineCostModel.from_config(big).draft_time("model", 256, 1, 256 * 1000) > eagle.draft_time(
        "model", 256, 1, 256 * 1000
    )


def test_array_and_scalar_prices_agree(cost):
    ks = np.arange(1, 9)
    np.testing.assert_allclose(cost.verify_time(64, ks + 1, 64000), [cost.verify_time(64, k + 1, 64000) for k in ks])
    np.testing.assert_allclose(
        cost.draft_time("model", 64, ks, 64000), [cost.draft_time("model", 64, k, 64000) for k in ks]
    )
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


@given(st.lists(st.floats(0.0, 0.99), min_size=1, max_size=8), st.integers(1, 8))
@settings(max_examples=50, deadline=None)
def test_drain_tokens_is_batch_times_harmonic_mean(acc, k):
    """B^2 / sum_i 1/E_i: equal to `expected_tokens` when the rows are alike, never above it
    (harmonic <= arithmetic mean), and B at k = 0."""
    a = np.array(acc)
    per_row = [[(1 - x ** (j + 1)) / (1 - x) for j in range(k + 1)] for x in a]
    want = len(a) ** 2 / (1 / np.array(per_row)).sum(axis=0)
    got = drain_tokens(a, k)
    np.testing.assert_allclose(got, want, rtol=1e-9)
    assert got[0] == pytest.approx(len(a))
    assert np.all(got <= expected_tokens(a, k) * (1 + 1e-12))
    np.testing.assert_allclose(drain_tokens(np.full(3, a[0]), k), expected_tokens(np.full(3, a[0]), k), rtol=1e-9)


def test_goodput_drain_drafts_shorter_for_mixed_rows(cost):
    """Half the rows accept 0.95, half 0.3: the plain sum is carried by the likely rows and
    drafts longer than the drain rule, which counts the unlikely rows' steps."""
    ctx = PolicyContext(cost, ("model",), 8)
    est = AcceptanceEstimator(["model"], prior_mean=0.6)
    ids = np.arange(4)
    est.begin_rollout(4, ids)
    for _ in range(300):
        est.update("model", ids, np.array([8, 8, 0, 0]) * (np.random.default_rng(_).random(4) < [0.66, 0.66, 1, 1]), 8)
    st_ = EngineState(0, 0, 0.0, ids, np.full(4, 500), 2000, 0, 10**6, est)
    mean, drain = make_draft_policy("goodput", ctx).choose(st_), make_draft_policy("goodput:drain", ctx).choose(st_)
    assert 0 < drain.k < mean.k


def test_estimator_sample_decay_follows_a_change_and_keeps_prompt_counts():
    """Acceptance that falls mid-response: the decayed estimate follows it, the plain one stays
    near the response's mean; both fold the same counts into the prompt."""
    # "read": decay 0.7, read every step (pending steps must decay as applied ones do)
    ests = {
        d: AcceptanceEstimator(["model"], prior_mean=0.5, sample_decay=1.0 if d == 1.0 else 0.7)
        for d in (1.0, 0.7, "read")
    }
    ids = np.array([0])
    for d, est in ests.items():
        est.begin_rollout(2, np.array([0, 0]))
        for step in range(40):  # 20 steps all 4 accepted, then 20 steps none
            est.update("model", ids, np.array([4 if step < 20 else 0]), 4)
            if d == "read":
                est.estimates("model", ids)
    plain, recent, read = (float(ests[d].estimates("model", ids)[0]) for d in (1.0, 0.7, "read"))
    assert recent < 0.3 < 0.7 < plain  # (0.27: the prior 0.5 at strength 4 against ~3 recent failures)
    assert read == pytest.approx(recent, rel=1e-9)
    assert float(ests[0.7].estimates("model", ids, whole=True)[0]) == pytest.approx(plain)  # a trace's: the mean
    for est in ests.values():
        est.finish(ids)
    np.testing.assert_allclose(ests[1.0].estimates("model", np.array([1])), ests[0.7].estimates("model", np.array([1])))
    with pytest.raises(ValueError, match="sample_decay"):
        AcceptanceEstimator(["model"], sample_decay=0.0)


def test_calibrated_goodput_measures_each_k_and_explores_its_neighbours(cost):
    """The k the cost model picks measures 2x its price: it gets its own factor (`_scales`)
    and is left; on the way a neighbour priced within the margin is tried before it is
    measured."""
    from dataclasses import replace

    ctx = PolicyContext(cost, ("model",), 6)
    est = AcceptanceEstimator(["model"], prior_mean=0.8)
    st_ = _state(4, 500, est, accept=0.8)
    k0 = make_draft_policy("goodput:1", ctx).choose(st_).k
    pol = make_draft_policy("goodput:1", replace(ctx, calibrate=True))
    ks = []
    for step in range(40):
        choice = pol.choose(EngineState(0, step, 0.0, st_.sample_ids, st_.ctx_lens, st_.ctx_tokens, 0, 10**6, est))
        ks.append(choice.k)
        v = cost.verify_time(4, choice.k + 1, st_.ctx_tokens) * (2.0 if choice.k == k0 else 1.0)
        d = cost.draft_time("model", 4, choice.k, st_.ctx_tokens)
        pol.observe(StepOutcome(0, step, choice, 4, 4 * choice.k, 0, 4, v + d, d, v))
    assert k0 in ks and ks[-1] != k0 and len(set(ks)) >= 2
    scales = pol._scales("verify", 4)
    assert scales[k0] > 1.5 * scales[ks[-1]]


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
    for bad in ["static:x", "static:3:nope", "greedy", "goodput:0", "seqgoodput:drain", "goodput:drains"]:
        with pytest.raises(UserError):
            make_draft_policy(bad, ctx)
    with pytest.raises(UserError, match="or 'drain'"):
        make_draft_policy("goodput:x", ctx)
    with pytest.raises(ValueError):
        Strategy("model", 0)
