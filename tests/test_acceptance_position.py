"""Acceptance by draft position (policies/position.py): closed forms, the simulator's draws,
goodput's choice under a decaying curve, and the maximum-likelihood fit to traces."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from rlsched.config import load_config
from rlsched.costs.choose import cost_model_for
from rlsched.policies.acceptance import AcceptanceEstimator
from rlsched.policies.draft import GoodputPolicy, SeqGoodputPolicy, drain_tokens, expected_tokens
from rlsched.policies.position import (
    accepted_drafts,
    chain_tokens,
    expected_accepted,
    learned_trials,
    reach,
    sample_accepted,
)
from rlsched.policies.position_fit import fit_drafter, fit_position_curves
from rlsched.policies.tree import chain_tokens as constant_chain_tokens
from rlsched.policies.types import EngineState
from rlsched.sim.simulate import policy_context, simulate
from tests.support import one_line_error, rlsched


def _closed_form(a: float, k: int, decay: float) -> float:
    """sum_{i=1..k} prod_{j<=i} min(a decay^(j-1), 1), written out."""
    return sum(float(np.prod([min(a * decay ** (j - 1), 1.0) for j in range(1, i + 1)])) for i in range(1, k + 1))


@pytest.mark.parametrize("decay", [1.0, 0.9, 0.6, 1.1, 1.6])
def test_expected_accepted_is_the_sum_of_products(decay):
    for a in (0.3, 0.75, 0.95):
        for k in range(1, 9):
            assert expected_accepted(a, k, decay) == pytest.approx(_closed_form(a, k, decay), rel=1e-12)
        tokens = expected_tokens(np.array([a, a]), 8, decay)
        want = [2 * (1 + _closed_form(a, k, decay)) for k in range(9)]
        assert tokens == pytest.approx(want, rel=1e-12)
        assert chain_tokens(np.array([a]), np.array([5]), decay)[0] == pytest.approx(1 + _closed_form(a, 5, decay))


def test_the_constant_curve_is_todays_arithmetic_to_the_bit():
    rng = np.random.default_rng(1)
    a = rng.uniform(0.05, 0.98, 64)
    exp = rng.standard_exponential((5, 64))
    ninv = -1.0 / np.log(a)
    assert np.array_equal(accepted_drafts(exp, ninv), (exp * ninv).astype(np.int64))
    assert np.array_equal(accepted_drafts(exp, ninv, 1.0), (exp * ninv).astype(np.int64))
    # the formulas' constant path, and the general one agreeing with it
    assert np.allclose(reach(a, 8, 1.0)[:, 1:].sum(axis=1) + 1, constant_chain_tokens(a, 8))
    assert np.allclose(drain_tokens(a, 8), drain_tokens(a, 8, 1.0 - 1e-15), rtol=1e-9)
    acc, ks = rng.integers(0, 5, 64), np.full(64, 4)
    assert learned_trials(acc, ks) == (acc, ks)
    first = learned_trials(acc, ks, 0.8)
    assert np.array_equal(first[0], (acc >= 1).astype(int)) and np.array_equal(first[1], np.ones(64))


@pytest.mark.parametrize("a,decay", [(0.8, 0.85), (0.95, 0.7), (0.5, 0.95), (0.9, 1.0), (0.6, 1.08), (0.5, 1.5)])
def test_the_inversion_draws_match_the_curve_for_every_k(a, decay):
    """The simulator's draw (one Exp(1) a row, inverted) against the closed form and against
    drawing position by position, k = 1..8."""
    rng = np.random.default_rng(7)
    n = 200_000
    raw = accepted_drafts(rng.standard_exponential((1, n)), np.full(n, -1.0 / np.log(a)), decay)[0]
    for k in range(1, 9):
        acc = np.minimum(raw, k)
        se = acc.std() / np.sqrt(n)
        assert abs(acc.mean() - _closed_form(a, k, decay)) < 5 * se + 1e-9, k
        ref = sample_accepted(rng, a, k, decay, (n,))
        assert abs(acc.mean() - ref.mean()) < 5 * np.hypot(se, ref.std() / np.sqrt(n)) + 1e-9, k
        # the whole law, not only its mean
        for m in range(k + 1):
            want = reach(a, k, decay)[m] - (reach(a, k, decay)[m + 1] if m < k else 0.0)
            assert abs((acc == m).mean() - want) < 5 * np.sqrt(want * (1 - want) / n) + 1e-9


def _run_static(k: int, decay: float, a: float = 0.8):
    """A simulated rollout of static:k drafting under `decay` (the config's), every row at `a`:
    (mean accepted per verified row, rows verified)."""
    cfg = load_config(
        "default",
        overrides=[
            "rl.steps=1",
            "workload.prompts=16",
            f"drafters.0.acceptance.mean={a}",
            f"drafters.0.acceptance.position_decay={decay}",
            "drafters.0.acceptance.prompt_concentration=null",
            "drafters.0.acceptance.sample_concentration=null",
            "cluster.instances=1",
        ],
    )
    tl = simulate(cfg, f"static:{k}").timeline_frame()
    sd = tl[tl["k"] == k]
    return sd["accepted"].sum() / sd["batch"].sum(), int(sd["batch"].sum())


@pytest.mark.parametrize("k", [1, 3, 6])
def test_the_simulator_accepts_as_the_curve_says(k):
    decay = 0.8
    mean, rows = _run_static(k, decay)
    want = _closed_form(0.8, k, decay)
    # rows ending mid-draft keep fewer drafts than drawn: a small downward bias, within 3%
    assert mean == pytest.approx(want, rel=0.03, abs=4 * np.sqrt(want / rows))
    if k > 1:
        assert mean < 0.97 * _closed_form(0.8, k, 1.0)


def _state(n: int, a: float) -> EngineState:
    est = AcceptanceEstimator(["model"], prior_mean=a)
    est.begin_rollout(n, np.arange(n))
    return EngineState(0, 0, 0.0, np.arange(n), np.full(n, 600), 600 * n, 0, 10**7, est)


@pytest.mark.parametrize("policy", [GoodputPolicy, SeqGoodputPolicy])
def test_a_decaying_curve_makes_goodput_draft_shorter(policy):
    overrides = ["drafters.0.kind=eagle", "speculation.k_max=8"]
    cfg = load_config("default", overrides=overrides)
    cost = cost_model_for(cfg)
    chosen = {}
    for decay in (1.0, 0.75):  # the config's decay reaches the policy's context
        cfg = load_config("default", overrides=[*overrides, f"drafters.0.acceptance.position_decay={decay}"])
        chosen[decay] = policy(policy_context(cfg, cost)).choose(_state(4, 0.85))
    assert chosen[1.0].k >= 3, chosen
    assert 0 < chosen[0.75].k < chosen[1.0].k, chosen


def _records(rng, alpha: float, decay: float, reps: int = 60) -> pd.DataFrame:
    rows = []
    for k in range(1, 9):
        for batch in (1, 4, 16):
            acc = sample_accepted(rng, alpha, k, decay, (reps, batch)).sum(axis=1)
            rows += [("model", k, 1, batch, batch * k, int(s)) for s in acc]
    rows.append(("model", 4, 2, 8, 40, 12))  # a tree: left out
    rows.append((None, 0, 1, 8, 0, 0))  # plain decoding: no drafter
    return pd.DataFrame(rows, columns=["drafter", "k", "width", "batch", "drafted", "accepted"])


@pytest.mark.parametrize("alpha,decay", [(0.8, 0.85), (0.7, 0.95), (0.9, 0.7), (0.6, 1.05)])
def test_the_fit_recovers_known_parameters(alpha, decay):
    fits = fit_position_curves(_records(np.random.default_rng(3), alpha, decay))
    assert list(fits) == ["model"]
    f = fits["model"]
    assert f.skipped == 1 and f.steps == 8 * 3 * 60
    assert 0 < f.alpha_se < 0.03 and 0 < f.decay_se < 0.03
    assert abs(f.alpha - alpha) < max(3.5 * f.alpha_se, 0.01)
    assert abs(f.decay - decay) < max(3.5 * f.decay_se, 0.01)


def test_the_fit_reads_per_position_counts_and_finds_a_flat_curve():
    rng = np.random.default_rng(0)
    n, k, alpha, decay = 20_000, 5, 0.75, 0.8
    acc = sample_accepted(rng, alpha, k, decay, (n,))
    counts = [int((acc >= i).sum()) for i in range(1, k + 1)]
    f = fit_drafter("eagle", positions=[(n, counts)])
    assert abs(f.alpha - alpha) < 3.5 * f.alpha_se and abs(f.decay - decay) < 3.5 * f.decay_se
    flat = fit_position_curves(_records(rng, 0.8, 1.0, reps=30))["model"]
    assert flat.decay > 0.98 and abs(flat.alpha - 0.8) < 0.02
    with pytest.raises(ValueError, match="no chain step"):
        fit_drafter("x", pd.DataFrame({"k": [4], "width": [2], "batch": [2], "drafted": [8], "accepted": [3]}))


def test_a_decay_outside_its_range_is_one_line(tmp_path):
    proc = rlsched(
        "simulate", "--set", "drafters.0.acceptance.position_decay=2.5", "--out", str(tmp_path / "o"), cwd=tmp_path
    )
    one_line_error(proc, "drafters.0.acceptance.position_decay", "2.5")


def test_rlsched_fit_reports_each_drafters_curve():
    """What `rlsched fit` adds to its summary: each drafter's fitted curve, from decode steps."""
    from rlsched.analysis.engine import position_curves

    df = _records(np.random.default_rng(5), 0.8, 0.85).assign(kind="decode")
    df.loc[df.index[:5], "kind"] = "prefill"  # (left out)
    curves = position_curves(df)
    assert list(curves) == ["model"] and curves["model"]["steps"] == 8 * 3 * 60 - 5
    assert abs(curves["model"]["decay"] - 0.85) < 0.03 and abs(curves["model"]["alpha"] - 0.8) < 0.03
    assert position_curves(df.drop(columns="accepted")) == {}  # (a profile's records: nothing to fit)
