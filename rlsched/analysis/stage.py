"""The generation stage of recorded rollouts, simulated within an engine's limits: what
`replay` sets beside the measured time. No torch."""

from __future__ import annotations

import json

import numpy as np
import simpy

from rlsched.policies.acceptance import AcceptanceEstimator
from rlsched.policies.registry import PolicySpec


def _drafter_overrides(drafter) -> list[str]:
    """The replayed drafter in the config where the default preset lacks it (its kind from its
    name: n-gram and suffix drafters are host drafters, `ngram` to the simulator)."""
    from rlsched.config import load_preset_data
    from rlsched.policies.drafters import HOST_DRAFTERS

    have = list(load_preset_data("jobs", "default").get("drafters", []))
    if drafter is None or drafter in [d["name"] for d in have]:
        return []
    kind = "ngram" if drafter in HOST_DRAFTERS else "eagle" if drafter == "eagle" else "model"
    spec = {"name": drafter, "kind": kind, "acceptance": {"mean": 0.6}}
    if kind == "model":
        spec["model"] = "qwen2.5-0.5b"
    return [f"drafters={json.dumps([*have, spec])}"]


def simulate_stage(
    rollouts, policy: PolicySpec, drafter, sim_cost, policy_cost, limits: dict, seed: int
) -> list[float]:
    """Generation-stage seconds of each rollout within `limits` (`run_limits`): on one
    instance, or on `instances` (prompts assigned round-robin, as the pool does) with the
    reallocation policy and threshold; with `limits["engine"]` (an `engine` section, kind vllm)
    each instance runs as the model of vLLM's engine."""
    from rlsched.config import load_config
    from rlsched.policies.draft import PolicyContext
    from rlsched.policies.realloc import make_realloc_policy
    from rlsched.policies.registry import make_draft_policy
    from rlsched.sim.cluster import GenerationStage
    from rlsched.sim.timeline import Timeline

    n_inst, k_max, max_batch = limits["instances"], limits["k_max"], limits["max_batch"]
    engine = limits.get("engine") or {}
    cfg = load_config(
        "default",
        overrides=[
            *(f"engine.{k}={json.dumps(v)}" for k, v in engine.items()),
            *_drafter_overrides(drafter),
            f"cluster.instances={n_inst}",
            f"cluster.max_batch={max_batch}",
            f"speculation.k_max={k_max}",
            f"cluster.realloc={limits['realloc']}",
            f"cluster.realloc_threshold={limits['realloc_threshold']}",
            "cluster.assignment=by_prompt",
            f"cluster.share_prompts={limits['share_prompts']}",
            f"speculation.probe_every={limits['probe_every'] or 'null'}",
        ],
    )
    names = () if drafter is None else (drafter,)
    ctx = PolicyContext(
        cost=policy_cost, drafters=names, k_max=k_max, max_batch=max_batch, typical_ctx=limits["typical_ctx"]
    )
    policies = [make_draft_policy(policy, ctx) for _ in range(n_inst)]  # one per instance, as in the pool
    estimator = AcceptanceEstimator(names)
    longest = max(int(ro.prompt_len.max()) for ro in rollouts)
    capacity = max_batch * (longest + limits["max_tokens"] + k_max) * 2
    env = simpy.Environment()
    timeline = Timeline(enabled=False)
    realloc = make_realloc_policy(limits["realloc"])
    times: list[float] = []
    root = np.random.SeedSequence(seed)

    def run():
        for i, ro in enumerate(rollouts):
            stage = GenerationStage(
                env, cfg, sim_cost, ro, policies, realloc, estimator, timeline, i, root.spawn(1)[0], capacity
            )
            t0 = env.now
            yield env.process(stage.run())
            times.append(env.now - t0)

    env.process(run())
    env.run()
    return times
