"""The rollout backend: what the trainer drives to generate, whichever engine does it, and the
one factory that builds it from a run's config (`BackendConfig`, `make_backend`), for
`generate`, `run` and the configs the planner writes.

Three implement it: `engine.rollout.RolloutEngine` (one instance in this process),
`pool.instances.InstancePool` (several on Ray) and `vllm.engine.VllmRolloutEngine` (vLLM's
offline engine). Each method has the same signature in all three; a backend with nothing to
do for one says so in its own docstring and does nothing, so callers never ask which backend
they hold.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from rlsched.policies.probe import PROBE_EVERY

if TYPE_CHECKING:
    from rlsched.executor.engine.rows import Request, RolloutResult


@runtime_checkable
class RolloutBackend(Protocol):
    rl_step: int
    """The RL step the trace records of the next `run` carry (the caller sets it)."""

    estimator: Any
    """Acceptance estimates, `estimator.mean(drafter)`; None where the backend keeps none."""

    def run(self, requests: list[Request]) -> RolloutResult:
        """Generate every request; the samples in request order, with the rollout's stats."""

    def resize(self, cache_capacity: int, drafter_max_len: int) -> None:
        """Make room for longer requests: a KV budget of `cache_capacity` tokens, drafter
        caches of `drafter_max_len` tokens a row."""

    def sync_weights(self, model, drafter_model=None) -> None:
        """Generate from now on with these (updated) target and drafter modules' weights."""

    def policy_state(self) -> Any:
        """What a checkpoint keeps to restore what the backend learnt while generating (its
        draft policy, acceptance estimates, n-gram history): handed back when it is rebuilt."""

    def close(self) -> None:
        """Write the last trace parts and release what the backend holds."""


@dataclass
class BackendConfig:
    """How a run's rollout backend is built, beside the models `setup.load_models` loaded: the
    engine (`local`: rlsched's, `vllm`: vLLM's), its instances (more than 1: a Ray pool) and
    each instance's sizes and settings."""

    backend: str  # local or vllm
    instances: int
    policy: Any  # the policy as given (a PolicySpec or its text): what vLLM maps and builds
    capacity: int  # the KV budget of an instance, in tokens
    max_batch: int
    k_max: int
    drafter_len: int  # a model drafter's cache rows, in tokens
    trace_dir: Path
    device: str
    dtype: str
    threads: int | None  # per instance (vLLM in this process: None leaves torch's own)
    realloc: str = "none"
    threshold: int = 8
    seed: int = 0
    ngram_history: int | None = None
    share_prompts: bool = True
    probe_every: int | None = PROBE_EVERY
    max_len: int = 0  # vLLM: the longest prompt + max_tokens + k_max + 1 it is sized for
    typical_ctx: int | None = None
    tp: int = 1  # vLLM: each instance's tensor_parallel_size
    gpu_memory_utilization: float = 0.9  # vLLM on a GPU: the share of its memory an instance takes


def make_backend(
    c: BackendConfig,
    m,
    drafter,
    sampling,
    policy,
    *,
    cost=None,
    generator=None,
    estimator=None,
    send_weights: bool = False,
    states=None,
    log=None,
) -> RolloutBackend:
    """The rollout backend `c` describes, over the loaded models `m` (`setup.Models`):

    - rlsched's engine in this process, over `drafter` with the draft policy `policy` (and
      `estimator` restored);
    - vLLM's engine in this process, with `c.policy` (or on resume `policy` and `estimator`
      restored);
    - `c.instances` of either as Ray actors, each loading the models from their folders (then
      the current weights when `send_weights`; always for vLLM), with its own copy of the
      policy or its `states` entry restored."""
    if c.instances > 1:
        return _pool(c, m, sampling, policy, cost, send_weights or c.backend == "vllm", states, log)
    if c.backend == "vllm":
        from rlsched.executor.vllm.engine import VllmRolloutEngine

        drafter_spec = m.drafter_dir if m.drafter_name in ("model", "eagle") else m.drafter_name  # folder or name
        restored = None if estimator is None else (None if policy is c.policy else policy, estimator, None)
        return VllmRolloutEngine(
            m.target_dir,
            drafter_spec,
            sampling,
            c.policy,
            max_batch=c.max_batch,
            k_max=c.k_max,
            max_len=c.max_len,
            trace_dir=c.trace_dir,
            seed=c.seed,
            threads=c.threads,
            dtype=c.dtype,
            device=c.device,
            cost=cost,
            typical_ctx=c.typical_ctx,
            probe_every=c.probe_every,
            state=restored,
            tp=c.tp,
            gpu_memory_utilization=c.gpu_memory_utilization,
            log=log,
        )
    from rlsched.executor.engine.rollout import RolloutEngine

    return RolloutEngine(
        m.target,
        drafter,
        c.capacity,
        c.max_batch,
        sampling,
        policy,
        estimator,
        trace_dir=c.trace_dir,
        k_max=c.k_max,
        generator=generator,
        share_prompts=c.share_prompts,
        probe_every=c.probe_every,
    )


def _pool(c: BackendConfig, m, sampling, policy, cost, send_weights: bool, states, log):
    """`c.instances` engines as Ray actors (`pool.instances.InstancePool`)."""
    from rlsched.executor.pool.instances import InstancePool
    from rlsched.executor.pool.worker import InstanceSpec

    vllm = c.backend == "vllm"
    spec = InstanceSpec(
        str(m.target_dir),
        m.drafter_name,
        None if m.drafter_dir is None else str(m.drafter_dir),
        sampling,
        c.policy if vllm else policy,
        c.capacity,
        c.max_batch,
        c.k_max,
        0 if vllm else c.drafter_len,
        str(c.trace_dir),
        c.device,
        c.dtype,
        c.threads,
        None if vllm else c.ngram_history,
        True if vllm else c.share_prompts,
        c.probe_every,
    )
    if vllm:
        spec = replace(
            spec,
            backend="vllm",
            max_len=c.max_len,
            seed=c.seed,
            typical_ctx=c.typical_ctx,
            cost=cost,
            tp=c.tp,
            gpu_memory_utilization=c.gpu_memory_utilization,
        )
    weights = {}
    if send_weights:
        weights = dict(
            target_state=m.target.state_dict(),
            drafter_state=None if m.drafter_model is None else m.drafter_model.state_dict(),
        )
    return InstancePool(
        c.instances,
        spec,
        realloc=c.realloc,
        threshold=c.threshold,
        cost=cost,
        seed=c.seed,
        states=states,
        log=log,
        **weights,
    )
