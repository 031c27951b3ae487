"""Whether a setup can run at all, and if not, why: one line a planner reports for each setup
it drops.

Tensor parallelism splits attention heads: the target's and a draft model's query heads must
divide by tp, and their KV heads divide it or be divided by it (replicated), as vLLM requires.
An instance's memory, after the weights of the target and its drafters and an activation
reserve, holds KV (`sim.cluster.kv_capacity`, from the cost model); it must hold the
workload's longest sequence (prompt + response at their maxima) above the simulator's 1%
watermark.
"""

from __future__ import annotations

from rlsched.config import LengthDist, ModelSpec, SimConfig
from rlsched.costs.roofline import RooflineCostModel
from rlsched.sim.cluster import kv_capacity


def length_max(d: LengthDist) -> int:
    """The longest length a distribution draws."""
    if d.dist == "fixed":
        return d.value
    if d.dist == "lognormal":
        return d.max
    return d.max if d.max is not None else max(d.values)


def longest_sequence(cfg: SimConfig) -> int:
    return length_max(cfg.workload.prompt_len) + length_max(cfg.workload.response_len)


def _heads(model: ModelSpec, tp: int, what: str) -> str | None:
    if model.heads % tp:
        return f"{what} {model.name} has {model.heads} attention heads, which tp {tp} does not divide"
    if model.kv_heads % tp and tp % model.kv_heads:
        return f"{what} {model.name} has {model.kv_heads} KV heads, which neither divide nor are divided by tp {tp}"
    return None


def infeasible(cfg: SimConfig, cost=None) -> str | None:
    """None when `cfg`'s instances can run its workload, else one line saying why not. `cost`:
    the cost model the KV capacity comes from (default: the config's roofline)."""
    c = cfg.cluster
    reason = _heads(cfg.model, c.tp, "the model")
    for d in cfg.drafters:
        if reason is None and d.kind == "model":
            reason = _heads(d.model, c.tp, f"drafter {d.name}")
    if reason is not None:
        return reason
    roofline = RooflineCostModel.from_config(cfg)
    capacity = kv_capacity(cfg, roofline if cost is None else cost)
    if capacity == 0:
        return (f"the weights ({roofline.weight_bytes / 2**30:.1f} GiB with the drafters) leave no room for KV on "
                f"tp {c.tp} x {cfg.hardware.name} at gpu_memory_utilization {c.gpu_memory_utilization:g}")
    longest = longest_sequence(cfg)
    if longest > capacity - capacity // 100:
        return f"an instance holds {capacity} KV tokens, fewer than the longest sequence needs ({longest})"
    return None
