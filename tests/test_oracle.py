"""The planning oracle: its fluid drain against closed forms, and its bound in the simulator."""

from __future__ import annotations

import numpy as np
import pytest

from rlsched.config import load_config
from rlsched.policies.fluid import drain_seconds, grid_of_batches, schedule
from rlsched.sim.simulate import simulate

GRID = grid_of_batches(64)


def test_grid_holds_every_small_batch_and_the_largest():
    assert GRID[:16].tolist() == list(range(1, 17)) and GRID[-1] == 64 and (np.diff(GRID) > 0).all()


def test_a_drain_without_a_queue_costs_each_batch_size_for_its_steps():
    finish = np.array([3.0, 1.0, 6.0])
    start, end = schedule(finish, np.zeros(0), 0)
    # 3 rows for 1 step, 2 rows for 2 steps, 1 row for 3 steps, at b seconds a step of b rows
    assert drain_seconds(start, end, GRID, GRID.copy()) == pytest.approx(3 * 1 + 2 * 2 + 1 * 3)
    # at one price a step, the drain takes as long as its longest row
    assert drain_seconds(start, end, GRID, np.full(len(GRID), 0.5)) == pytest.approx(3.0)
    assert drain_seconds(start, end, GRID, GRID.copy(), until=2.0) == pytest.approx(3 * 1 + 2 * 1)


def test_queued_rows_take_the_first_slot_that_frees():
    start, end = schedule(np.array([4.0, 2.0]), np.array([5.0, 1.0, 1.0]), 2)
    # slot of the 2-step row takes the first queued row (2..7); the 4-step row's slot the next (4..5), then (5..6)
    assert start.tolist() == [0, 0, 2, 4, 5] and end.tolist() == [4, 2, 7, 5, 6]
    # two rows run until step 6, one from 6 to 7: 6 steps of 2 rows and 1 of 1 row, at b seconds a step
    assert drain_seconds(start, end, GRID, GRID.copy()) == pytest.approx(6 * 2 + 1 * 1)


SMALL = ["rl.steps=1", "workload.prompts=16", "cluster.instances=1"]


def test_planning_beats_the_per_step_oracle_where_a_static_k_beats_that_one():
    """On this drain (seed 0) the per-step oracle, which knows every row's acceptance but prices
    one step at a time, loses to static k = 1 and k = 2; the oracle that plans the drain does
    not lose to any fixed setting, plain decoding included."""
    cfg = load_config("default", overrides=SMALL).model_copy(update={"seed": 0})
    gen = {
        p: simulate(cfg, p).summary()["generation_s"]
        for p in ("off", "static:1", "static:2", "static:3", "static:4", "plugin:rlsched.policies.oracle.greedy_oracle")
    }
    greedy = gen.pop("plugin:rlsched.policies.oracle.greedy_oracle")
    assert greedy > min(gen.values())
    assert simulate(cfg, "oracle").summary()["generation_s"] <= min(gen.values())


def test_the_oracle_stays_off_where_no_draft_length_pays():
    cfg = load_config("low-acceptance", overrides=[*SMALL, "workload.samples_per_prompt=8"])
    result = simulate(cfg, "oracle")
    s = result.summary()
    assert s["generation_s"] <= 1.001 * simulate(cfg, "off").summary()["generation_s"]
    assert s["generation_s"] < simulate(cfg, "static:1").summary()["generation_s"]


EVERY_POLICY = ("off", "static:1", "static:2", "static:4", "goodput", "goodput:drain", "seqgoodput")
EVERY_POLICY += ("twostate", "bandit")


@pytest.mark.parametrize(
    "preset, extra",
    [("default", []), ("ngram-llama8b", []), ("respec-qwen2.5-7b", ["cluster.instances=2", "workload.prompts=8"])],
)
def test_no_policy_runs_faster_than_the_oracle(preset, extra):
    """Small drains of a draft model, two drafters (one of them n-gram) and an EAGLE head with
    trees: every policy, fixed or adaptive, at or below the oracle."""
    cfg = load_config(preset, overrides=[*SMALL, *extra])
    bound = simulate(cfg, "oracle").summary()["generation_s"]
    slower = {p: simulate(cfg, p).summary()["generation_s"] / bound for p in EVERY_POLICY}
    assert min(slower.values()) >= 1.0, slower
