"""The rollout backend: what the trainer drives to generate, whichever engine does it.

Three implement it: `engine.RolloutEngine` (one instance in this process), `pool.InstancePool`
(several on Ray) and `vllm_backend.VllmRolloutEngine` (vLLM's offline engine). Each method has
the same signature in all three; a backend with nothing to do for one says so in its own
docstring and does nothing, so callers never ask which backend they hold.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from rlsched.executor.engine.rollout import Request, RolloutResult


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
