"""The planner's screen: every candidate's RL step priced without the simulator, infeasible
ones dropped with their reason, the rest ranked best first by the objective.

A step's estimate: the fluid generation stage (`plan/fluid.py`; with reallocation, its work
spread evenly over the instances) plus the inference and training stages on their GPUs
(`sim/rlstep.StageCosts`). Fluid stages are shared by the setups that differ only in
reallocation or placement of training, and step prices by those of one tp, drafter, tree
allowance and (under vLLM's engine) resolved engine settings.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from rlsched.config import SimConfig
from rlsched.costs.choose import cost_model_for
from rlsched.plan.feasible import infeasible
from rlsched.plan.fluid import FluidStage, Strategies, resolved_engine, stage_time
from rlsched.plan.knobs import reference_knobs, step_tokens_max
from rlsched.plan.space import Candidate, to_config
from rlsched.sim.rlstep import StageCosts

OBJECTIVES = ("step-time", "tokens-per-gpu-s")
KNOB_GAIN = 0.01  # a setting of vLLM's knobs is searched where the screen prices it this much better than vLLM's own


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
        key = (c.tp, c.instances, c.max_batch, c.memory, c.policy, c.drafter, c.width_max, c.engine)
        if key not in stages:
            engine = resolved_engine(cfg)
            pkey = (c.tp, c.drafter, c.width_max, engine)
            if pkey not in prices:
                cost = cost_model_for(cfg)
                prices[pkey] = (cost, Strategies(cfg, cost, c.drafter, engine=engine))
            cost, strategies = prices[pkey]
            stages[key] = stage_time(cfg, c.policy, cost, strategies=strategies)
        gen, step = step_estimate(cfg, c, stages[key])
        tokens = stages[key].tokens
        scored.append(Scored(c, cfg, gen, step, tokens, score(objective, step, c.gpus, tokens)))
    scored.sort(key=lambda s: s.score)
    return scored, dropped


def screen_setups(
    base: SimConfig, cands: list[Candidate], objective: str = "step-time", expand: int = 48
) -> tuple[list[Scored], list[Dropped], list[Scored]]:
    """(scored, dropped, the scored to search) of candidates that may differ in vLLM's knobs
    alone: every setup first at the setting nearest vLLM's defaults (`knobs.reference_knobs`),
    then the best `expand` setups at every setting of theirs. A setup is searched at its
    reference setting, and at its best other setting where the screen prices it KNOB_GAIN
    better or more (a setting the screen cannot tell from the default is not searched)."""
    groups: dict[Candidate, list[Candidate]] = {}
    for c in cands:
        groups.setdefault(replace(c, engine=None), []).append(c)
    if all(len(g) == 1 for g in groups.values()):
        scored, dropped = screen(base, cands, objective)
        return scored, dropped, scored
    refs = {}
    for key, g in groups.items():
        need = step_tokens_max(base, key.max_batch, key.width_max)
        ref = reference_knobs(base, [c.engine for c in g if c.engine is not None], need)
        refs[key] = next(c for c in g if c.engine == ref)
    first, dropped = screen(base, list(refs.values()), objective)
    top = [replace(s.candidate, engine=None) for s in first[:expand]]
    rest, dropped2 = screen(base, [c for k in top for c in groups[k] if c != refs[k]], objective)
    best: dict[Candidate, Scored] = {}
    for s in rest:
        best.setdefault(replace(s.candidate, engine=None), s)
    ref_score = {replace(s.candidate, engine=None): s.score for s in first}
    pool = first + [s for k, s in best.items() if s.score < ref_score[k] * (1 - KNOB_GAIN)]
    scored = sorted(first + rest, key=lambda s: s.score)
    return scored, dropped + dropped2, sorted(pool, key=lambda s: s.score)
