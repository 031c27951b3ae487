"""The planner's screen: every candidate's RL step priced without the simulator, infeasible
ones dropped with their reason, the rest ranked best first by the objective.

A step's estimate: the fluid generation stage (`plan/fluid.py`; with reallocation, its work
spread evenly over the instances) plus the inference and training stages on their GPUs
(`sim/rlstep.StageCosts`). Fluid stages are shared by the setups that differ only in
reallocation or placement of training, and step prices by those of one tp, drafter and tree
allowance.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlsched.config import SimConfig
from rlsched.costs.choose import cost_model_for
from rlsched.plan.feasible import infeasible
from rlsched.plan.fluid import FluidStage, Strategies, stage_time
from rlsched.plan.space import Candidate, to_config
from rlsched.sim.rlstep import StageCosts

OBJECTIVES = ("step-time", "tokens-per-gpu-s")


def score(objective: str, step_s: float, gpus: int, tokens: float) -> float:
    """What the planner minimises: a step's seconds, or GPU-seconds a response token (the
    inverse of response tokens a GPU-second)."""
    if objective == "step-time":
        return step_s
    if objective == "tokens-per-gpu-s":
        return step_s * gpus / tokens
    raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)} (got '{objective}')")


@dataclass(frozen=True)
class Scored:
    candidate: Candidate
    config: SimConfig
    generation_s: float  # the screen's generation stage of the first RL step
    step_s: float  # the screen's RL step
    tokens: int  # response tokens a step
    score: float


@dataclass(frozen=True)
class Dropped:
    candidate: Candidate
    reason: str


def step_estimate(cfg: SimConfig, c: Candidate, stage: FluidStage) -> tuple[float, float]:
    """(generation, RL step) seconds of the candidate from its fluid stage."""
    gen = stage.seconds if c.realloc == "none" else stage.balanced_s
    costs = StageCosts(cfg)
    tokens = stage.prompt_tokens + stage.tokens
    return gen, gen + costs.inference(tokens) + costs.training(tokens)


def screen(base: SimConfig, cands: list[Candidate], objective: str = "step-time") -> tuple[list[Scored], list[Dropped]]:
    """(the feasible candidates best first by the screen; the others with why). Each tp's and
    drafter's cost model is the roofline of `base`'s hardware and models (or its cost file)."""
    score(objective, 1.0, 1, 1)  # the objective's name, before any work
    scored, dropped, prices, stages = [], [], {}, {}
    for c in cands:
        cfg = to_config(base, c)
        reason = infeasible(cfg)
        if reason is not None:
            dropped.append(Dropped(c, reason))
            continue
        key = (c.tp, c.instances, c.max_batch, c.memory, c.policy, c.drafter, c.width_max)
        if key not in stages:
            pkey = (c.tp, c.drafter, c.width_max)
            if pkey not in prices:
                cost = cost_model_for(cfg)
                prices[pkey] = (cost, Strategies(cfg, cost, c.drafter))
            cost, strategies = prices[pkey]
            stages[key] = stage_time(cfg, c.policy, cost, strategies=strategies)
        gen, step = step_estimate(cfg, c, stages[key])
        tokens = stages[key].tokens
        scored.append(Scored(c, cfg, gen, step, tokens, score(objective, step, c.gpus, tokens)))
    scored.sort(key=lambda s: s.score)
    return scored, dropped
