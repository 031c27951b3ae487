"""The simulator against closed-form cases, and its invariants (no token lost, determinism)."""

from __future__ import annotations

import numpy as np
import pytest

from rlsched.config import load_config
from rlsched.costs.roofline import RooflineCostModel
from rlsched.sim.simulate import simulate

ONE_INSTANCE = [
    "cluster.instances=1",
    "workload.samples_per_prompt=1",
    "rl.steps=1",
    "workload.prompt_len={dist: fixed, value: 100}",
    "drafters.0.acceptance.prompt_concentration=null",
    "drafters.0.acceptance.sample_concentration=null",
]


def one_instance(batch: int, response: int, acceptance: float, extra=()):
    return load_config(
        "default",
        overrides=ONE_INSTANCE
        + [
            f"workload.prompts={batch}",
            f"cluster.max_batch={batch}",
            f"workload.response_len={{dist: fixed, value: {response}}}",
            f"drafters.0.acceptance.mean={acceptance}",
            *extra,
        ],
    )


@pytest.mark.parametrize("a", [0.5, 0.8])
@pytest.mark.parametrize("k", [1, 3, 6])
def test_mean_tokens_per_step_matches_closed_form(a, k):
    res = simulate(one_instance(16, 6000, a), f"static:{k}")
    tl = res.timeline_frame()
    dec = tl[tl.kind == "decode"]
    measured = dec.emitted.sum() / dec.batch.sum()
    expected = (1 - a ** (k + 1)) / (1 - a)
    assert measured == pytest.approx(expected, rel=0.01)


def test_makespan_is_the_sum_of_the_cost_models_step_times():
    cfg = one_instance(8, 500, 0.7)
    res = simulate(cfg, "static:3")
    tl = res.timeline_frame()
    assert res.summary()["generation_s"] == pytest.approx(tl.step_ms.sum() / 1e3, rel=1e-9)
    cost = RooflineCostModel.from_config(cfg)
    dec = tl[tl.kind == "decode"]
    want = [cost.verify_time(b, 4, c) + cost.draft_time("model", b, 3, c) for b, c in zip(dec.batch, dec.ctx_tokens)]
    want[0] += cost.drafter_prefill_time("model", 8 * 100, 8 * 100**2)  # the drafter takes the prompts in
    np.testing.assert_allclose(dec.step_ms / 1e3, want, rtol=1e-9)


def _catch_up_s(cfg, policy):
    """(timeline, each decode step's time beyond its verify and drafting: the drafter's catch-up)."""
    tl = simulate(cfg, policy).timeline_frame().sort_values("step").reset_index(drop=True)
    cost = RooflineCostModel.from_config(cfg)
    plain = [
        cost.verify_time(b, k + 1, c) + (cost.draft_time("model", b, k, c) if k else 0.0)
        for b, k, c in zip(tl.batch, tl.k, tl.ctx_tokens)
    ]
    return tl, cost, tl.step_ms.to_numpy() / 1e3 - np.array(plain)


def test_a_drafter_pays_to_take_in_rows_that_join():
    """8 prompts through 4 rows: the first drafting step after each admission feeds the
    drafter the joining rows' prompts (100 tokens each), no other step does."""
    tl, cost, extra = _catch_up_s(one_instance(4, 40, 0.7, ["workload.prompts=8"]), "static:3")
    after_prefill = (tl.kind.shift(1) == "prefill").to_numpy() & (tl.kind == "decode").to_numpy()
    n_pre = tl.ctx_tokens.shift(1).to_numpy()
    dec = (tl.kind == "decode").to_numpy()
    want = np.where(
        after_prefill,
        [
            cost.drafter_prefill_time("model", int(n), int(n) * 100) if a else 0.0
            for a, n in zip(after_prefill, np.nan_to_num(n_pre))
        ],
        0.0,
    )
    assert after_prefill.sum() >= 2
    np.testing.assert_allclose(extra[dec], want[dec], rtol=1e-9, atol=1e-12)


def test_fresh_samples_of_a_prompt_are_fed_to_the_drafter_once():
    cfg = load_config(
        "default",
        overrides=[
            *ONE_INSTANCE,
            "workload.prompts=2",
            "workload.samples_per_prompt=4",
            "cluster.max_batch=8",
            "workload.response_len={dist: fixed, value: 30}",
        ],
    )
    tl, cost, extra = _catch_up_s(cfg, "static:3")
    first = int(np.flatnonzero((tl.kind == "decode").to_numpy())[0])
    assert extra[first] == pytest.approx(cost.drafter_prefill_time("model", 2 * 100, 2 * 100**2), rel=1e-9)


def test_drafting_after_off_steps_first_feeds_the_drafter_what_it_missed():
    """twostate:4:3 decodes 8 rows without drafts until 4 remain: the first drafting step feeds
    the drafter every remaining row's whole context (prompt and the off steps' tokens); later
    steps feed nothing more (steady feeds are in draft_time)."""
    cfg = one_instance(
        8, 60, 0.7, ["workload.response_len={dist: empirical, values: [20, 30, 40, 50, 60, 70, 80, 90]}"]
    )
    tl, cost, extra = _catch_up_s(cfg, "twostate:4:3")
    dec = tl[tl.kind == "decode"]
    sd = dec[dec.k > 0]
    assert len(dec[dec.k == 0]) > 0 and len(sd) > 1
    first = sd.index[0]
    b, c = int(tl.batch[first]), int(tl.ctx_tokens[first])
    # all rows started together and decoded one token a step: equal contexts
    assert extra[first] == pytest.approx(cost.drafter_prefill_time("model", c, c * c // b), rel=1e-9)
    np.testing.assert_allclose(extra[sd.index[1:]], 0.0, atol=1e-12)
    np.testing.assert_allclose(extra[dec[dec.k == 0].index], 0.0, atol=1e-12)


def test_off_reproduces_plain_decoding_time_exactly():
    batch, prompt, length = 12, 100, 300
    cfg = one_instance(batch, length, 0.7)
    cost = RooflineCostModel.from_config(cfg)
    plain = cost.prefill_time(batch * prompt, batch * prompt**2)
    plain += sum(cost.verify_time(batch, 1, batch * (prompt + j)) for j in range(length))
    got = simulate(cfg, "off").summary()["generation_s"]
    assert got == pytest.approx(plain, rel=1e-12)


def test_shared_prompts_prefill_each_prompt_once():
    """3 prompts x 4 samples, all in one batch: with cluster.share_prompts the prefill is of
    3 prompts, not 12; nothing else changes."""
    batch, prompt, length = 12, 100, 50
    base = [
        *ONE_INSTANCE,
        "workload.prompts=3",
        "workload.samples_per_prompt=4",
        f"cluster.max_batch={batch}",
        f"workload.response_len={{dist: fixed, value: {length}}}",
    ]
    times = {}
    for share in (False, True):
        cfg = load_config("default", overrides=[*base, f"cluster.share_prompts={share}"])
        tl = simulate(cfg, "off").timeline_frame()
        times[share] = tl
    cost = RooflineCostModel.from_config(cfg)
    pre = {share: tl[tl.kind == "prefill"].step_ms.sum() / 1e3 for share, tl in times.items()}
    assert pre[False] == pytest.approx(cost.prefill_time(batch * prompt, batch * prompt**2), rel=1e-12)
    assert pre[True] == pytest.approx(cost.prefill_time(3 * prompt, 3 * prompt**2), rel=1e-12)
    dec = {share: tl[tl.kind == "decode"].step_ms.sum() for share, tl in times.items()}
    assert dec[True] == pytest.approx(dec[False], rel=1e-12)


@pytest.mark.parametrize(
    "preset, policy, extra",
    [
        ("default", "off", []),
        ("default", "static:4", []),
        ("default", "goodput", []),
        # one instance: instances share one acceptance estimator, and a steady run's outcomes reach
        # the others when the run ends, not step by step (a learning policy may then choose apart)
        ("ngram-llama8b", "seqgoodput", ["cluster.instances=1"]),
        ("eagle-h200-14b", "static:3", []),
    ],
)
def test_steady_runs_equal_step_by_step(preset, policy, extra):
    cfg = load_config(preset, overrides=["rl.steps=2", "workload.prompts=24", *extra])
    fast = simulate(cfg, policy)
    slow = simulate(cfg.model_copy(update={"max_steady_run": 1}), policy)
    a, b = fast.summary(), slow.summary()
    assert a["engine_steps"] == b["engine_steps"]
    assert a["response_tokens"] == b["response_tokens"]
    assert a["generation_s"] == pytest.approx(b["generation_s"], rel=1e-9)
    order = ["rl_step", "instance", "step"]
    ta, tb = fast.timeline_frame().sort_values(order), slow.timeline_frame().sort_values(order)
    assert (ta.emitted.values == tb.emitted.values).all() and (ta.k.values == tb.k.values).all()


def _tokens_conserved(res):
    tl, samples = res.timeline_frame(), res.samples_frame()
    assert tl[tl.kind == "decode"].emitted.sum() == samples.response_len.sum()
    assert samples.finish_s.notna().all()
    assert (samples.instance >= 0).all()


def test_preemption_loses_and_duplicates_no_tokens():
    cfg = load_config(
        "default",
        overrides=["rl.steps=1", "workload.prompts=32", "cluster.instances=1", "cluster.kv_capacity_tokens=60000"],
    )
    res = simulate(cfg, "goodput")
    assert res.summary()["preemptions"] > 0
    _tokens_conserved(res)


def test_rebalance_migrates_without_losing_tokens_and_charges_cost():
    moved = simulate(load_config("uneven-load"), "static:3", "rebalance")
    assert moved.summary()["migrations"] > 0
    _tokens_conserved(moved)
    log = moved.records[0].stage.migration_log
    assert {m[5] for m in log} & {"kv", "reprefill"}  # running sequences moved, not only queued ones
    assert all(m[6] > 0 for m in log if m[5] == "kv")  # KV transfers take time


def test_same_seed_same_summary_other_seed_differs():
    cfg = load_config("default", overrides=["workload.prompts=16"])
    a, b = simulate(cfg).summary(), simulate(cfg).summary()
    assert a == b
    c = simulate(cfg.model_copy(update={"seed": 1})).summary()
    assert c["generation_s"] != a["generation_s"]


def test_drift_lowers_acceptance_and_an_update_restores_it():
    cfg = load_config(
        "default",
        overrides=[
            "workload.prompts=8",
            "rl.steps=5",
            "rl.acceptance_drift_per_step=0.1",
            "rl.drafter_update_interval=3",
            "rl.overlap_drafter_update=false",
        ],
    )
    steps = simulate(cfg).steps_frame()
    m = steps["accept_mean_model"].round(6).tolist()
    assert m[:4] == pytest.approx([0.7, 0.6, 0.5, 0.7])  # update after the 3rd step restores it
    assert steps.drafter_update_s.iloc[2] > 0 and steps.drafter_update_s.iloc[0] == 0


def test_goodput_matches_the_best_static_k_and_beats_off_on_a_long_tail():
    """With kernel floors a small drafter's forward costs a fifth of the target's at a few rows,
    so k = 1 is near the best at every batch: goodput reaches it within 1% without knowing it,
    and beats off and every longer static k."""
    cfg = load_config("longtail-grpo", overrides=["workload.prompts=64", "cluster.instances=2"])
    good = simulate(cfg, "goodput").summary()["generation_s"]
    times = {
        pol: simulate(cfg, pol).summary()["generation_s"]
        for pol in ["off", "static:1", "static:2", "static:4", "static:6"]
    }
    assert good <= 1.01 * min(times.values()), times
    for pol in ["off", "static:2", "static:4", "static:6"]:
        assert good < times[pol], pol


def test_pays_schedule_updates_as_often_as_staleness_costs():
    """`rl.drafter_update_schedule=pays` (the rule `rlsched run` uses): the first update on the
    interval; then, with no drift, a fresh drafter has nothing to win back and no update follows
    for a while, where `every` keeps updating; with fast drift it updates again, and the
    acceptance it restores shows in the next step."""
    base = ["workload.prompts=8", "rl.steps=10", "rl.drafter_update_interval=2", "rl.overlap_drafter_update=false"]

    def updates(drift, schedule):
        cfg = load_config(
            "default",
            overrides=[*base, f"rl.acceptance_drift_per_step={drift}", f"rl.drafter_update_schedule={schedule}"],
        )
        steps = simulate(cfg).steps_frame()
        return steps.index[steps.drafter_update_s > 0].tolist(), steps

    every, _ = updates(0.0, "every")
    assert every == [1, 3, 5, 7]  # not after the last step: no rollout would use it
    calm, _ = updates(0.0, "pays")
    assert calm[0] == 1 and len(calm) < len(every)
    fast, steps = updates(0.1, "pays")
    assert fast[0] == 1 and len(fast) > len(calm)
    m = steps["accept_mean_model"].round(6).tolist()
    after = fast[1] + 1
    assert m[after] > m[fast[1]]  # the second update restored what drift took
