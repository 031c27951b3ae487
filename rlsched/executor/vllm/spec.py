"""What a vLLM engine is started with, checked before it starts: the policy's plan for the
drafter argument, the pre-flight check a caller runs before writing anything, the model's
window and vLLM's speculative_config.

How a policy runs on vLLM: vLLM's scheduler is rlsched's (`hook.PolicyScheduler`), and
- `off` (or `static:0`): plain decoding, no speculative_config;
- `static:K[:DRAFTER]`: `num_speculative_tokens = K` (K <= k_max), method `draft_model` with the
  drafter folder, or `eagle3` with an EAGLE-3 head's folder (`eagle.save_head`)
  (`draft_sample_method = probabilistic` when sampling, so rejection sampling is lossless), or
  `ngram` (prompt lookup, 1..4 tokens);
- `twostate:MAX_BATCH:K`, `twostate:FILE` (a two-state policy file), `table:FILE` where FILE is
  `rlsched learn --vllm-table` output (`{"num_speculative_tokens_per_batch_size": [[start_bs,
  end_bs, K], ...]}` or the bare list): the draft length by batch size, vLLM's own
  `num_speculative_tokens_per_batch_size`; `num_speculative_tokens` = the table's largest K;
- everything else (goodput, seqgoodput, bandit, twostate solved over the cost model, a learned
  table policy file): `num_speculative_tokens = k_max` and rlsched's DraftPolicy picks each
  step's k, or each request's, through the hook; a priced policy runs on `cost` or, without
  one, on step costs measured through the engine at start-up (`calibrate.py`).
The oracle reads the simulator's truth and is refused (`policies/registry.py`).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from rlsched.errors import UserError
from rlsched.executor.decode.sampling import SamplingParams
from rlsched.executor.setup import drafter_kind
from rlsched.executor.vllm.shims import INSTALL_HINT
from rlsched.policies import vllm_plan
from rlsched.policies.registry import PolicySpec, as_spec
from rlsched.policies.vllm_plan import NGRAM, TABLE_FIELD


def speculative_plan(policy: PolicySpec | str, drafter, *, k_max: int, max_batch: int) -> dict | None:
    """`policies.vllm_plan.speculative_plan` for the drafter `drafter` names (a folder, builtin, ...)."""
    return vllm_plan.speculative_plan(policy, drafter_kind(drafter), k_max=k_max, max_batch=max_batch)


def check_vllm_backend(
    policy: PolicySpec | str, drafter, *, k_max: int, max_batch: int, cost_model: str = "auto"
) -> dict | None:
    """Everything a vLLM rollout needs that can be checked without starting vLLM (for a caller
    that must refuse bad input before writing anything): the policy's plan, that a priced
    policy can be priced (step costs are measured at start-up with a model drafter only: an
    n-gram drafter's drafts are as long as its matches), and that vllm is importable.
    UserError otherwise, one line."""
    policy = as_spec(policy, "vllm")
    plan = speculative_plan(policy, drafter, k_max=k_max, max_batch=max_batch)
    if plan is not None and plan["drafter"] == "ngram" and cost_model == "auto" and policy.priced:
        raise UserError(
            f"policy '{policy}' prices steps, and with the ngram drafter vLLM's step costs cannot be "
            "measured at start-up; set cost_model to a folder (`rlsched fit` of a vLLM run)"
        )
    if importlib.util.find_spec("vllm") is None:
        raise UserError(f"rollout.backend vllm needs vLLM, which is not installed here; {INSTALL_HINT}")
    return plan


def check_device(device: str, platform) -> None:
    """The run's `device` against the device vLLM's build runs on (`platform`: vLLM's
    current_platform); UserError, one line, where they differ. vLLM picks its GPU itself
    (CUDA_VISIBLE_DEVICES), so a device index other than 0 is refused too."""
    kind, _, index = device.partition(":")
    built = str(platform.device_type)
    if kind != built or index not in ("", "0"):
        raise UserError(
            f"device '{device}': the vLLM build here runs on '{built}'; set device {built} (choose a GPU "
            "with CUDA_VISIBLE_DEVICES), or install the vLLM build for your device"
        )


def model_window(target_dir: Path, max_len: int) -> int:
    """vLLM's max_model_len for a target in `target_dir` sized for `max_len` tokens; UserError
    when the model's positions cannot hold that many. The window is fixed at start-up (KV blocks
    are allocated on demand, so room to spare costs little): twice what the trainer sized for,
    for prompts longer than its first sweep saw."""
    raw = json.loads((target_dir / "config.json").read_text())
    limit = int(raw.get("max_position_embeddings") or max_len)
    if max_len > limit:
        raise UserError(
            f"rollout: the longest prompt + max_tokens + k_max ({max_len} tokens) exceed the model's "
            f"max_position_embeddings ({limit}); lower rollout.max_tokens"
        )
    return min(limit, max(2 * max_len, 256))


def vocab_size(target_dir: Path) -> int:
    """The target's vocabulary size (vLLM refuses a config.json without it as it starts)."""
    return int(json.loads((target_dir / "config.json").read_text())["vocab_size"])


def speculative_config(plan: dict | None, policy, drafter, sampling: SamplingParams, vllm) -> dict | None:
    """vLLM's speculative_config for a `speculative_plan` (None: plain decoding); UserError when
    the installed `vllm` lacks the batch-size table the plan needs."""
    if plan is None:
        return None
    if plan["table"] is not None:
        from vllm.config import SpeculativeConfig

        fields = getattr(SpeculativeConfig, "model_fields", None) or getattr(
            SpeculativeConfig, "__dataclass_fields__", {}
        )
        if TABLE_FIELD not in fields:
            raise UserError(
                f"policy '{policy}' picks the draft length by batch size, but the installed vLLM "
                f"{vllm.__version__} has no speculative_config.{TABLE_FIELD} (0.32 has it); "
                "upgrade vLLM or use static:K"
            )
    if plan["drafter"] == "ngram":
        spec = dict(NGRAM, num_speculative_tokens=plan["k"])
    else:
        spec = {
            "method": "eagle3" if plan["drafter"] == "eagle" else "draft_model",
            "model": str(drafter),
            "num_speculative_tokens": plan["k"],
            "draft_sample_method": "greedy" if sampling.greedy else "probabilistic",
        }
    if plan["table"] is not None:
        spec[TABLE_FIELD] = [tuple(e) for e in plan["table"]]
    return spec
