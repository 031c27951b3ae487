"""The planner's candidates (`plan/space.py`) and its screen (`plan/screen.py`)."""

from __future__ import annotations

import pytest

from rlsched.config import load_config
from rlsched.costs.choose import cost_model_for
from rlsched.plan.fluid import stage_time
from rlsched.plan.screen import screen
from rlsched.plan.space import Space, candidates, to_config


@pytest.fixture(scope="module")
def base():
    return load_config(preset="respec-qwen2.5-7b", overrides=["rl.steps=1", "record_timeline=false"])


def test_candidates_cover_the_space_on_every_gpu(base):
    cs = candidates(base, Space(16, tps=(1, 2, 8), max_batches=(64, 256), static_ks=(2, 4, 12)))
    k_max = base.speculation.k_max
    per_point = 1 + len(base.drafters) * (len([k for k in (2, 4, 12) if k <= k_max]) + 1)  # off, static:K, goodput
    assert len(cs) == 3 * 2 * per_point and len(set(cs)) == len(cs)
    assert all(c.gpus == 16 for c in cs)
    assert {c.policy for c in cs} == {"off", "goodput"} | {f"static:{k}:eagle" for k in (2, 4, 12) if k <= k_max}
    assert candidates(base, Space(6, tps=(1, 4)))[0].tp == 1  # tp 4 does not divide 6 GPUs
    assert {c.tp for c in candidates(base, Space(6, tps=(1, 4)))} == {1}
    with pytest.raises(ValueError, match="gpus must be >= 1"):
        candidates(base, Space(0))


def test_a_candidates_config_is_the_base_with_its_cluster_and_drafter(base):
    c = next(c for c in candidates(base, Space(16)) if c.tp == 2 and c.max_batch == 128 and c.policy == "goodput")
    cfg = to_config(base, c)
    assert (cfg.cluster.tp, cfg.cluster.instances, cfg.cluster.max_batch) == (2, 8, 128)
    assert [d.name for d in cfg.drafters] == ["eagle"] and cfg.speculation.width_max == 1
    assert cfg.cluster.realloc == "none" and cfg.workload == base.workload and cfg.model == base.model
    off = to_config(base, next(c for c in candidates(base, Space(16)) if c.policy == "off"))
    assert off.drafters == []


def test_the_screen_ranks_feasible_setups_and_says_why_it_drops_the_rest(base):
    cs = candidates(base, Space(16, tps=(2, 8), max_batches=(128,), static_ks=(3,)))
    scored, dropped = screen(base, cs)
    assert {d.candidate.tp for d in dropped} == {8} and all("tp 8 does not divide" in d.reason for d in dropped)
    assert [s.generation_s for s in scored] == sorted(s.generation_s for s in scored)
    assert len(scored) + len(dropped) == len(cs)
    best = scored[0]
    # the screen's step prices are shared across setups, memoised to within 1% of context a row
    alone = stage_time(best.config, best.candidate.policy, cost_model_for(best.config)).seconds
    assert best.generation_s == pytest.approx(alone, rel=1e-3)
    assert scored[-1].candidate.policy == "off"  # with this head, drafting beats plain decoding at every setup
