"""Which setups a planner drops, and the one line that says why (`rlsched/plan/feasible.py`)."""

from __future__ import annotations

import pytest

from rlsched.config import load_config
from rlsched.plan.feasible import MEMORY_MAX, infeasible, longest_sequence, rollout_memory, training_gib
from rlsched.sim.simulate import simulate


@pytest.mark.parametrize("preset", ["default", "respec-qwen2.5-7b", "eagle-h200-14b", "ngram-llama8b"])
def test_the_presets_as_written_are_feasible(preset):
    assert infeasible(load_config(preset=preset)) is None


@pytest.mark.parametrize(
    "preset, sets, reason",
    [
        (
            "respec-qwen2.5-7b",
            ["cluster.tp=8"],
            "the model qwen2.5-7b has 28 attention heads, which tp 8 does not divide",
        ),
        (
            "default",
            ["model=llama-3.1-70b", "cluster.tp=4"],
            "drafter model qwen2.5-0.5b has 14 attention heads, which tp 4 does not divide",
        ),
        ("default", ["model=llama-3.1-70b"], "leave no room for KV on tp 1 x h100-sxm at gpu_memory_utilization 0.9"),
        ("default", ["workload.response_len={dist: fixed, value: 2000000}"], "fewer than the longest sequence needs"),
        # 7.6B parameters at 16 bytes on one GPU: 113.5 GiB of states, with the 2 GiB reserve
        (
            "sd-batch-sweep",
            [],
            "training's states need 115.5 GiB a GPU on 1 x h100-sxm (80 GiB): give training more GPUs",
        ),
        ("respec-qwen2.5-7b", ["rl.train_gpus=1"], "training's states need 115.5 GiB a GPU on 1 x h100-sxm"),
    ],
)
def test_an_infeasible_setup_says_why(preset, sets, reason):
    cfg = load_config(preset=preset, overrides=sets)
    got = infeasible(cfg)
    assert got is not None and reason in got and "\n" not in got


def test_the_kv_line_is_where_the_simulator_refuses():
    """Capacity just above and just below what the longest sequence needs: the planner drops
    the setup exactly when the simulator would refuse it."""
    base = load_config(
        preset="default",
        overrides=[
            "rl.steps=1",
            "record_timeline=false",
            "workload.prompts=4",
            "workload.samples_per_prompt=2",
            "workload.prompt_len={dist: fixed, value: 100}",
            "workload.response_len={dist: fixed, value: 400}",
        ],
    )
    need = longest_sequence(base)
    assert need == 500
    for capacity, ok in ((need + need // 99 + 2, True), (need + 2, False)):
        cfg = load_config(
            preset="default",
            overrides=[
                "rl.steps=1",
                "record_timeline=false",
                "workload.prompts=4",
                "workload.samples_per_prompt=2",
                "workload.prompt_len={dist: fixed, value: 100}",
                "workload.response_len={dist: fixed, value: 400}",
                f"cluster.kv_capacity_tokens={capacity}",
            ],
        )
        assert (infeasible(cfg) is None) == ok, capacity
        if ok:
            simulate(cfg)
        else:
            with pytest.raises(Exception, match="KV tokens"):
                simulate(cfg)


def test_a_colocated_rollout_gets_the_memory_training_leaves():
    cfg = load_config(preset="respec-qwen2.5-7b")
    assert training_gib(cfg, 16) == pytest.approx(16 * cfg.model.params / 16 / 2**30)
    # 80 GiB less 7.1 GiB of states and the 2 GiB reserve: 0.886, to 0.88
    assert rollout_memory(cfg, 16, None) == 0.88
    assert rollout_memory(cfg, 8, None) == pytest.approx(int(100 * (1 - (2 * training_gib(cfg, 16) + 2) / 80)) / 100)
    assert rollout_memory(cfg, 12, 4) == MEMORY_MAX  # GPUs of its own: all it may take
