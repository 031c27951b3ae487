"""The setups a planner weighs for one model, GPU count and workload: candidates over the
rollout's tensor parallelism (every GPU in instances of `tp`), batch limit, drafter and draft
policy, each turned into the simulator's config.

Policies: `off`, `static:K` for each K in `static_ks` (up to k_max) and `goodput`, for each of
the workload's drafters. Chains only, every GPU on the rollout, no reallocation: the fluid
screen (`plan/fluid.py`) prices exactly these.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlsched.config import SimConfig


@dataclass(frozen=True)
class Candidate:
    tp: int
    instances: int
    max_batch: int
    policy: str  # off, static:K:DRAFTER or goodput (over the candidate's one drafter)
    drafter: str | None  # None: plain decoding

    @property
    def label(self) -> str:
        policy = f"goodput:{self.drafter}" if self.policy == "goodput" else self.policy
        return f"tp{self.tp}x{self.instances} b{self.max_batch} {policy}"

    @property
    def gpus(self) -> int:
        return self.tp * self.instances


@dataclass(frozen=True)
class Space:
    gpus: int
    tps: tuple[int, ...] = (1, 2, 4, 8)
    max_batches: tuple[int, ...] = (64, 128, 256, 512)
    static_ks: tuple[int, ...] = (1, 2, 3, 4, 6)


def candidates(base: SimConfig, space: Space) -> list[Candidate]:
    """Every setup of the space for `base`'s model, hardware, drafters and workload: `tp` of
    the space's that divide the GPUs, all of them in rollout instances."""
    if space.gpus < 1:
        raise ValueError(f"gpus must be >= 1 (got {space.gpus})")
    k_max = base.speculation.k_max
    out = []
    for tp in (t for t in space.tps if t <= space.gpus and space.gpus % t == 0):
        for b in space.max_batches:
            out.append(Candidate(tp, space.gpus // tp, b, "off", None))
            for d in base.drafters:
                for k in (k for k in space.static_ks if k <= k_max):
                    out.append(Candidate(tp, space.gpus // tp, b, f"static:{k}:{d.name}", d.name))
                out.append(Candidate(tp, space.gpus // tp, b, "goodput", d.name))
    return out


def to_config(base: SimConfig, c: Candidate) -> SimConfig:
    """`base` with the candidate's cluster, its drafter alone (goodput then chooses k for it),
    chains and no reallocation."""
    cluster = base.cluster.model_copy(update=dict(tp=c.tp, instances=c.instances, max_batch=c.max_batch,
                                                  realloc="none"))
    drafters = [d for d in base.drafters if d.name == c.drafter]
    speculation = base.speculation.model_copy(update=dict(width_max=1, policy=c.policy))
    return base.model_copy(update=dict(cluster=cluster, drafters=drafters, speculation=speculation))
