"""Whether a setup can run at all, and if not, why: one line a planner reports for each setup
it drops.

Tensor parallelism splits attention heads: the target's and a draft model's query heads must
divide by tp, and their KV heads divide it or be divided by it (replicated), as vLLM requires.
An instance's memory, after the weights of the target and its drafters and an activation
reserve, holds KV (`sim.cluster.kv_capacity`, from the cost model); it must hold the
workload's longest sequence (prompt + response at their maxima) above the simulator's 1%
watermark.

Training keeps its states on its GPUs: bf16 weights and gradients, fp32 master weights and
Adam's two moments, 16 bytes a parameter (the critic's too), sharded over the training GPUs as
FSDP/ZeRO-3 does, plus the activation reserve; the training GPUs must hold them. A colocated
rollout gets the memory fraction they leave (`rollout_memory`), or all it may take when they
are offloaded to host memory for the rollout (`rl.offload_states`, priced in the training
stage).

Under vLLM's engine (`engine.kind: vllm`) the knobs must be ones vLLM starts with: a token
budget (`max_num_batched_tokens`) of at least `max_num_seqs`, and of at least the longest
sequence with chunked prefill off (vLLM's SchedulerConfig.verify_max_model_len).
"""

from __future__ import annotations

from rlsched.config import ModelSpec, SimConfig, length_max
from rlsched.costs.roofline import RooflineCostModel
from rlsched.sim.cluster import kv_capacity
from rlsched.sim.rlstep import TRAIN_BYTES_PER_PARAM


def longest_sequence(cfg: SimConfig) -> int:
    """The workload's longest sequence: its longest prompt and its longest response."""
    return length_max(cfg.workload.prompt_len) + length_max(cfg.workload.response_len)


MEMORY_MAX = 0.9  # vLLM's default gpu_memory_utilization: the most a rollout takes


def training_gib(cfg: SimConfig, gpus: int) -> float:
    """GiB of training state resident on each of `gpus` GPUs (no offload)."""
    params = cfg.model.params * (2 if cfg.rl.critic else 1)
    return TRAIN_BYTES_PER_PARAM * params / gpus / 2**30


def rollout_memory(cfg: SimConfig, rollout_gpus: int, train_gpus: int | None, offload: bool = False) -> float:
    """The largest memory fraction (to 0.01, at most MEMORY_MAX) the rollout can take: all it
    may on GPUs of its own or with training's states offloaded; colocated, what training's
    resident states and reserve leave."""
    if train_gpus is not None or offload:
        return MEMORY_MAX
    left = 1.0 - (training_gib(cfg, rollout_gpus) + cfg.cluster.activation_reserve_gib) / cfg.hardware.memory_gib
    return min(MEMORY_MAX, max(0.01, int(left * 100) / 100))


def _heads(model: ModelSpec, tp: int, what: str) -> str | None:
    if model.heads % tp:
        return f"{what} {model.name} has {model.heads} attention heads, which tp {tp} does not divide"
    if model.kv_heads % tp and tp % model.kv_heads:
        return f"{what} {model.name} has {model.kv_heads} KV heads, which neither divide nor are divided by tp {tp}"
    return None


def engine_refusal(cfg: SimConfig) -> str | None:
    """Why vLLM would refuse the config's engine knobs (None: it starts)."""
    e = cfg.engine
    if e.kind != "vllm" or e.max_num_batched_tokens is None:
        return None
    budget, longest = e.max_num_batched_tokens, longest_sequence(cfg)
    if budget < cfg.cluster.max_batch:
        return (
            f"engine.max_num_batched_tokens {budget} is below max_num_seqs {cfg.cluster.max_batch} "
            "(cluster.max_batch), which vLLM refuses"
        )
    if not e.enable_chunked_prefill and budget < longest:
        return (
            f"engine.max_num_batched_tokens {budget} is below the longest sequence ({longest}) with chunked "
            "prefill off, which vLLM refuses"
        )
    return None


def infeasible(cfg: SimConfig, cost=None) -> str | None:
    """None when `cfg`'s instances can run its workload, else one line saying why not. `cost`:
    the cost model the KV capacity comes from (default: the config's roofline)."""
    c = cfg.cluster
    reason = _heads(cfg.model, c.tp, "the model")
    for d in cfg.drafters:
        if reason is None and d.kind == "model" and d.model is not None:
            reason = _heads(d.model, c.tp, f"drafter {d.name}")
    reason = reason or engine_refusal(cfg)
    if reason is not None:
        return reason
    roofline = RooflineCostModel.from_config(cfg)
    capacity = kv_capacity(cfg, roofline if cost is None else cost)
    if capacity == 0:
        return (
            f"the weights ({roofline.weight_bytes / 2**30:.1f} GiB with the drafters) leave no room for KV on "
            f"tp {c.tp} x {cfg.hardware.name} at gpu_memory_utilization {c.gpu_memory_utilization:g}"
        )
    longest = longest_sequence(cfg)
    if longest > capacity - capacity // 100:
        return f"an instance holds {capacity} KV tokens, fewer than the longest sequence needs ({longest})"
    hw, train_gpus = cfg.hardware, cfg.rl.train_gpus or c.instances * c.tp
    resident = training_gib(cfg, train_gpus) + c.activation_reserve_gib
    if resident > hw.memory_gib:
        return (
            f"training's states need {resident:.1f} GiB a GPU on {train_gpus} x {hw.name} "
            f"({hw.memory_gib:g} GiB): give training more GPUs"
        )
    return None
