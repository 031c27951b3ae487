"""When the drafter is distilled again: a fixed interval, or the ski-rental rule (`pays`)
against closed forms."""

import pytest

from rlsched.policies.drafter_schedule import DrafterSchedule, chain_tokens


def rollout(a, k=3, rows=1000):
    """Totals of a rollout whose chains of k drafts accept each draft with probability a
    (expected counts: accepted a + ... + a^k a chain, rejected 1 - a^k)."""
    acc = sum(a**j for j in range(1, k + 1)) * rows
    return dict(drafted=k * rows, accepted=int(round(acc)), rejected=int(round((1 - a**k) * rows)), sd_rows=rows)


def test_chain_tokens():
    assert chain_tokens(0.8, 3) == pytest.approx(1 + 0.8 + 0.64 + 0.512)
    assert chain_tokens(1.0, 4) == 5.0 and chain_tokens(0.0, 4) == 1.0
    assert chain_tokens(0.5, 2.5) == pytest.approx((1 - 0.5**3.5) / 0.5)  # a mean draft length


def test_every_updates_on_its_interval_and_never_at_zero():
    s = DrafterSchedule("every", 3)
    assert [st for st in range(10) if s.due(st)] == [2, 5, 8]
    assert not any(DrafterSchedule("pays", 0).due(st) for st in range(10))
    assert [st for st in range(9) if DrafterSchedule("every", 3, steps=9).due(st)] == [2, 5]  # not after the last


def test_pays_updates_once_staleness_has_cost_the_last_update():
    """After an update that took 1.0 s, acceptance falls from 0.8 to 0.6 (k = 3): each 2.0 s
    rollout would have run 1 - E(0.6) / E(0.8) = 26.3% faster with a fresh drafter, 0.526 s
    of rent, so the second such rollout brings the rent past the price."""
    s = DrafterSchedule("pays", 4)
    assert [st for st in range(4) if s.due(st)] == [3]  # the first update: when `every` says
    s.updated(1.0)
    s.observe(2.0, **rollout(0.8))  # the first rollout after it sets the reference
    assert s.ref == pytest.approx(0.8, abs=0.01) and not s.due(4)
    for st in range(5, 25):  # as fresh as after the update: no rent, no update
        s.observe(2.0, **rollout(0.8))
        assert not s.due(st)
    s.observe(2.0, **rollout(0.6))
    rent = 2.0 * (1 - chain_tokens(0.6, 3) / chain_tokens(0.8, 3))
    assert s.rent_s == pytest.approx(rent, rel=0.02) and not s.due(25)
    s.observe(2.0, **rollout(0.6))
    assert s.due(26)
    s.updated(0.5)
    assert s.rent_s == 0.0 and s.cost_s == 0.5 and not s.due(27)
    s.observe(2.0, **rollout(0.8))  # fresh again: no rent against the old reference, and the new one
    assert s.rent_s == 0.0 and s.ref == pytest.approx(0.8, abs=0.01)
    s.observe(2.0, **rollout(0.6))
    assert s.rent_s == pytest.approx(rent, rel=0.02)


def test_noise_around_the_reference_cancels_and_empty_rollouts_add_nothing():
    s = DrafterSchedule("pays", 1)
    s.updated(0.3)
    s.observe(1.0, **rollout(0.8))
    for i in range(40):
        s.observe(1.0, **rollout(0.83 if i % 2 else 0.77))
        s.observe(5.0, drafted=0, accepted=0, rejected=0, sd_rows=0)  # SD off the whole rollout
    assert s.rent_s < 0.3 and not s.due(100)


def test_without_rejection_counts_accepted_over_drafted_stands_in():
    s = DrafterSchedule("pays", 1)
    s.updated(0.1)
    s.observe(1.0, drafted=300, accepted=240, rejected=None, sd_rows=100)
    assert s.ref == pytest.approx(0.8)
    s.observe(1.0, drafted=300, accepted=150, rejected=None, sd_rows=100)
    assert s.rent_s == pytest.approx(1 - chain_tokens(0.5, 3) / chain_tokens(0.8, 3)) and s.due(2)


def test_state_survives_a_checkpoint_and_bad_modes_are_refused():
    s = DrafterSchedule("pays", 2)
    s.updated(0.7)
    s.observe(1.0, **rollout(0.8))
    s.observe(1.0, **rollout(0.7))
    t = DrafterSchedule("pays", 2)
    t.load(s.state())
    assert t.state() == s.state() and t.due(9) == s.due(9)
    t.load(None)  # a checkpoint from before schedules: as fresh
    assert t.state() == s.state()
    with pytest.raises(ValueError, match="sometimes"):
        DrafterSchedule("sometimes", 2)
