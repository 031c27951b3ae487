"""The model runner's drafting, timed where it runs and handed to the scheduler with its output.

vLLM's model runner proposes the next drafts inside a step (`propose_draft_token_ids`), in the
worker process, which is the engine core's own only with the single-process executor; the
scheduler, where rlsched's hook runs, sees the step's `ModelRunnerOutput`. `patch_runner`
wraps vLLM's GPU model runner class (the CPU runner is a subclass) so that each step's output
carries the seconds its propose calls took (`draft_seconds`); the attribute travels with the
output wherever the executor sends it (pickled between processes).

Where it is applied: `register`, vLLM's general-plugin entry point (`vllm.general_plugins`,
declared in pyproject.toml), which vLLM calls in every process it starts, workers included;
and the scheduler itself, for the workers in its own process. An output without it (rlsched
not installed where the workers run) leaves a step's drafting untimed, and the step record
says so (NaN draft and verify times).
"""

from __future__ import annotations

import time

ATTR = "rlsched_draft_s"


def register() -> None:
    """vLLM's general-plugin entry point: time the model runner's drafting in this process; on
    vLLM's CPU build, also mend its sampled rejection sampler (`shims.patch_cpu_rejection_sampler`),
    without which sampled speculative decoding verifies against garbage in every process, and
    where `shims.KEEP_WEIGHTS` is set, keep the linear layers' weights for weight updates."""
    import os

    patch_runner()
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from rlsched.executor.vllm.shims import KEEP_WEIGHTS, keep_cpu_linear_weights, patch_cpu_rejection_sampler

        patch_cpu_rejection_sampler()
        if os.environ.get(KEEP_WEIGHTS) == "1":
            keep_cpu_linear_weights()


def draft_seconds(output) -> float | None:
    """The seconds a step's propose calls took, as its ModelRunnerOutput carries them."""
    return getattr(output, ATTR, None)


def _attach(runner, out):
    """Put the drafting since the last output on this output (an async output: on the output
    it yields)."""
    if out is None:
        return out
    if hasattr(out, "get_output") and not hasattr(out, "sampled_token_ids"):
        get = out.get_output
        seconds, runner._rlsched_draft = runner.__dict__.get("_rlsched_draft", 0.0), 0.0

        def get_output():
            real = get()
            setattr(real, ATTR, seconds)
            return real

        out.get_output = get_output
        return out
    try:
        setattr(out, ATTR, runner.__dict__.get("_rlsched_draft", 0.0))
    except (AttributeError, TypeError):  # a shared constant (vLLM's EMPTY_MODEL_RUNNER_OUTPUT)
        return out
    runner._rlsched_draft = 0.0
    return out


def patch_runner() -> bool:
    """Wrap GPUModelRunner's propose, execute and sample calls (once per process). Returns
    whether a patch was applied."""
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:
        return False
    if getattr(GPUModelRunner.propose_draft_token_ids, "_rlsched", False):
        return False
    propose, execute, sample = (
        GPUModelRunner.propose_draft_token_ids,
        GPUModelRunner.execute_model,
        GPUModelRunner.sample_tokens,
    )

    def propose_draft_token_ids(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return propose(self, *args, **kwargs)
        finally:
            self._rlsched_draft = self.__dict__.get("_rlsched_draft", 0.0) + time.perf_counter() - t

    def execute_model(self, *args, **kwargs):
        return _attach(self, execute(self, *args, **kwargs))

    def sample_tokens(self, *args, **kwargs):
        return _attach(self, sample(self, *args, **kwargs))

    for f in (propose_draft_token_ids, execute_model, sample_tokens):
        f._rlsched = True  # type: ignore[attr-defined]
    GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids
    GPUModelRunner.execute_model = execute_model
    GPUModelRunner.sample_tokens = sample_tokens
    return True
