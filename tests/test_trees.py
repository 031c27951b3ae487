"""Draft trees: shapes, the acceptance model's closed forms, the simulator's draws against them,
and the policies that choose trees."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from scipy import stats
from support import rlsched

from rlsched.config import load_config
from rlsched.costs.roofline import RooflineCostModel
from rlsched.errors import UserError
from rlsched.policies import AcceptanceEstimator, EngineState, PolicyContext, Strategy, make_draft_policy
from rlsched.policies.lookup import TablePolicy
from rlsched.policies.policyfile import FORMAT, VERSION, PolicyFile, save_policy_file
from rlsched.policies.registry import GENERATE, parse_policy, run_words
from rlsched.policies.tree import GRID, TreeTable, draw_tree, max_nodes, rank_probs, tree_options, tree_shape
from rlsched.sim.learn import ACCEPT_EDGES, Learner, ctx_edges
from rlsched.sim.simulate import policy_context, simulate

GAIN = 0.25


def brute_force_tree(k, width, nodes, a, gain):
    """Every path up to k deep and width wide with its probability; the `nodes` likeliest."""
    p = rank_probs(a, gain, width)
    paths = [path for d in range(1, k + 1) for path in itertools.product(range(1, width + 1), repeat=d)]
    probs = {path: float(np.prod([p[r - 1] for r in path])) for path in paths}
    return sorted(paths, key=lambda q: -probs[q])[:nodes], probs


def test_a_chain_is_the_tree_of_width_one():
    a = np.array([0.3, 0.7, 0.95])
    shape = tree_shape(5, 1, 5, 0.7, GAIN)
    np.testing.assert_allclose(shape.reach(a, GAIN), a[:, None] ** np.arange(1, 6), rtol=1e-12)
    np.testing.assert_allclose(shape.expected_accepted(a, GAIN), (a - a**6) / (1 - a), rtol=1e-12)


def test_two_candidates_at_one_level():
    a = np.array([0.4, 0.8])
    shape = tree_shape(1, 2, 2, 0.7, GAIN)
    np.testing.assert_allclose(shape.reach(a, GAIN)[:, 0], a + (1 - a) * GAIN, rtol=1e-12)


@pytest.mark.parametrize("k,width,nodes,a", [(4, 2, 10, 0.7), (3, 4, 12, 0.6), (6, 4, 24, 0.8), (2, 8, 9, 0.5)])
def test_the_shape_is_the_likeliest_paths_and_its_expectation_their_sum(k, width, nodes, a):
    shape = tree_shape(k, width, nodes, a, GAIN)
    best, probs = brute_force_tree(k, width, nodes, a, GAIN)
    got = shape.node_probs(np.array([a]), GAIN)[0]
    np.testing.assert_allclose(np.sort(got)[::-1], [probs[q] for q in best], rtol=1e-9)
    assert shape.nodes == nodes and shape.depth.max() <= k
    # P(accepted >= d) is the mass of the depth-d nodes; the expectation their sum
    for d in range(1, k + 1):
        assert shape.reach(np.array([a]), GAIN)[0, d - 1] == pytest.approx(
            sum(probs[q] for q in best if len(q) == d), rel=1e-9
        )


@pytest.mark.parametrize("k,width,nodes,a", [(4, 2, 10, 0.7), (6, 4, 24, 0.55)])
def test_drawn_accepted_lengths_follow_the_model(k, width, nodes, a):
    shape = tree_shape(k, width, nodes, 0.7, GAIN)
    rows = 200_000
    rng = np.random.default_rng(1)
    acc, hits, misses = draw_tree(shape, np.full(rows, a), GAIN, rng.random((k, rows)))
    reach = shape.reach(np.array([a]), GAIN)[0]
    expected = -np.diff(np.concatenate(([1.0], reach, [0.0])))  # P(accepted = 0..k)
    observed = np.bincount(acc, minlength=k + 1)
    assert stats.chisquare(observed, expected * rows).pvalue > 1e-3
    # the rank-1 trials the walk shows are Bernoulli(a): a chain's estimate stays unbiased
    n = int(hits.sum() + misses.sum())
    assert stats.binomtest(int(hits.sum()), n, a).pvalue > 1e-3


def test_a_broken_draw_fails_the_same_check():
    """The chi-square above has power: independent candidates (gain = a) are rejected."""
    k, width, nodes, a = 4, 2, 10, 0.7
    shape = tree_shape(k, width, nodes, 0.7, GAIN)
    rows = 200_000
    acc, _, _ = draw_tree(shape, np.full(rows, a), a, np.random.default_rng(1).random((k, rows)))
    expected = -np.diff(np.concatenate(([1.0], shape.reach(np.array([a]), GAIN)[0], [0.0])))
    assert stats.chisquare(np.bincount(acc, minlength=k + 1), expected * rows).pvalue < 1e-6


@pytest.mark.parametrize("top1", [1.0, 0.8])
def test_the_simulator_emits_what_the_model_expects(top1):
    over = [
        "workload.prompts=8",
        "workload.samples_per_prompt=4",
        "workload.prompt_len={dist: fixed, value: 64}",
        "workload.response_len={dist: fixed, value: 6000}",
        "drafters.0.acceptance.mean=0.65",
        "drafters.0.acceptance.prompt_concentration=null",
        "drafters.0.acceptance.sample_concentration=null",
        "cluster.instances=1",
        "drafters.0.acceptance.tree_gain=0.3",
        "rl.steps=1",
        f"drafters.0.acceptance.tree_top1={top1}",
    ]
    cfg = load_config("default", overrides=over)
    tl = simulate(cfg, "tree:5:2:12").timeline_frame()
    dec = tl[(tl.kind == "decode") & (tl.batch == 32)]
    per_row = (dec.emitted - dec.batch).sum() / dec.batch.sum()
    a = 0.65 * top1  # the rank-1 child's rate
    shape = tree_shape(5, 2, 12, round(a, 3), 0.3)
    want = shape.expected_accepted(np.array([a]), 0.3)[0]
    # (rows finishing mid-step emit less: the last steps of a 6000-token answer, well inside the tolerance)
    assert per_row == pytest.approx(want, rel=0.02)
    assert (dec.width == 2).all() and (dec.drafted == 12 * dec.batch).all()


def test_tree_options_and_the_table():
    opts = tree_options(4, 4, 16)
    assert all(k < n <= min(16, max_nodes(k, w)) and w in (2, 4) for k, w, n in opts)
    assert (1, 2, 2) in opts and (4, 4, 16) in opts and not any(w == 8 for _, w, _ in opts)
    table = TreeTable(opts, 0.7, GAIN)
    a = np.array([0.25, 0.5, 0.5, 0.75])  # on the grid: the table is exact there
    want = np.array([4 + shape.expected_accepted(a, GAIN).sum() for shape in table.shapes])
    np.testing.assert_allclose(table.tokens(a), want, rtol=1e-12)
    assert len(GRID) == 257


def _state(batch, ctx_per_seq=1000, prior=0.8):
    est = AcceptanceEstimator(["model"], prior_mean=prior)
    est.begin_rollout(batch, np.arange(batch))
    ids = np.arange(batch)
    return EngineState(0, 0, 0.0, ids, np.full(batch, ctx_per_seq), batch * ctx_per_seq, 0, 10**6, est)


def test_goodput_chooses_trees_at_small_batch_and_drops_them_at_large():
    over = [
        "drafters.0.kind=eagle",
        "drafters.0.acceptance.mean=0.8",
        "speculation.width_max=8",
        "speculation.nodes_max=64",
        "cluster.max_batch=1024",
    ]
    cfg = load_config("default", overrides=over)
    ctx = policy_context(cfg, RooflineCostModel.from_config(cfg))
    small = make_draft_policy("goodput", ctx).choose(_state(1))
    large = make_draft_policy("goodput", ctx).choose(_state(512))
    assert small.is_tree and small.nodes > small.k
    assert not large.is_tree
    # with trees off the same policy drafts chains only
    chains = policy_context(load_config("default", overrides=over[:2]), ctx.cost)
    assert not make_draft_policy("goodput", chains).choose(_state(1)).is_tree


def test_fixed_tree_spelling():
    p = parse_policy("tree:6:4:24")
    assert (p.k, p.width, p.nodes, p.drafter) == (6, 4, 24, None)
    assert Strategy("model", 6, 4, 24).label == "model:6x4:24"
    for bad, word in [
        ("tree:6:4", "expected tree:K:W:N"),
        ("tree:6:1:8", "W \\(candidates"),
        ("tree:2:2:9", "at most 6"),
        ("tree:6:4:3", "N \\(drafts"),
    ]:
        with pytest.raises(UserError, match=word):
            parse_policy(bad)
    parse_policy("tree:3:2:6").check(("model",), 8, GENERATE)  # rlsched's engine verifies trees
    with pytest.raises(UserError, match="N = 6 drafts a row is above --k-max = 4"):
        parse_policy("tree:3:2:6").check(("model",), 4, GENERATE)  # the cache's room a step
    with pytest.raises(UserError, match="drafts a tree; the vllm engine drafts chains"):
        parse_policy("tree:3:2:6").check(("model",), 8, run_words("vllm"))


def test_a_learned_table_holds_trees_where_they_pay(tmp_path):
    cfg = load_config("respec-qwen2.5-7b")
    ctx = policy_context(cfg, RooflineCostModel.from_config(cfg))
    table = TablePolicy.analytic(ctx, "eagle", ACCEPT_EDGES, ctx_edges(ctx.typical_ctx))
    row = table.params()["k"][table._row(0.65)][2]  # acceptance 0.6-0.7, a middle context
    assert isinstance(row[0], list) and row[0][1] > 1  # a tree at batch 1
    assert not isinstance(row[-1], list)  # a chain or off at the largest batch
    # the file round-trips, and an engine that drafts chains refuses it in one line
    learner = Learner(load_config("respec-qwen2.5-7b", overrides=["workload.prompts=4"]), [0], None)
    path = tmp_path / "p.json"
    save_policy_file(path, learner._policy_file("table", table.params()))
    assert make_draft_policy(f"table:{path}", ctx).choose(_state_eagle(1)).is_tree
    chains = PolicyContext(cost=ctx.cost, drafters=("eagle",), identity=ctx.identity)
    with pytest.raises(UserError, match="drafts trees 8 wide; this engine drafts chains"):
        make_draft_policy(f"table:{path}", chains)
    # a coordinate pass tries a tree one level shallower and deeper
    assert learner._neighbours([3, 8, 24]) == [[2, 8, 24], [4, 8, 24]]
    assert learner._neighbours([1, 2, 2]) == [[2, 2, 2]] and learner._neighbours(0) == [1]


def test_a_tree_cell_is_checked_in_a_policy_file():
    params = {"batch_edges": [1, 2], "accept_edges": [0.0, 1.0], "k": [[[3, 1, 5], 2]]}
    with pytest.raises(ValueError, match=r"\[k, width, nodes\]"):
        PolicyFile(format=FORMAT, version=VERSION, kind="table", drafter="eagle", params=params)
    PolicyFile(format=FORMAT, version=VERSION, kind="table", drafter="eagle", params={**params, "k": [[[3, 2, 5], 2]]})


def test_learn_refuses_a_vllm_table_for_a_tree_policy(tmp_path):
    proc = rlsched("learn", "-p", "respec-qwen2.5-7b", "--out", "p.json", "--vllm-table", "v.json", cwd=tmp_path)
    assert proc.returncode == 2 and "speculation.width_max=1" in proc.stderr
    assert not (tmp_path / "p.json").exists() and not (tmp_path / "v.json").exists()


def _state_eagle(batch):
    est = AcceptanceEstimator(["eagle"], prior_mean=0.65)
    est.begin_rollout(batch, np.arange(batch))
    return EngineState(0, 0, 0.0, np.arange(batch), np.full(batch, 700), batch * 700, 0, 10**6, est)
