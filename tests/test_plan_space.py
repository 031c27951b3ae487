"""The planner's candidates (`plan/space.py`), its screen (`plan/screen.py`) and its search
(`plan/search.py`)."""

from __future__ import annotations

import pytest

from rlsched.config import load_config
from rlsched.costs.choose import cost_model_for
from rlsched.plan.feasible import rollout_memory
from rlsched.plan.fluid import stage_time
from rlsched.plan.screen import score, screen
from rlsched.plan.search import search
from rlsched.plan.space import Candidate, Space, candidates, from_config, placements, to_config
from rlsched.policies.registry import parse_policy
from rlsched.sim.rlstep import StageCosts
from rlsched.sim.simulate import simulate


@pytest.fixture(scope="module")
def base():
    return load_config(preset="respec-qwen2.5-7b", overrides=["rl.steps=1", "record_timeline=false"])


def test_placements_are_whole_gpus():
    assert placements(Space(16)) == [(16, None), (8, None), (12, 4)]
    assert placements(Space(2)) == [(2, None), (1, None)]  # a quarter of 2 GPUs is no whole GPU
    assert placements(Space(1, colocated=(1.0, 0.5))) == [(1, None)]


def test_candidates_cover_the_space(base):
    space = Space(
        16,
        tps=(1, 8),
        max_batches=(64, 256),
        static_ks=(2, 4, 12),
        reallocs=("none", "rebalance"),
        colocated=(1.0,),
        split=(),
    )
    cs = candidates(base, space)
    # off, static:2, static:4 (12 is above k_max 8), goodput over chains, over trees, twostate; realloc for
    # all but static, only where there are instances to move rows between (tp 8: 2 instances; tp 1: 16)
    per_batch = 2 * 1 + 2 + 3 * 2
    assert len(cs) == 2 * 2 * per_batch and len(set(cs)) == len(cs)
    assert all(c.gpus == 16 and c.memory == rollout_memory(base, 16, None) for c in cs)
    assert {c.policy.text for c in cs} == {"off", "goodput", "twostate", "static:2:eagle", "static:4:eagle"}
    assert {c.width_max for c in cs if c.policy.text == "goodput"} == {1, 8}
    assert not any(c.realloc != "none" for c in cs if c.policy.family == "static")
    assert {c.tp for c in candidates(base, Space(6, tps=(1, 4)))} == {1}  # tp 4 divides no placement of 6 GPUs
    with pytest.raises(ValueError, match="gpus must be >= 1"):
        candidates(base, Space(0))


def test_a_candidates_config_is_the_base_with_its_setup(base):
    c = next(
        c
        for c in candidates(base, Space(16))
        if c.train_gpus == 4
        and c.tp == 2
        and c.max_batch == 256
        and c.policy.text == "goodput"
        and c.width_max == 1
        and c.realloc == "rebalance"
    )
    cfg = to_config(base, c)
    assert (cfg.cluster.tp, cfg.cluster.instances, cfg.cluster.max_batch) == (2, 6, 256)
    assert cfg.cluster.gpu_memory_utilization == 0.9 and cfg.cluster.realloc == "rebalance"
    assert cfg.rl.train_gpus == 4 and c.gpus == 16 and c.placement == "split 12+4"
    assert [d.name for d in cfg.drafters] == ["eagle"] and cfg.speculation.width_max == 1
    assert cfg.workload == base.workload and cfg.model == base.model
    assert from_config(cfg) == c
    off = to_config(base, next(c for c in candidates(base, Space(16)) if c.policy.text == "off"))
    assert off.drafters == []


def test_training_on_its_own_gpus_is_priced_on_them(base):
    cfg = to_config(base, from_config(base))
    split = cfg.model_copy(update={"rl": cfg.rl.model_copy(update={"train_gpus": 4})})
    assert StageCosts(split).training(1000) == pytest.approx(4 * StageCosts(cfg).training(1000))
    a, b = (simulate(c, realloc="none").records[0] for c in (cfg, split))
    assert b.training_s == pytest.approx(4 * a.training_s) and b.generation_s == pytest.approx(a.generation_s)


def test_the_screen_ranks_feasible_setups_and_says_why_it_drops_the_rest(base):
    cs = candidates(base, Space(16, tps=(2, 8), max_batches=(128,), static_ks=(3,), colocated=(1.0,), split=()))
    scored, dropped = screen(base, cs)
    assert {d.candidate.tp for d in dropped} == {8} and all("tp 8 does not divide" in d.reason for d in dropped)
    assert [s.score for s in scored] == sorted(s.score for s in scored)
    assert len(scored) + len(dropped) == len(cs)
    best = scored[0]
    # the screen's step prices are shared across setups, memoised to within 1% of context a row
    alone = stage_time(best.config, best.candidate.policy, cost_model_for(best.config)).seconds
    assert best.generation_s == pytest.approx(alone, rel=1e-3)
    # the step adds inference and training over every prompt and response token
    costs = StageCosts(best.config)
    other = best.step_s - best.generation_s
    assert other > costs.training(best.tokens)
    assert scored[-1].candidate.policy.text == "off"  # with this head, drafting beats plain decoding at every setup
    per_gpu, _ = screen(base, cs, "tokens-per-gpu-s")
    assert per_gpu[0].score == pytest.approx(per_gpu[0].step_s * 16 / per_gpu[0].tokens)
    with pytest.raises(ValueError, match="objective must be one of step-time, tokens-per-gpu-s"):
        score("fastest", 1.0, 1, 1)


def test_successive_halving_keeps_the_better_half_and_runs_the_pinned_on_every_seed(base):
    cs = candidates(
        base, Space(16, tps=(2, 4), max_batches=(1024,), static_ks=(2,), reallocs=("none",), colocated=(1.0,), split=())
    )
    scored, _ = screen(base, cs)
    off = next(s for s in scored if s.candidate.policy.text == "off")
    result = search(scored, survivors=4, seeds=[0, 1, 2], pinned=[off])
    raced = [x for x in result.ranked if x is not result.pinned[0]]
    assert [len(x.runs) for x in raced] == [3, 2, 1, 1]  # 4 -> 2 -> 1: the last has run every seed
    assert result.simulations == 4 + 2 + 1 + 3  # and the pinned off on each seed
    assert len(result.pinned[0].runs) == 3 and [r["seed"] for r in result.pinned[0].runs] == [0, 1, 2]
    assert result.ranked.index(result.pinned[0]) == 1  # with every seed run, ranked by its mean: off is slower
    first = result.ranked[0]
    again = simulate(first.scored.config.model_copy(update={"seed": 1}), realloc="none").summary()
    assert first.runs[1]["step_s"] == pytest.approx(again["rl_step_s"])  # the record of seed 1 is seed 1's run
    # each round's survivors are the better half by their mean over the seeds they ran
    second = raced[1]
    assert first.mean("step_s") <= second.mean("step_s") or len(first.runs) > len(second.runs)
    assert first.mean("step_s") < result.pinned[0].mean("step_s")


def test_offloading_trades_training_time_for_rollout_memory():
    base = load_config(preset="default", overrides=["rl.steps=1", "record_timeline=false"])
    own = from_config(base)  # 0.9 on 2 GPUs: more than a 7B's training states leave, so read as offloaded
    assert own.offload and own.memory == 0.9 and rollout_memory(base, 2, None) < 0.9 - 0.1
    cs = candidates(base, Space(2, tps=(1,), max_batches=(256,), static_ks=(), reallocs=("none",), colocated=(1.0,)))
    assert {(c.memory, c.offload) for c in cs} == {(rollout_memory(base, 2, None), False), (0.9, True)}
    resident = to_config(base, next(c for c in cs if not c.offload and c.policy.text == "off"))
    offloaded = to_config(base, next(c for c in cs if c.offload and c.policy.text == "off"))
    # 16 bytes a parameter over 2 GPUs, out and back over the host link
    moved = 2 * 16 * base.model.params / 2 / (base.hardware.host_link_gbs * 1e9)
    assert StageCosts(offloaded).training(1000) - StageCosts(resident).training(1000) == pytest.approx(moved)
    a, b = (simulate(c, realloc="none").records[0] for c in (resident, offloaded))
    assert b.training_s - a.training_s == pytest.approx(moved)
    assert b.generation_s < a.generation_s  # the KV it gains: a 0.26 fraction of a GPU holds few rows


def test_both_drafter_update_schedules_are_tried_where_the_workload_updates_its_drafter():
    base = load_config(preset="default", overrides=["record_timeline=false"])  # 3 RL steps, an update every 2
    cs = candidates(base, Space(2, tps=(1,), max_batches=(256,), static_ks=(2,), reallocs=("none",), colocated=(1.0,)))
    assert {c.update_schedule for c in cs if c.drafter is not None} == {"every", "pays"}
    assert {c.update_schedule for c in cs if c.drafter is None} == {None}
    pays = next(c for c in cs if c.update_schedule == "pays")
    assert to_config(base, pays).rl.drafter_update_schedule == "pays" and from_config(to_config(base, pays)) == pays
    one_step = load_config(preset="default", overrides=["rl.steps=1"])
    assert {c.update_schedule for c in candidates(one_step, Space(2, tps=(1,)))} == {None}


def test_a_knob_moves_alone_unless_it_cannot():
    from rlsched.plan.planner import with_knob

    base = load_config(preset="respec-qwen2.5-7b", overrides=["rl.steps=1"])
    own = from_config(base)  # tp 2 x 8
    win = Candidate(4, 4, 256, 0.88, parse_policy("static:2:eagle"), "eagle")
    assert with_knob(own, win, "tp") == Candidate(**{**own.__dict__, "tp": 4, "instances": 4})
    assert with_knob(own, win, "policy").policy.text == "static:2:eagle" and with_knob(own, win, "realloc") is None
    off = parse_policy("off")
    assert with_knob(own, Candidate(3, 5, 256, 0.88, off, None), "tp") is None  # tp 3 does not divide 16
    # learned for tp 8: not for the own setup's
    table = Candidate(8, 2, 256, 0.8, parse_policy("table:/tmp/p.json"), "eagle")
    assert with_knob(own, table, "policy") is None
