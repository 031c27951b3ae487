"""Sample reallocation across instances: which sequences move where, decided at events.

The engine calls `on_event` when sequences finish on an instance (kind 'finished', or
'drained' when its load - running plus queued - fell below the cluster's threshold) and when
an instance goes empty ('idle'). The views show every instance still in the stage as it will
be once the migrations already requested have landed. A policy sees lengths so far, queues and
batch sizes, never how long a sequence will still run (`running_remaining_hint` is None in
the simulator too: the real executor cannot know it).

- `none`: samples stay where they were first assigned.
- `rebalance` (RLHFSpec): an instance with free batch slots takes queued sequences from
  instances whose queues exceed a full batch; once no queue is left, an instance that drained
  below the threshold takes running sequences from the busiest one, halving the gap.
- `consolidate` (TLT): the same while queues last; then a drained instance hands all its
  sequences to busier instances, as long as their steps slow down by at most `slack`, and
  goes idle: it is freed for other work (the drafter update) for the rest of the stage.

Moving a queued sequence is free (only its tokens move; its prefill happens at the
destination instead). A running one either ships its KV cache or is re-prefilled at the
destination; with mode 'auto' the cluster picks the cheaper per sequence by the cost model.
"""

from __future__ import annotations

import numpy as np

from rlsched.errors import UserError
from rlsched.policies.types import CostModel, InstanceView, Migration, ReallocEvent


def room(v: InstanceView) -> int:
    """Free batch slots left once its queue is admitted."""
    return max(0, v.max_batch - v.load)


def excess(v: InstanceView) -> int:
    """Queued sequences beyond what one full batch holds: they wait whatever happens here."""
    return max(0, v.load - v.max_batch)


def _mean_ctx(v: InstanceView, default: int) -> int:
    return int(v.running_ctx.mean()) if len(v.running_ctx) else default


def steal_queued(dst: InstanceView, views: list[InstanceView]) -> list[Migration]:
    """Fill `dst`'s free slots with queued sequences from the instances whose queues exceed a
    full batch, the largest excess first, from the back of their queues (they would wait
    longest). Never more than dst has slots (and, by the donors' average context, KV) for, and
    never so many that a donor falls below a full batch: no sequence can be sent back."""
    n_room = room(dst)
    if n_room == 0:
        return []
    donors = sorted(
        (v for v in views if v.instance != dst.instance and excess(v) > 0), key=lambda v: (-excess(v), v.instance)
    )
    out, kv_free = [], dst.kv_free_tokens
    for src in donors:
        est = max(1, _mean_ctx(src, 1))
        n = min(n_room, excess(src), max(0, kv_free) // est)
        if n <= 0:
            break
        ids = tuple(int(s) for s in list(src.waiting_ids)[-n:][::-1])
        out.append(Migration(src.instance, dst.instance, ids))
        n_room -= n
        kv_free -= n * est
    return out


def _fits(ctx: np.ndarray, kv_free: int) -> int:
    """How many of these sequences (in order) fit in kv_free KV tokens."""
    return int(np.searchsorted(np.cumsum(ctx), kv_free, side="right"))


def split_kv_reprefill(cost: CostModel, ctx: np.ndarray) -> int:
    """How many of the sequences with these contexts (sorted ascending) to re-prefill at the
    destination rather than ship as KV: the shortest ones (prefill attention grows with the
    square of the length, a transfer only linearly); the split with the least charged time
    (re-prefill of the first s + KV transfer of the rest)."""
    n = len(ctx)
    cs = np.concatenate(([0], np.cumsum(ctx)))
    cs2 = np.concatenate(([0], np.cumsum(ctx * ctx)))
    best_s, best_t = 0, cost.kv_transfer_time(int(cs[-1]), n)
    for s in range(1, n + 1):
        t = cost.prefill_time(int(cs[s]), int(cs2[s])) + cost.kv_transfer_time(int(cs[-1] - cs[s]), n - s)
        if t < best_t:
            best_s, best_t = s, t
    return best_s


class NoRealloc:
    """Samples stay where they were first assigned; an instance that runs out of work is free."""

    name = "none"
    releases_idle = True

    def on_event(self, event: ReallocEvent, cost: CostModel) -> list[Migration]:
        return []


class Rebalance:
    """RLHFSpec-style: keep every instance's active batch full while queues last, then even
    out the batches of the tail.

    At every event of an instance with free slots, it takes queued work from instances whose
    queues exceed a full batch (see `steal_queued`). When no queue is left and the instance
    drained below the threshold (or went idle), it takes running sequences from the instance
    with the largest batch, half the gap, when the gap is at least `min_gap` (hysteresis:
    afterwards the two differ by at most one, so nothing moves back until sequences finish).
    It moves the sequences with the shortest contexts: the fewest tokens generated so far, so
    (samples of one prompt being alike, and an instance holding few prompt groups) the most
    left to generate, and the least KV to ship."""

    name = "rebalance"
    releases_idle = False

    def __init__(self, min_gap: int = 4):
        self.min_gap = max(2, min_gap)

    def on_event(self, event: ReallocEvent, cost: CostModel) -> list[Migration]:
        views = event.views
        dst = next((v for v in views if v.instance == event.instance), None)
        if dst is None or room(dst) == 0:
            return []
        if any(excess(v) for v in views):
            return steal_queued(dst, views)
        if event.kind not in ("drained", "idle"):
            return []
        others = [v for v in views if v.instance != dst.instance and len(v.running_ids)]
        if not others:
            return []
        src = max(others, key=lambda v: (len(v.running_ids), -v.instance))
        gap = len(src.running_ids) - dst.load
        if gap < self.min_gap:
            return []
        order = np.argsort(src.running_ctx, kind="stable")
        n = min(gap // 2, room(dst), _fits(src.running_ctx[order], dst.kv_free_tokens))
        if n <= 0:
            return []
        return [Migration(src.instance, dst.instance, tuple(int(s) for s in src.running_ids[order[:n]]))]


class Consolidate:
    """TLT-style: gather the tail onto fewer instances and free the rest.

    While queues last it fills free slots as `rebalance` does. Afterwards, when an instance
    drained below the threshold, it hands all its sequences to instances that hold more (ties:
    the higher index), the busiest first, as long as the receiver's decode step (by the cost
    model) is at most `slack` slower than the drained instance's own, so that no moved
    sequence slows down by more; if they cannot all go, none moves (a partial move would free
    nothing). The emptied instance goes idle and is freed for the rest of the stage."""

    name = "consolidate"
    releases_idle = True

    def __init__(self, slack: float = 0.15):
        self.slack = slack

    def on_event(self, event: ReallocEvent, cost: CostModel) -> list[Migration]:
        views = event.views
        me = next((v for v in views if v.instance == event.instance), None)
        if me is None:
            return []
        if any(excess(v) for v in views):
            return steal_queued(me, views)
        if event.kind not in ("drained", "idle") or me.load == 0:
            return []
        rank = (me.load, me.instance)
        receivers = sorted(
            (v for v in views if (v.load, v.instance) > rank and len(v.running_ids)),
            key=lambda v: (-v.load, -v.instance),
        )
        # its sequences, the running ones longest first (most KV: to the most room), then the queued
        order = np.argsort(-me.running_ctx, kind="stable")
        ids = [int(s) for s in me.running_ids[order]] + [int(s) for s in me.waiting_ids]
        ctx = np.concatenate((me.running_ctx[order], np.full(len(me.waiting_ids), _mean_ctx(me, 1))))
        # a moved sequence's decode step may grow by at most `slack` (its receiver's, being
        # busier, grows by less)
        limit = (1.0 + self.slack) * cost.verify_time(me.load, 1, int(ctx.sum()))
        out, pos = [], 0
        for r in receivers:
            if pos == len(ids):
                break
            b0, c0 = r.load, int(r.running_ctx.sum())
            n = min(room(r), len(ids) - pos, _fits(ctx[pos:], r.kv_free_tokens))
            while n > 0 and cost.verify_time(b0 + n, 1, c0 + int(ctx[pos : pos + n].sum())) > limit:
                n -= 1
            if n > 0:
                out.append(Migration(me.instance, r.instance, tuple(ids[pos : pos + n])))
                pos += n
        return out if pos == len(ids) else []


REALLOC_POLICIES = "none, rebalance, consolidate"


def make_realloc_policy(spec: str):
    name = spec.strip()
    if name == "none":
        return NoRealloc()
    if name == "rebalance":
        return Rebalance()
    if name == "consolidate":
        return Consolidate()
    raise UserError(f"unknown reallocation policy '{spec}'; choose from {REALLOC_POLICIES}")
