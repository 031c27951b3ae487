"""The simulated engine of an instance: rlsched's own (the default) or a model of vLLM V1's.

`engine.kind: rlsched` runs the simulator's own continuous batching (`sim/instance.py`):
whole-prompt prefill steps apart from decode steps. `engine.kind: vllm` runs a model of vLLM
V1's scheduler (`sim/vllm_engine.py`): a token budget per step shared by decode/verify rows and
prompt chunks, prefix caching by blocks, preemption of the newest request with recompute,
CUDA-graph padding and async scheduling. The knobs a config leaves out take vLLM's own defaults
(vLLM 0.32.0; the file each comes from is named beside it) once `resolve` knows the hardware,
the batch limit and the drafters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

PosInt = Annotated[int, Field(gt=0)]

# vllm/config/cache.py: CacheConfig.DEFAULT_BLOCK_SIZE
VLLM_BLOCK_SIZE = 16
# vllm/engine/arg_utils.py: EngineArgs.get_batch_defaults, UsageContext.LLM_CLASS (the offline
# `vllm.LLM` RL frameworks run): 16384 on a GPU of 70 GiB or more (not an A100), else 8192
VLLM_LLM_BATCHED_TOKENS_LARGE, VLLM_LLM_BATCHED_TOKENS_SMALL, VLLM_LARGE_GPU_GIB = 16384, 8192, 70
# vllm/config/vllm.py: VllmConfig._set_cudagraph_sizes, the default capture ceiling (512 but
# on compute-capability 10.x GPUs)
VLLM_MAX_CAPTURE = 512


class EngineSpec(BaseModel):
    """`engine:` in a config. Unset vLLM knobs (None) take vLLM's defaults (`resolve`)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    kind: Literal["rlsched", "vllm"] = "rlsched"
    # tokens one step schedules over all requests (vLLM's max_num_batched_tokens)
    max_num_batched_tokens: PosInt | None = None
    # vllm/engine/arg_utils.py: _set_default_chunked_prefill_and_prefix_caching_args, both on
    # for a decoder-only generating model (ModelConfig.is_chunked_prefill_supported and
    # is_prefix_caching_supported)
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    # token counts with a captured CUDA graph, increasing; [] runs every step eagerly
    # (enforce_eager). None: vLLM's default grid (`default_capture_sizes`)
    cudagraph_capture_sizes: list[PosInt] | None = None
    # host work of a step overlapped with the GPU's previous step. None: vLLM's default
    # (vllm/config/vllm.py: VllmConfig.__post_init__ turns it on unless an incompatible
    # option is set, such as the CPU n-gram drafter: on, but off with an ngram drafter)
    async_scheduling: bool | None = None
    block_size: PosInt = VLLM_BLOCK_SIZE

    @field_validator("cudagraph_capture_sizes")
    @classmethod
    def _increasing(cls, v):
        if v is not None and any(b <= a for a, b in zip(v, v[1:])):
            raise ValueError(f"capture sizes must be strictly increasing token counts, such as [1, 2, 4, 8] (got {v})")
        return v

    def resolve(self, memory_gib: float, hardware_name: str, max_num_seqs: int, host_drafter: bool) -> VllmEngine:
        """The vLLM engine's settings with vLLM's defaults filled in for a GPU of `memory_gib`,
        a batch limit (max_num_seqs) and whether the drafters include a host (n-gram) one."""
        budget = self.max_num_batched_tokens
        if budget is None:
            large = memory_gib >= VLLM_LARGE_GPU_GIB and "a100" not in hardware_name.lower()
            budget = VLLM_LLM_BATCHED_TOKENS_LARGE if large else VLLM_LLM_BATCHED_TOKENS_SMALL
        # vllm/config/vllm.py: given sizes past the budget are dropped
        given = self.cudagraph_capture_sizes
        sizes = default_capture_sizes(max_num_seqs, budget) if given is None else [s for s in given if s <= budget]
        asynch = (not host_drafter) if self.async_scheduling is None else self.async_scheduling
        return VllmEngine(
            budget, self.enable_chunked_prefill, self.enable_prefix_caching, tuple(sizes), asynch, self.block_size
        )


def default_capture_sizes(max_num_seqs: int, max_num_batched_tokens: int) -> list[int]:
    """vLLM's default CUDA-graph capture sizes (vllm/config/vllm.py, VllmConfig._set_cudagraph_sizes,
    one token a request): a ceiling of min(2 x max_num_seqs, 512, max_num_batched_tokens); 1, 2, 4,
    every 8 below 256, every 16 from 256; the budget and max_num_seqs themselves when under the
    ceiling. (With speculation vLLM scales a request-count grid by the query length 1 + k; a
    policy's k changes step to step, so the one-token grid stands for them all.)"""
    top = min(2 * max_num_seqs, VLLM_MAX_CAPTURE, max_num_batched_tokens)
    sizes = [s for s in (1, 2, 4) if s <= top]
    if top >= 8:
        sizes += list(range(8, min(top + 1, 256), 8))
    if top >= 256:
        sizes += list(range(256, top + 1, 16))
    sizes += [s for s in (max_num_batched_tokens, max_num_seqs) if s <= top]
    return sorted(set(sizes))


@dataclass(frozen=True)
class VllmEngine:
    """The settings a simulated vLLM engine runs with, defaults resolved."""

    max_num_batched_tokens: int
    chunked_prefill: bool
    prefix_caching: bool
    capture_sizes: tuple[int, ...]
    async_scheduling: bool
    block_size: int

    def padded(self, tokens: int) -> int:
        """The token count a step of `tokens` runs at: the smallest capture size holding it, or
        its own count above the largest (eager)."""
        import bisect

        i = bisect.bisect_left(self.capture_sizes, tokens)
        return self.capture_sizes[i] if i < len(self.capture_sizes) else tokens
