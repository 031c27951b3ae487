"""The planner's screen: every candidate priced by the fluid estimate of its generation stage
(`plan/fluid.py`), infeasible ones dropped with their reason, the rest ranked fastest first."""

from __future__ import annotations

from dataclasses import dataclass

from rlsched.config import SimConfig
from rlsched.costs.choose import cost_model_for
from rlsched.plan.feasible import infeasible
from rlsched.plan.fluid import StepPrices, stage_time
from rlsched.plan.space import Candidate, to_config


@dataclass(frozen=True)
class Scored:
    candidate: Candidate
    config: SimConfig
    generation_s: float  # the fluid estimate of the first RL step's generation stage


@dataclass(frozen=True)
class Dropped:
    candidate: Candidate
    reason: str


def screen(base: SimConfig, cands: list[Candidate]) -> tuple[list[Scored], list[Dropped]]:
    """(the feasible candidates by estimated generation time, fastest first; the others with
    why). One cost model per (tp, drafter), the roofline of `base`'s hardware and models, and
    its step prices shared by the setups of that tp and drafter."""
    scored, dropped, costs = [], [], {}
    for c in cands:
        cfg = to_config(base, c)
        reason = infeasible(cfg)
        if reason is not None:
            dropped.append(Dropped(c, reason))
            continue
        key = (c.tp, c.drafter)
        if key not in costs:
            cost = cost_model_for(cfg)
            k_max = cfg.speculation.k_max if c.drafter is not None else 0
            costs[key] = (cost, StepPrices(cost, c.drafter, k_max))
        cost, prices = costs[key]
        scored.append(Scored(c, cfg, stage_time(cfg, c.policy, cost, prices=prices).seconds))
    scored.sort(key=lambda s: s.generation_s)
    return scored, dropped
