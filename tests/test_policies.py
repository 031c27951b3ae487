"""twostate, bandit, table, oracle and policy files, driven by hand-built states and in the simulator."""

from __future__ import annotations

import gc
import json
import subprocess
import sys

import numpy as np
import pytest

from rlsched.config import load_config
from rlsched.costs.roofline import RooflineCostModel
from rlsched.errors import UserError
from rlsched.policies import OFF, AcceptanceEstimator, EngineState, StepOutcome, Strategy, make_draft_policy
from rlsched.policies.bandit import BanditPolicy
from rlsched.policies.lookup import TablePolicy, TwoStatePolicy
from rlsched.policies.policyfile import load_policy_file, save_policy_file
from rlsched.sim.learn import ACCEPT_EDGES, MIN_GAIN, Learner, ctx_edges, vllm_table
from rlsched.sim.simulate import config_identity, policy_context, simulate


@pytest.fixture(scope="module")
def cfg():
    return load_config("default", overrides=["workload.prompts=16", "rl.steps=1"])


@pytest.fixture(scope="module")
def ctx(cfg):
    return policy_context(cfg, RooflineCostModel.from_config(cfg))


def state(batch, step=0, ctx_per_seq=1000):
    est = AcceptanceEstimator(["model"], prior_mean=0.7)
    est.begin_rollout(batch, np.arange(batch))
    ids = np.arange(batch)
    return EngineState(0, step, 0.0, ids, np.full(batch, ctx_per_seq), batch * ctx_per_seq, 0, 10**6, est)


def test_twostate_solve_turns_sd_off_at_large_batch(ctx):
    short = [
        "cluster.max_batch=1024",
        "workload.prompt_len={dist: fixed, value: 64}",
        "workload.response_len={dist: fixed, value: 128}",
    ]  # short contexts: compute-bound at large batch
    big = policy_context(load_config("default", overrides=short), ctx.cost)
    pol = TwoStatePolicy.solve(big)
    assert 1 <= pol.max_batch_on < big.max_batch and pol.k >= 1
    assert pol.choose(state(1)) == Strategy("model", pol.k)
    assert pol.choose(state(pol.max_batch_on + 1)) == OFF
    assert make_draft_policy("twostate:32:3", ctx).choose(state(32)) == Strategy("model", 3)


def test_bandit_learns_the_best_arm_per_bucket(ctx):
    """It climbs from off along k to the best arm; a new bucket starts from the leader next door."""
    ctx = policy_context(load_config("default"), ctx.cost)
    pol = BanditPolicy(ctx, epsilon=0)
    best = Strategy("model", 3)
    for step in range(60):  # reward: 1000 tok/s for k = 3, 100 less for each step of k away from it
        s = pol.choose(state(8, step))
        pol.observe(StepOutcome(0, step, s, 8, 0, 0, int(1000 - 100 * abs(s.k - 3)), 1.0, 0.0, 1.0))
    assert pol.choose(state(8, 99)) == best
    assert pol.choose(state(200, 100)) == best  # a new bucket climbs from the nearest bucket's leader


def test_bandit_explores_only_the_leaders_neighbours(ctx):
    """The climb and the exploration after it try k one step either side of the leader (or
    off, below the least k), never k = 6 or 8 where k = 3 leads."""
    ctx = policy_context(load_config("default"), ctx.cost)
    pol = BanditPolicy(ctx, epsilon=1)  # a large optimism bonus: explore as much as it allows
    ks = {s.k: s for s in pol.arms}
    assert [pol.arms[i].k for i in pol._neighbours[pol.arms.index(ks[3])]] == [2, 3, 4]
    assert [pol.arms[i].k for i in pol._neighbours[pol.arms.index(ks[1])]] == [0, 1, 2]
    chosen = []
    for step in range(400):  # reward: k = 3 best, falling away from it
        s = pol.choose(state(8, step))
        pol.observe(StepOutcome(0, step, s, 8, 0, 0, int(1000 - 100 * abs(s.k - 3)), 1.0, 0.0, 1.0))
        chosen.append(s.k)
    assert max(chosen) == 4
    assert {2, 4} <= set(chosen[100:]) <= {2, 3, 4}  # the leader's neighbours, after the climb


def test_calibrated_goodput_follows_measured_step_times(ctx):
    """Where drafting measures 30x what the cost model prices it, a calibrating goodput turns
    SD off; one that does not calibrate (the simulator's) keeps the priced choice."""
    from dataclasses import replace

    plain, live = make_draft_policy("goodput:1", ctx), make_draft_policy("goodput:1", replace(ctx, calibrate=True))
    assert not plain.observes and live.observes
    first, priced = live.choose(state(1)), plain.choose(state(1))
    assert first.k > 0 and abs(first.k - priced.k) <= 1  # (live may try a neighbour first: `_explore`)
    cost = ctx.cost
    for step in range(1, 30):
        s = live.choose(state(1, step))
        if s.is_off:
            break
        draft, verify = cost.draft_time(s.drafter, 1, s.k, 1000), cost.verify_time(1, s.k + 1, 1000)
        live.observe(StepOutcome(0, step, s, 1, s.k, 0, 1, 30 * draft + verify, 30 * draft, verify))
    assert live.choose(state(1, 31)) == OFF
    assert plain.choose(state(1, 31)) == priced


def test_goodput_prices_a_batch_once_per_context_band(ctx):
    """goodput caches the cost model's prices by batch and context a row (to within its
    ctx_tolerance): a drain meets the same batch sizes rollout after rollout, and the lookups
    were most of a decision's time. Another batch size or a context beyond the band is priced
    afresh, with the same numbers the cost model gives."""
    from dataclasses import replace

    calls = []

    class Counting(type(ctx.cost)):
        def verify_time(self, batch, q, ctx_tokens):
            calls.append((batch, ctx_tokens))
            return super().verify_time(batch, q, ctx_tokens)

    counting = Counting.__new__(Counting)
    counting.__dict__.update(ctx.cost.__dict__)
    pol = make_draft_policy("goodput:1", replace(ctx, cost=counting))
    for step in range(3):
        pol.choose(state(8, step, ctx_per_seq=1000))
    pol.choose(state(8, 3, ctx_per_seq=1010))  # within 5%: the same band
    assert calls == [(8, 8000)]
    pol.choose(state(9, 4, ctx_per_seq=1000))
    pol.choose(state(8, 5, ctx_per_seq=1200))
    assert calls[1:] == [(9, 9000), (8, 9600)]
    v1, vk, drafts = pol._prices(8, 9600)
    assert v1 == pytest.approx(ctx.cost.verify_time(8, 1, 9600))
    assert vk == pytest.approx(ctx.cost.verify_time(8, np.arange(2, pol.k_max + 2), 9600))
    # the policies of one cluster (one context) share the prices: another instance's policy
    # prices nothing afresh
    make_draft_policy("goodput:1", replace(ctx, cost=counting)).choose(state(8, 6, ctx_per_seq=1000))
    assert len(calls) == 3


def test_calibrated_goodput_does_not_price_drafting_by_a_catch_up_step(ctx):
    """A step whose drafter took in a prefill's worth of tokens (a row that joined, drafting
    back on after off steps) measures many times the priced drafting; folded, it would price
    the drafter out for good. Such steps (catch_up > 0) leave the drafter's scale alone."""
    from dataclasses import replace

    live = make_draft_policy("goodput:1", replace(ctx, calibrate=True))
    first = live.choose(state(1))
    assert first.k > 0
    draft, verify = ctx.cost.draft_time(first.drafter, 1, first.k, 1000), ctx.cost.verify_time(1, first.k + 1, 1000)
    for step in range(1, 6):  # every step caught up: 30x the drafting price each time
        live.observe(
            StepOutcome(0, step, first, 1, first.k, 0, 1, 30 * draft + verify, 30 * draft, verify, catch_up=200)
        )
        assert not live.choose(state(1, step + 1)).is_off and live._scale_at(first.drafter, 1) == 1.0
    s = first
    live.observe(StepOutcome(0, 6, s, 1, s.k, 0, 1, 30 * draft + verify, 30 * draft, verify))  # a steady one counts
    assert live._scale[s.drafter] > 1.5


def test_bandit_skips_a_catch_up_step(ctx):
    pol = BanditPolicy(policy_context(load_config("default"), ctx.cost), epsilon=0)
    s = pol.choose(state(8, 0))
    pol.observe(StepOutcome(0, 0, s, 8, 0, 0, 8, 1.0, 0.0, 1.0, catch_up=100))
    assert pol.choose(state(8, 1)) == s  # still untried: the catch-up step taught it nothing


def test_bandit_charges_off_steps_the_drafter_feed_they_defer(ctx):
    """Off emits 8 tokens in 1.0 s, k = 1 16 tokens in 1.9 s (rewards per row). A k = 1 step
    that caught up on 100 tokens took 2.9 s: 1.0 s beyond its rate, 10 ms a token; an off
    step is then charged 80 ms for its 8 tokens' deferred feed, as the smaller batch's bucket
    drafts (the drain will feed the drafter there)."""
    pol = BanditPolicy(policy_context(load_config("default"), ctx.cost), epsilon=0)
    off, k1 = OFF, Strategy("model", 1)

    def play(batch, plays):
        for step, (s, t, catch) in enumerate(plays):
            pol.choose(state(batch, step))  # (the arm it picks is replaced: the test plays these)
            pol._pending = (state(batch).batch.bit_length(), pol.arms.index(s))
            emitted = 2 * batch if s == k1 else batch
            pol.observe(StepOutcome(0, step, s, batch, 0, 0, emitted, t, 0.0, t, catch_up=catch))

    play(8, [(off, 1.0, 0), (k1, 1.9, 0), (k1, 2.9, 100), (off, 1.0, 0)])
    assert pol._feed == pytest.approx(1.0 / 100)
    stats = pol._stats[4]
    assert stats[0, 0] == 2 and stats[0, pol.arms.index(k1)] == 1  # the catch-up step was not counted
    assert stats[1, 0] == pytest.approx(1.0)  # no bucket below drafts yet: nothing deferred is paid
    play(4, [(k1, 1.0, 0), (k1, 1.0, 0), (off, 1.0, 0), (off, 1.0, 0)])  # the bucket below leads with k = 1
    play(8, [(off, 1.0, 0)])
    assert stats[0, 0] == 3 and stats[1, 0] == pytest.approx((2 + 1 / 1.08) / 3)


def test_analytic_table_drafts_more_at_small_batch(ctx):
    table = TablePolicy.analytic(ctx, "model")
    assert table.choose(state(1)).k > table.choose(state(256)).k


def test_table_with_context_buckets_drafts_once_contexts_are_long(ctx):
    """At one large batch, verification is compute-bound while contexts are short (SD off) and
    memory-bound once they are long (SD pays): a context axis lets a table follow that; the
    simulator's fast-forward stops where the context reaches the next bucket."""
    from dataclasses import replace

    big = replace(ctx, max_batch=1024)
    table = TablePolicy.analytic(big, "model", ctx_edges=[0, 512, 1024, 2048, 4096])
    assert table.choose(state(768, ctx_per_seq=300)) == OFF
    assert table.choose(state(768, ctx_per_seq=3000)).k >= 1
    s = state(768, ctx_per_seq=300)
    # 212 steps of one token per sequence bring 300 to 512: the 211 after this one are steady
    assert table.steady_steps(s, table.choose(s), max_growth=768) == 211
    # a file round trip keeps the axis; a table without one still loads (one context bucket)
    assert (
        TablePolicy(
            big,
            "model",
            table.batch_edges,
            table.accept_edges,
            table.params()["k"],
            ctx_edges=table.params()["ctx_edges"],
        ).params()
        == table.params()
    )
    flat = TablePolicy.analytic(big, "model")
    assert "ctx_edges" not in flat.params() and flat.steady_steps(s, flat.choose(s), 768) > 10**6


def test_oracle_needs_the_truth(cfg):
    with pytest.raises(UserError, match="only the simulator"):
        make_draft_policy("oracle", policy_context(cfg))


@pytest.mark.parametrize("policy", ["twostate", "bandit", "oracle"])
def test_adaptive_policies_run_in_the_simulator_deterministically(cfg, policy):
    a, b = simulate(cfg, policy).summary(), simulate(cfg, policy).summary()
    assert a == b and a["generation_s"] > 0


@pytest.mark.parametrize("gain, kept", [(MIN_GAIN / 3, False), (MIN_GAIN * 3, True)])
def test_learn_keeps_a_change_only_if_it_gains_enough(cfg, gain, kept):
    """Scored by an evaluator where every change from the analytic table gains `gain` and the
    uniform tables (one k in every cell) lose 2%: below MIN_GAIN (the learning seed's luck) the
    analytic table stands."""

    def uniform(k) -> bool:
        return len({c for plane in k for row in plane for c in row}) == 1

    def evaluate(jobs):
        ks = [load_policy_file(spec.split(":", 1)[1], config_identity(cfg)).params["k"] for _, spec, _ in jobs]
        return [102.0 if uniform(k) else 100.0 if k == analytic else 100.0 * (1 - gain) for k in ks]

    learner = Learner(cfg, [0], evaluate, log=lambda *_: None)
    ctx = learner.ctx
    analytic = TablePolicy.analytic(ctx, learner.drafter, ACCEPT_EDGES, ctx_edges(ctx.typical_ctx)).params()["k"]
    params, _ = learner.learn_table()
    assert (params["k"] != analytic) is kept


def test_learn_writes_a_policy_file_that_runs(cfg, tmp_path):
    learner = Learner(cfg, [0], log=lambda *_: None)
    pf, t = learner.learn("table")
    assert learner.evaluations > 1 and t > 0
    # context buckets sit around this workload's typical context per sequence
    assert (
        pf.params["ctx_edges"]
        == ctx_edges(learner.ctx.typical_ctx)
        == [0, *(round(learner.ctx.typical_ctx * 2 ** (i / 2)) for i in range(-2, 5))]
    )
    path = tmp_path / "p.json"
    save_policy_file(path, pf)
    assert load_policy_file(path, config_identity(cfg)).kind == "table"
    got = simulate(cfg, f"table:{path}").summary()["generation_s"]
    assert got == pytest.approx(t, rel=1e-9)  # the learned table reproduces its learning score
    ranges = vllm_table(pf, cfg.cluster.max_batch, 0.7)["num_speculative_tokens_per_batch_size"]
    assert ranges[0][0] == 1 and ranges[-1][1] == cfg.cluster.max_batch
    assert all(a[1] + 1 == b[0] for a, b in zip(ranges, ranges[1:]))
    scratch = learner._dir  # its candidate files go with it, not left in /tmp
    assert any(scratch.iterdir())
    del learner
    gc.collect()
    assert not scratch.exists()


def _write(tmp_path, data, name="bad.json"):
    p = tmp_path / name
    p.write_text(data if isinstance(data, str) else json.dumps(data))
    return p


@pytest.fixture
def good_file(cfg, tmp_path):
    learner = Learner(cfg, [0], evaluate=lambda jobs: [1.0] * len(jobs), log=lambda *_: None)
    pf, _ = learner.learn("table")
    return json.loads(pf.model_dump_json())


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: "{not json", "not valid JSON"),
        (lambda d: {**d, "format": "other"}, "not an rlsched policy file"),
        (lambda d: {**d, "version": 0}, "format version 0"),
        (lambda d: {**d, "learned_on": {**d["learned_on"], "model": "llama-3.1-8b"}}, "learned for"),
        (lambda d: {**d, "drafter": "eagle"}, "lacks"),
        (lambda d: {**d, "kind": "twostate"}, "twostate params"),
        (lambda d: {**d, "params": {**d["params"], "k": [[1]]}}, "params.k"),
    ],
)
def test_bad_policy_files_are_refused(cfg, tmp_path, good_file, mutate, message):
    path = _write(tmp_path, mutate(good_file))
    with pytest.raises(UserError, match=message):
        load_policy_file(path, config_identity(cfg), kinds=("table", "twostate"))


def test_bad_policy_file_through_the_cli(tmp_path, good_file):
    path = _write(tmp_path, {**good_file, "version": 99})
    out = tmp_path / "out"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlsched",
            "simulate",
            "--policy",
            f"table:{path}",
            "--out",
            str(out),
            "--set",
            "workload.prompts=8",
        ],
        capture_output=True,
        text=True,
        env={"COLUMNS": "400", "PATH": ""},
    )
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and "version 99" in r.stderr
    assert not out.exists()


def _cli(*args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "rlsched", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={"COLUMNS": "400", "PATH": ""},
    )


def test_learn_end_to_end(tmp_path):
    r = _cli(
        "learn",
        "--set",
        "workload.prompts=8",
        "--set",
        "rl.steps=1",
        "--out",
        "p.json",
        "--vllm-table",
        "v.json",
        "--json",
        "-j",
        "1",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["evaluations"] > 1
    ranges = json.loads((tmp_path / "v.json").read_text())["num_speculative_tokens_per_batch_size"]
    assert ranges[0][0] == 1
    sim = _cli(
        "simulate",
        "--set",
        "workload.prompts=8",
        "--set",
        "rl.steps=1",
        "--policy",
        "table:p.json",
        "--json",
        "--no-baseline",
        "--out",
        "o",
        cwd=tmp_path,
    )
    assert sim.returncode == 0, sim.stderr
    assert json.loads(sim.stdout)["generation_s"] == pytest.approx(summary["generation_s"], rel=1e-9)


@pytest.mark.parametrize(
    "args, field",
    [
        (["--kind", "tree"], "--kind"),
        (["--seeds", "0"], "--seeds"),
        (["--vllm-table", "v.txt"], "--vllm-table"),
        (["--set", "drafters=[]"], "drafter"),
    ],
)
def test_learn_bad_input(tmp_path, args, field):
    r = _cli("learn", "--out", "p.json", *args, cwd=tmp_path)
    assert r.returncode == 2 and field in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_per_sequence_drafting_gives_likely_sequences_longer_drafts():
    # a cheap drafter (an EAGLE head): a 0.5B model's forwards cost too much to draft ragged at 64 rows
    cfg = load_config("default", overrides=["workload.prompts=16", "rl.steps=1", "drafters.0.kind=eagle"])
    truth = np.linspace(0.3, 0.95, 64)
    ctx = policy_context(cfg, RooflineCostModel.from_config(cfg), lambda d, ids: truth[ids])
    pol = make_draft_policy("oracle:seq", ctx)
    s = pol.choose(state(64, ctx_per_seq=2000))
    assert s.k_per_row is not None and s.k_per_row.min() < s.k_per_row.max()
    assert (np.diff(s.k_per_row) >= 0).all()  # more likely, longer
    # better than every uniform k by the policy's own yardstick
    a, cost = truth, ctx.cost

    def rate(ks):
        return ((1 - a ** (ks + 1)) / (1 - a)).sum() / (
            cost.draft_time_per_row("model", ks, 128000) + cost.verify_time(64, 1 + ks.mean(), 128000)
        )

    assert all(rate(s.k_per_row) >= rate(np.full(64, k)) for k in range(1, 9))


def test_seqgoodput_runs_and_conserves_tokens(cfg):
    res = simulate(cfg, "seqgoodput")
    tl, samples = res.timeline_frame(), res.samples_frame()
    assert tl[tl.kind == "decode"].emitted.sum() == samples.response_len.sum()


def test_cached_choices_do_not_leak_into_the_next_rollout():
    over = [
        "cluster.instances=1",
        "workload.prompts=1",
        "workload.samples_per_prompt=1",
        "rl.steps=2",
        "workload.response_len={dist: fixed, value: 3000}",
        "drafters.0.acceptance.mean=0.93",
        "drafters.0.acceptance.prompt_concentration=null",
        "drafters.0.acceptance.sample_concentration=null",
        "rl.acceptance_drift_per_step=0.86",
        "rl.acceptance_floor=0.0",
    ]
    tl = simulate(load_config("default", overrides=over), "goodput").timeline_frame()
    second = tl[(tl.rl_step == 1) & (tl.kind == "decode")]
    assert (second.k >= 4).mean() < 0.05  # acceptance is 0.07 now: long drafts would be a stale choice


def _longest_off_run(ks) -> int:
    longest = run = 0
    for k in ks:
        run = run + 1 if k == 0 else 0
        longest = max(longest, run)
    return longest


@pytest.mark.parametrize("probe_every", [None, 16])
def test_the_simulator_probes_as_the_executor_does(probe_every):
    """Acceptance falls to 0.07 in the second RL step and goodput turns SD off. With
    speculation.probe_every the simulator drafts once after that many off steps in a row (k = 2,
    `policies/probe.py`, the executor's rule), runs of steps priced at once stopping short of
    each probe (the same steps as one at a time); without it, never."""
    over = [
        "cluster.instances=1",
        "workload.prompts=1",
        "workload.samples_per_prompt=1",
        "rl.steps=2",
        "workload.response_len={dist: fixed, value: 3000}",
        "drafters.0.acceptance.mean=0.93",
        "drafters.0.acceptance.prompt_concentration=null",
        "drafters.0.acceptance.sample_concentration=null",
        "rl.acceptance_drift_per_step=0.86",
        "rl.acceptance_floor=0.0",
        f"speculation.probe_every={'null' if probe_every is None else probe_every}",
    ]
    runs = {}
    for max_run in (1, 10_000):
        cfg = load_config("default", overrides=over + [f"max_steady_run={max_run}"])
        tl = simulate(cfg, "goodput").timeline_frame()
        second = tl[(tl.rl_step == 1) & (tl.kind == "decode")].sort_values("step")
        runs[max_run] = second.k.tolist()  # one row a step, runs priced at once included
    ks = runs[1]
    if probe_every is None:
        assert _longest_off_run(ks) > 500
    else:
        assert _longest_off_run(ks) == probe_every and ks.count(2) > 20
    assert runs[10_000] == ks


def test_learned_twostate_file_runs(cfg, tmp_path):
    learner = Learner(cfg, [0], evaluate=lambda jobs: [1.0] * len(jobs), log=lambda *_: None)
    pf, _ = learner.learn("twostate")
    path = tmp_path / "ts.json"
    save_policy_file(path, pf)
    res = simulate(cfg, f"twostate:{path}").summary()
    want = simulate(cfg, f"twostate:{pf.params['max_batch_on']}:{pf.params['k']}").summary()
    assert {**res, "policy": ""} == {**want, "policy": ""}


@pytest.mark.parametrize(
    "params",
    [
        {"batch_edges": [1, "x", 4]},
        {"accept_edges": [0, None, 1]},
        {"batch_edges": [1, 2.5]},
        {"k": [[True] * 9] * 7},
        {"ctx_edges": [5, 10, 20, 40, 80]},
        {"ctx_edges": [0, 512, 256, 1024, 2048]},
        {"ctx_edges": [0, 512]},  # two context buckets, but k has five
    ],
)
def test_policy_file_values_of_the_wrong_type_are_refused(cfg, tmp_path, good_file, params):
    path = _write(tmp_path, {**good_file, "params": {**good_file["params"], **params}})
    with pytest.raises(UserError, match="params"):
        load_policy_file(path, config_identity(cfg))
