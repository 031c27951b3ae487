"""What the pool's driver needs to move samples between instances: a migration under way,
the instances' views as they will be once it lands, and the cost model that prices a move
(KV rows through Ray's object store, measured, or a re-prefill)."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from rlsched.executor.engine.rows import Request, reserve
from rlsched.policies.types import InstanceView


@dataclass
class Move:
    """A migration under way: an export queued on the source, an import on the destination."""

    src: int
    dst: int
    ids: list[int]
    export_ref: object
    import_ref: object


def view_without(v: InstanceView, gone: set, requests: list[Request]) -> InstanceView:
    """The view without these samples (they are leaving: their KV reservation is freed)."""
    keep = np.array([j not in gone for j in v.running_ids.tolist()], dtype=bool)
    left = [j for j in v.waiting_ids if j not in gone]
    n_out = [j for j in v.running_ids.tolist() + list(v.waiting_ids) if j in gone]
    return replace(
        v,
        running_ids=v.running_ids[keep],
        running_ctx=v.running_ctx[keep],
        waiting_ids=left,
        kv_free_tokens=v.kv_free_tokens + sum(reserve(requests[j]) for j in n_out),
    )


def view_with(v: InstanceView, arriving: list[int], requests: list[Request]) -> InstanceView:
    """The view with these samples queued (arriving: they reserve KV here)."""
    return replace(
        v,
        waiting_ids=list(v.waiting_ids) + list(arriving),
        kv_free_tokens=v.kv_free_tokens - sum(reserve(requests[j]) for j in arriving),
    )


class HostCost:
    """The cost model migrations are priced by: step and prefill times from the executor's
    measured profile (`base`), and the KV transfer between instances on this host as measured
    through Ray's object store when the pool starts (a latency and a bandwidth)."""

    def __init__(self, base, kv_bytes_per_token: int, latency_s: float, bytes_per_s: float):
        self.base, self.kv_bytes_per_token = base, kv_bytes_per_token
        self.latency_s, self.bytes_per_s = latency_s, bytes_per_s

    def __getattr__(self, name):
        return getattr(self.base, name)

    def kv_transfer_time(self, ctx_tokens: int, n_seqs: int) -> float:
        if n_seqs == 0:
            return 0.0
        return self.latency_s + ctx_tokens * self.kv_bytes_per_token / self.bytes_per_s


def measure_host_cost(ray, actor, spec, base) -> HostCost:
    """`base` with the KV transfer to `actor` (an instance built from `spec`): a small and a
    large payload timed through the object store give the latency and the bandwidth."""
    from rlsched.executor.model.kvcache import KVCache
    from rlsched.executor.model.loading import load_config

    c = load_config(Path(spec.target_dir))
    per_token = KVCache.bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, getattr(torch, spec.dtype))

    def trip(nbytes: int) -> float:
        best = float("inf")
        for _ in range(3):
            x = np.zeros(max(1, nbytes // 4), dtype=np.float32)
            t = time.perf_counter()
            ray.get(actor.echo.remote(ray.put(x)))
            best = min(best, time.perf_counter() - t)
        return best

    small, big = trip(1 << 10), trip(1 << 23)
    bw = (1 << 23) / max(big - small, 1e-6)
    return HostCost(base, per_token, small, bw)
