"""The fluid estimate of a generation stage (`rlsched/plan/fluid.py`) against the simulator
on the same rollout: the first RL step's generation time, chains, no reallocation."""

from __future__ import annotations

import numpy as np
import pytest

from rlsched.config import load_config
from rlsched.costs.choose import cost_model_for
from rlsched.plan.fluid import expected_tokens_per_row, stage_time
from rlsched.sim.simulate import simulate

CASES = {"default": ["rl.steps=1"],
         "default-queued": ["rl.steps=1", "cluster.max_batch=64"],  # rows wait for a slot
         "respec-qwen2.5-7b": ["rl.steps=1", "speculation.width_max=1"]}


@pytest.mark.parametrize("policy", ["off", "static:3", "goodput"])
@pytest.mark.parametrize("case", list(CASES))
def test_fluid_stage_time_is_the_simulators_within_two_percent(case, policy):
    cfg = load_config(preset=case.removesuffix("-queued"), overrides=CASES[case] + ["record_timeline=false"])
    cost = cost_model_for(cfg)
    fluid = stage_time(cfg, policy, cost)
    sim = simulate(cfg, policy=policy, realloc="none").summary()
    assert fluid.tokens == sim["response_tokens"]  # the same rows
    assert fluid.seconds == pytest.approx(sim["generation_s"], rel=0.02)
    assert fluid.seconds == fluid.per_instance.max() and len(fluid.per_instance) == cfg.cluster.instances


def test_expected_tokens_per_row_is_the_chain_closed_form():
    a = np.array([0.0, 0.5, 0.9])
    e = expected_tokens_per_row(a, 3)
    assert e[:, 0].tolist() == [1.0, 1.0, 1.0]  # k = 0: plain decoding
    assert e[1].tolist() == pytest.approx([1.0, 1.5, 1.75, 1.875])  # 1 + a + a^2 + ... + a^k
    assert e[0].tolist() == pytest.approx([1.0] * 4)  # nothing accepted: the bonus token alone


def test_an_unknown_policy_is_refused():
    cfg = load_config(preset="default", overrides=["rl.steps=1"])
    with pytest.raises(ValueError, match="not 'bandit'"):
        stage_time(cfg, "bandit", cost_model_for(cfg))
