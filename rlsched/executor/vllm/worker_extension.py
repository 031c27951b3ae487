"""rlsched's calls in vLLM's workers (`WorkerExtension`): the trainer's weights in, the
sampler's seed.

vLLM mixes the class named by `worker_extension_cls` into every worker it starts, and
`LLM.collective_rpc(NAME, args=...)` calls a method by name on each of them, in whichever
process they run (the way RL frameworks add their weight-update calls). The weights travel as
safetensors bytes (`pack`): plain data through vLLM's serialization, no pickled code.

On vLLM's CPU build the linear layers' checkpoint-format weights are kept at load time
(`shims.keep_cpu_linear_weights`, applied by the plugin in every process when
`RLSCHED_VLLM_KEEP_WEIGHTS=1`, which `shims.start_llm` sets for the engines it starts) and
packed again after every update.
"""

from __future__ import annotations


def pack(weights: dict | None) -> bytes | None:
    """Named tensors as safetensors bytes (None stays None)."""
    from safetensors.torch import save

    return None if weights is None else save({k: v.detach().contiguous().cpu() for k, v in weights.items()})


def unpack(blob: bytes | None) -> dict | None:
    from safetensors.torch import load

    return None if blob is None else load(bytes(blob))


def trainer_weights(model, drafter_model=None) -> tuple[dict, dict | None]:
    """The trainer's actor and drafter (a draft model, or an EAGLE-3 head) as vLLM loads them:
    HF names (`saving.hf_state_dict`), a head's under its checkpoint names (`eagle.vllm_weights`)."""
    from rlsched.executor.decode.eagle import EagleHead, vllm_weights
    from rlsched.executor.model.saving import hf_state_dict

    draft = None
    if isinstance(drafter_model, EagleHead):
        draft = vllm_weights(drafter_model.state_dict(), drafter_model.config)
    elif drafter_model is not None:
        draft = hf_state_dict(drafter_model)
    return hf_state_dict(model), draft


class WorkerExtension:
    """Methods vLLM adds to its workers (`worker_extension_cls`)."""

    def rlsched_seed(self, seed: int) -> None:
        """Seed torch's generator in the worker's process, which vLLM samples from."""
        import torch

        torch.manual_seed(seed)

    def rlsched_load_weights(self, target: bytes, draft: bytes | None = None) -> None:
        """Weights under HF names (`pack`ed) into the worker's target model and, with `draft`,
        its drafter's model (a draft model, or an EAGLE-3 head under its checkpoint names)."""
        from vllm.platforms import current_platform

        from rlsched.executor.vllm.shims import repack_cpu_linears

        runner = self.model_runner  # type: ignore[attr-defined]
        drafter = getattr(runner, "drafter", None)
        for model, weights in ((runner.model, unpack(target)), (getattr(drafter, "model", None), unpack(draft))):
            if model is not None and weights is not None:
                model.load_weights(iter(weights.items()))
                if current_platform.is_cpu():
                    repack_cpu_linears(model)
