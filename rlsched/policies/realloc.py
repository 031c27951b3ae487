"""Sample reallocation across instances: which sequences move where when one drains."""

from __future__ import annotations

from rlsched.errors import UserError
from rlsched.policies.types import CostModel, Migration, ReallocEvent


class NoRealloc:
    """Samples stay where they were first assigned."""

    name = "none"

    def on_event(self, event: ReallocEvent, cost: CostModel) -> list[Migration]:
        return []


class Rebalance:
    """RLHFSpec-style: when an instance drains, take work from the most loaded instance so
    their loads even out. Queued sequences move first (nothing to ship), then the running
    ones with the shortest contexts (cheapest to ship or recompute)."""

    name = "rebalance"

    def __init__(self, min_gap: int = 2):
        self.min_gap = min_gap

    def on_event(self, event: ReallocEvent, cost: CostModel) -> list[Migration]:
        views = {v.instance: v for v in event.views}
        dst = views[event.instance]
        src = max(event.views, key=lambda v: v.load)
        gap = src.load - dst.load
        if src.instance == dst.instance or gap < self.min_gap:
            return []
        n = min(gap // 2, dst.max_batch - dst.load)
        if n <= 0:
            return []
        ids = list(src.waiting_ids[-n:])[::-1]  # the back of the queue: it would wait longest
        if len(ids) < n:
            order = src.running_ctx.argsort(kind="stable")
            ids += [int(src.running_ids[i]) for i in order[: n - len(ids)]]
        return [Migration(src.instance, dst.instance, tuple(int(i) for i in ids))]


REALLOC_POLICIES = "none, rebalance"


def make_realloc_policy(spec: str):
    name = spec.strip()
    if name == "none":
        return NoRealloc()
    if name == "rebalance":
        return Rebalance()
    raise UserError(f"unknown reallocation policy '{spec}'; choose from {REALLOC_POLICIES}")
