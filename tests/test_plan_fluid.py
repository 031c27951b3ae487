"""The fluid estimate of a generation stage (`rlsched/plan/fluid.py`) against the simulator
on the same rollout: the first RL step's generation time, chains, no reallocation."""

from __future__ import annotations

import numpy as np
import pytest

from rlsched.config import load_config
from rlsched.costs.choose import cost_model_for
from rlsched.plan.fluid import expected_tokens_per_row, stage_time
from rlsched.sim.simulate import simulate

CASES = {
    "default": ["rl.steps=1"],
    "default-queued": ["rl.steps=1", "cluster.max_batch=64"],  # rows wait for a slot
    "respec-qwen2.5-7b": ["rl.steps=1", "speculation.width_max=1"],
    # 171 rows an instance queue for 64 slots: the slowest instance is the one whose long rows join late
    "respec-qwen2.5-7b-queued": [
        "rl.steps=1",
        "speculation.width_max=1",
        "cluster.instances=6",
        "cluster.max_batch=64",
    ],
}


@pytest.mark.parametrize("policy", ["off", "static:3", "goodput", "twostate"])
@pytest.mark.parametrize("case", list(CASES))
def test_fluid_stage_time_is_the_simulators_within_two_percent(case, policy):
    cfg = load_config(preset=case.removesuffix("-queued"), overrides=CASES[case] + ["record_timeline=false"])
    cost = cost_model_for(cfg)
    fluid = stage_time(cfg, policy, cost)
    sim = simulate(cfg, policy=policy, realloc="none").summary()
    assert fluid.tokens == sim["response_tokens"]  # the same rows
    assert fluid.seconds == pytest.approx(sim["generation_s"], rel=0.02)
    assert fluid.balanced_s <= fluid.seconds


def test_expected_tokens_per_row_is_the_chain_closed_form():
    a = np.array([0.0, 0.5, 0.9])
    e = expected_tokens_per_row(a, 3)
    assert e[:, 0].tolist() == [1.0, 1.0, 1.0]  # k = 0: plain decoding
    assert e[1].tolist() == pytest.approx([1.0, 1.5, 1.75, 1.875])  # 1 + a + a^2 + ... + a^k
    assert e[0].tolist() == pytest.approx([1.0] * 4)  # nothing accepted: the bonus token alone


def test_trees_are_priced_where_the_config_allows_them():
    """respec-qwen2.5-7b as written: goodput over chains and trees up to 8 wide; the fluid
    stage is within 3% of the simulator's and faster than chains alone."""
    cfg = load_config(preset="respec-qwen2.5-7b", overrides=["rl.steps=1", "record_timeline=false"])
    cost = cost_model_for(cfg)
    trees = stage_time(cfg, "goodput", cost)
    sim = simulate(cfg, policy="goodput", realloc="none").summary()
    assert trees.seconds == pytest.approx(sim["generation_s"], rel=0.03)
    chains = cfg.model_copy(update={"speculation": cfg.speculation.model_copy(update={"width_max": 1})})
    assert trees.seconds < stage_time(chains, "goodput", cost).seconds
