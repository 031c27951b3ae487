"""twostate's drain solve and bandit's bounded exploration, on hand-built states and cost models."""

from __future__ import annotations

import numpy as np
import pytest

from rlsched.config import load_config
from rlsched.policies import OFF, AcceptanceEstimator, EngineState, StepOutcome, Strategy
from rlsched.policies.bandit import HOLD, TRIES, BanditPolicy
from rlsched.policies.lookup import DRAIN_ACCEPTANCE, TwoStatePolicy, rates
from rlsched.sim.simulate import cost_model_for, policy_context


def state(batch, step=0, ctx_per_seq=1000):
    est = AcceptanceEstimator(["model"], prior_mean=0.7)
    est.begin_rollout(batch, np.arange(batch))
    ids = np.arange(batch)
    return EngineState(0, step, 0.0, ids, np.full(batch, ctx_per_seq), batch * ctx_per_seq, 0, 10**6, est)


def preset_ctx(name, *overrides):
    cfg = load_config(name, overrides=list(overrides))
    return policy_context(cfg, cost_model_for(cfg))


def test_twostate_picks_the_draft_that_wins_the_drain_not_the_small_batch():
    """On eagle-h200-14b's cost model a deep draft gains most at a few rows, a shallow one at
    the batch sizes that hold most of a drain's tokens: the solve takes the k with the least
    drain time, summed here over every batch size from 1 to max_batch."""
    ctx = preset_ctx("eagle-h200-14b")
    pol = TwoStatePolicy.solve(ctx)
    a = DRAIN_ACCEPTANCE * ctx.prior("eagle")
    r = np.array([rates(ctx, "eagle", b, a) for b in range(1, ctx.max_batch + 1)])
    drain = (1.0 / r).sum(axis=0)  # seconds per token, summed over batch sizes: k = 0..k_max
    small = r[:8].mean(axis=0)
    assert pol.on == Strategy("eagle", int(np.argmin(drain)))
    assert pol.k < int(np.argmax(small[1:])) + 1  # shallower than the small-batch winner
    assert pol.max_batch_on == ctx.max_batch  # it pays at every batch size here


def test_twostate_turns_off_above_the_batch_where_off_beats_its_strategy():
    """With short contexts and batches up to 1024 (eagle-h200-14b's cost model), verification is
    compute-bound at large batch: off wins there, and the solve turns speculation off above
    the batch where it starts to."""
    ctx = preset_ctx(
        "eagle-h200-14b",
        "cluster.max_batch=1024",
        "workload.prompt_len={dist: fixed, value: 64}",
        "workload.response_len={dist: fixed, value: 128}",
    )
    pol = TwoStatePolicy.solve(ctx)
    assert 1 <= pol.max_batch_on < ctx.max_batch
    a = DRAIN_ACCEPTANCE * ctx.prior("eagle")

    def gain(b):
        r = rates(ctx, "eagle", b, a)
        return r[pol.k] / r[0]

    assert gain(pol.max_batch_on // 2) > 1 > gain(2 * pol.max_batch_on)
    assert pol.choose(state(pol.max_batch_on)) == pol.on
    assert pol.choose(state(pol.max_batch_on + 1)) == OFF


def test_twostate_stays_off_where_drafting_never_pays():
    ctx = preset_ctx("low-acceptance")
    pol = TwoStatePolicy.solve(ctx)
    assert pol.max_batch_on == 0
    assert all(pol.choose(state(b)) == OFF for b in (1, 8, 256))


def drain(pol, speed, rows=256, last=1, steps_per_batch=6):
    """Drive `pol` through a drain from `rows` rows to `last` (steps_per_batch steps at each
    batch size); `speed(strategy, batch)` gives (tokens emitted, seconds). Returns the strategies chosen."""
    chosen, step = [], 0
    for b in range(rows, last - 1, -1):
        for _ in range(steps_per_batch):
            s = pol.choose(state(b, step))
            emitted, seconds = speed(s, b)
            pol.observe(StepOutcome(0, step, s, b, b * s.k, emitted - b, emitted, seconds, 0.0, seconds))
            chosen.append(s)
            step += 1
    return chosen


def test_bandit_where_off_is_best_spends_a_bounded_number_of_steps_drafting():
    """Each draft length is slower than plain decoding at every batch size (more so the deeper
    it drafts): over a 1536-step drain through nine buckets the bandit tries only off's
    neighbour, k = 1, TRIES times a bucket (trying every arm of every bucket would draft on
    9 x 6 x TRIES steps); the next drain, over buckets it has learned, does not draft."""

    def speed(s, b):
        plain = 0.01 + 0.0002 * b
        return b + int(0.3 * s.k * b), plain * (1 + 0.5 * s.k)

    pol = BanditPolicy(preset_ctx("default"))
    chosen = drain(pol, speed)
    assert sum(not s.is_off for s in chosen) <= 9 * TRIES
    assert max(s.k for s in chosen) == 1  # only off's neighbour was ever tried
    assert all(s.is_off for s in drain(pol, speed))


def test_bandit_finds_a_drafting_leader_and_carries_it_to_the_next_bucket():
    """Where k = 3 is best at every batch size (k = 2 and 4 within 5%), the drain climbs to it
    once and each next bucket starts there: it drafts at k = 3 on most steps, its exploration
    costs under 1% of the drain's time against k = 3 throughout, and k = 6 or 8 is never tried."""

    def speed(s, b):
        tokens = {0: 1.0, 1: 1.6, 2: 2.0, 3: 2.3, 4: 2.45, 6: 2.6, 8: 2.65}[s.k]
        return int(round(tokens * b)), 0.01 * (1 + 0.12 * s.k)

    pol = BanditPolicy(preset_ctx("default"))
    chosen = drain(pol, speed, last=16)  # (at a few rows, whole tokens would round the rates apart)
    ks = [s.k for s in chosen]
    assert ks.count(3) >= 0.8 * len(ks)
    assert 8 not in ks and 6 not in ks
    per_row = [speed(s, 100) for s in chosen]  # tokens a row and seconds of each step, at one batch size
    best = speed(Strategy("model", 3), 100)
    assert sum(t for _, t in per_row) / sum(n for n, _ in per_row) < 1.01 * best[1] / best[0]


def test_bandit_scores_a_step_by_the_harmonic_mean_of_its_rows_expected_advances():
    """Two rows at estimated acceptance 0 and 0.8 expect 1 and 1 + 0.8 + 0.64 = 2.44 tokens a
    step at k = 2: the step's tokens a row are scaled by their harmonic over their plain mean,
    whatever each row drew this step (its luck evens out over its steps)."""
    s = Strategy("model", 2)
    accept = np.array([0.0, 0.8])
    lucky = StepOutcome(0, 0, s, 2, 4, 2, 4, 1.0, 0.0, 1.0, accepted_per_row=np.array([0, 2]))
    unlucky = StepOutcome(0, 0, s, 2, 4, 2, 4, 1.0, 0.0, 1.0, accepted_per_row=np.array([1, 1]))
    e = np.array([1.0, 2.44])
    factor = 1.0 / (e.mean() * (1.0 / e).mean())
    assert BanditPolicy._advance(lucky, accept) == pytest.approx(2.0 * factor)
    assert BanditPolicy._advance(unlucky, accept) == BanditPolicy._advance(lucky, accept)
    assert BanditPolicy._advance(lucky, np.array([0.5, 0.5])) == pytest.approx(2.0)  # rows alike: the mean
    plain = StepOutcome(0, 0, OFF, 2, 0, 0, 2, 1.0, 0.0, 1.0)
    assert BanditPolicy._advance(plain) == pytest.approx(1.0)


def test_bandit_instances_behind_on_the_drafter_leave_a_draft_to_the_one_trying_it():
    """Two instances of a cluster start off-led in one bucket: the first tries k = 1, the second
    (its drafter behind too) keeps to off until the first's claim lapses, HOLD step times
    after its step ends (off tried, a bucket climbs to k = 1)."""
    ctx = preset_ctx("default")
    a, b = BanditPolicy(ctx), BanditPolicy(ctx)
    for step in range(TRIES):  # off is tried first
        assert a.choose(state(8, step)) == OFF
        a.observe(StepOutcome(0, step, OFF, 8, 0, 0, 8, 0.1, 0.0, 0.1))
    sa = a.choose(state(8))
    assert sa == a.arms[1] and b.choose(state(8)) == OFF
    a.observe(StepOutcome(0, 0, sa, 8, 8, 4, 12, 0.1, 0.02, 0.08))
    b.observe(StepOutcome(1, 0, OFF, 8, 0, 0, 8, 0.1, 0.0, 0.1))
    later = state(8)
    later.time = 0.1 + 0.1 + HOLD * 0.1 + 0.01  # past the first instance's claim
    assert b.choose(later) == sa
