"""The setups a planner weighs for one model, GPU budget and workload, each turned into the
simulator's config.

A candidate places the RL step on the GPUs (colocated: rollout, inference and training take
turns on the same GPUs; split: the rollout on its own GPUs, inference and training on the
rest), cuts the rollout's GPUs into instances of `tp`, and sets each instance's batch limit
(`max_num_seqs`), the drafter and draft policy, and the reallocation of samples across
instances. Its memory fraction (vLLM's `gpu_memory_utilization`, which sets the KV cache) is
the largest that fits, since more KV never slows a rollout (`feasible.rollout_memory`): beside
training's states, and, colocated where that frees a tenth of a GPU or more, all it may take
with those states offloaded to host memory for the rollout (moving them is priced in the
training stage).

Policies: `off`; `static:K` for each K in `static_ks` (up to k_max); `goodput` over chains, and
over chains and trees where the workload's speculation allows trees (width_max > 1); the
solved `twostate` (ReSpec's rule: K below a batch size, off above). Reallocation (`rebalance`)
is tried with plain decoding and the adaptive policies. Where the workload updates a learned
drafter over several RL steps, both update schedules are tried with each drafting policy:
`every` N steps, and `pays` (once staleness has cost what an update costs).
"""

from __future__ import annotations

from dataclasses import dataclass

from rlsched.config import SimConfig
from rlsched.plan.feasible import MEMORY_MAX, longest_sequence, rollout_memory
from rlsched.plan.knobs import BATCHED_TOKENS, CAPTURES, EngineKnobs, engine_options, own_knobs
from rlsched.policies.drafter_schedule import SCHEDULES
from rlsched.policies.registry import OFF_SPEC, PolicySpec, parse_policy

OFFLOAD_GAIN = 0.1  # offloading training's states is tried where it frees at least this share of a GPU


@dataclass(frozen=True)
class Candidate:
    tp: int
    instances: int
    max_batch: int
    memory: float  # the rollout's gpu_memory_utilization
    policy: PolicySpec  # off, static:K:DRAFTER, goodput or twostate (over the candidate's one drafter)
    drafter: str | None  # None: plain decoding
    width_max: int = 1  # 1: chains only
    realloc: str = "none"
    train_gpus: int | None = None  # None: colocated (inference and training on the rollout's GPUs)
    offload: bool = False  # colocated: training's states go to host memory for the rollout
    update_schedule: str | None = None  # the drafter's (rl.drafter_update_schedule); None: the workload's
    engine: EngineKnobs | None = None  # vLLM's knobs (engine.kind vllm); None: rlsched's engine

    @property
    def gpus(self) -> int:
        """Every GPU the setup holds."""
        return self.rollout_gpus + (self.train_gpus or 0)

    @property
    def rollout_gpus(self) -> int:
        return self.tp * self.instances

    @property
    def policy_label(self) -> str:
        if self.drafter is None or self.policy.family == "static":
            return self.policy.text
        if self.policy.family == "table":
            return f"table:{self.drafter} (learned)"
        return f"{self.policy.text}:{self.drafter}" + (f" trees<={self.width_max}" if self.width_max > 1 else "")

    @property
    def placement(self) -> str:
        return "colocated" if self.train_gpus is None else f"split {self.rollout_gpus}+{self.train_gpus}"

    @property
    def label(self) -> str:
        realloc = "" if self.realloc == "none" else f" {self.realloc}"
        memory = f"m{self.memory:g}" + ("+offload" if self.offload else "")
        update = "" if self.update_schedule is None else f" update:{self.update_schedule}"
        engine = "" if self.engine is None else f" {self.engine.label}"
        return (
            f"{self.placement} tp{self.tp}x{self.instances} b{self.max_batch} {memory} {self.policy_label}"
            f"{realloc}{update}{engine}"
        )


@dataclass(frozen=True)
class Space:
    gpus: int  # the budget
    tps: tuple[int, ...] = (1, 2, 4, 8)
    max_batches: tuple[int, ...] = (64, 256, 1024)
    static_ks: tuple[int, ...] = (1, 2, 3, 4, 6)
    reallocs: tuple[str, ...] = ("none", "rebalance")
    # the shares of the budget a setup may hold (colocated) and give the rollout (split)
    colocated: tuple[float, ...] = (1.0, 0.5)
    split: tuple[float, ...] = (0.75,)
    # vLLM's knobs, under engine.kind vllm (`plan/knobs.py`)
    batched_tokens: tuple[int, ...] = BATCHED_TOKENS
    chunked_prefill: tuple[bool, ...] = (True, False)
    captures: tuple[str, ...] = CAPTURES


def placements(space: Space) -> list[tuple[int, int | None]]:
    """(rollout GPUs, training GPUs or None for colocated) of the space, whole GPUs only."""
    out: list[tuple[int, int | None]] = []
    for share in space.colocated:
        g = int(space.gpus * share)
        if g >= 1 and g * 1.0 == space.gpus * share and (g, None) not in out:
            out.append((g, None))
    for share in space.split:
        g = int(space.gpus * share)
        if 1 <= g < space.gpus and g * 1.0 == space.gpus * share and (g, space.gpus - g) not in out:
            out.append((g, space.gpus - g))
    return out


def policies(base: SimConfig, space: Space) -> list[tuple[PolicySpec, str | None, int]]:
    """(policy, drafter, width_max) of the space for `base`'s drafters."""
    out: list[tuple[PolicySpec, str | None, int]] = [(OFF_SPEC, None, 1)]
    k_max = base.speculation.k_max
    goodput, twostate = parse_policy("goodput"), parse_policy("twostate")
    for d in base.drafters:
        out += [(parse_policy(f"static:{k}:{d.name}"), d.name, 1) for k in space.static_ks if k <= k_max]
        out.append((goodput, d.name, 1))
        if base.speculation.width_max > 1:
            out.append((goodput, d.name, base.speculation.width_max))
        out.append((twostate, d.name, 1))
    return out


def candidates(base: SimConfig, space: Space) -> list[Candidate]:
    """Every setup of the space for `base`'s model, hardware, drafters and workload: each
    placement, the `tp` of the space's that divide its rollout GPUs, each batch limit, policy,
    (with more than one instance) reallocation and, under vLLM's engine, setting of its knobs."""
    if space.gpus < 1:
        raise ValueError(f"gpus must be >= 1 (got {space.gpus})")
    out = []
    longest = longest_sequence(base)
    knobs = {
        (b, w): engine_options(base, b, w, longest, space.batched_tokens, space.chunked_prefill, space.captures)
        for b in space.max_batches
        for w in {1, base.speculation.width_max}
    }
    for rollout, train in placements(space):
        memories = [(rollout_memory(base, rollout, train), False)]
        if train is None and memories[0][0] <= MEMORY_MAX - OFFLOAD_GAIN:
            memories.append((MEMORY_MAX, True))
        for tp in (t for t in space.tps if t <= rollout and rollout % t == 0):
            instances = rollout // tp
            for b in space.max_batches:
                for memory, offload in memories:
                    for policy, drafter, width in policies(base, space):
                        fixed = policy.family == "static"
                        for r in space.reallocs if instances > 1 and not fixed else ("none",):
                            for u in schedules(base, drafter):
                                out += [
                                    Candidate(tp, instances, b, memory, policy, drafter, width, r, train, offload, u, e)
                                    for e in knobs[b, width]
                                ]
    return out


def schedules(base: SimConfig, drafter: str | None) -> tuple[str | None, ...]:
    """The drafter update schedules to try: both where the workload updates this learned
    drafter over several RL steps, else the workload's (None)."""
    if (
        drafter is None
        or base.rl.drafter_update_interval == 0
        or base.rl.steps < 2
        or base.drafter(drafter).kind == "ngram"
    ):
        return (None,)
    return SCHEDULES


def to_config(base: SimConfig, c: Candidate) -> SimConfig:
    """`base` with the candidate's placement, cluster, drafter alone (an adaptive policy then
    chooses for it), trees or chains, reallocation and vLLM's knobs."""
    cluster = base.cluster.model_copy(
        update=dict(
            tp=c.tp, instances=c.instances, max_batch=c.max_batch, gpu_memory_utilization=c.memory, realloc=c.realloc
        )
    )
    drafters = [d for d in base.drafters if d.name == c.drafter]
    speculation = base.speculation.model_copy(update=dict(width_max=c.width_max, policy=c.policy))
    rl = base.rl.model_copy(
        update=dict(
            train_gpus=c.train_gpus,
            offload_states=c.offload,
            drafter_update_schedule=c.update_schedule or base.rl.drafter_update_schedule,
        )
    )
    update = dict(cluster=cluster, drafters=drafters, speculation=speculation, rl=rl)
    if c.engine is not None:
        update["engine"] = base.engine.model_copy(update=c.engine.engine_update())
    return base.model_copy(update=update)


def from_config(cfg: SimConfig) -> Candidate:
    """The candidate a config is (its first drafter, the one its policy drafts with). Colocated,
    a memory fraction above what training's states leave needs them offloaded: it is read so."""
    c, s, rl = cfg.cluster, cfg.speculation, cfg.rl
    drafter = cfg.drafters[0].name if cfg.drafters and s.policy.family != "off" else None
    offload = rl.offload_states or (
        rl.train_gpus is None and c.gpu_memory_utilization > rollout_memory(cfg, c.instances * c.tp, None)
    )
    update = rl.drafter_update_schedule if len(schedules(cfg, drafter)) > 1 else None
    return Candidate(
        c.tp,
        c.instances,
        c.max_batch,
        c.gpu_memory_utilization,
        s.policy,
        drafter,
        s.width_max if drafter is not None else 1,
        c.realloc,
        rl.train_gpus,
        offload and not rl.train_gpus,
        update,
        own_knobs(cfg),
    )
