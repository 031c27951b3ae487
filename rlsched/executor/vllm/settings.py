"""The `rlsched` block of a vLLM engine's `additional_config`, and what is built from it in the
engine-core process: the engine's facts (drafter, k_max, batch limit, tp), the cost model a
priced policy prices steps with, the policy itself, and the engine file of the trace folder.
`scheduler.py` says how a user writes the block."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rlsched.atomic import check_writable, json_text, write_text_atomic
from rlsched.errors import UserError, describe_validation_error
from rlsched.policies.probe import PROBE_EVERY
from rlsched.policies.registry import as_spec, run_words

KEY = "rlsched"  # additional_config[KEY]
DRAFTERS = {"draft_model": "model", "eagle3": "eagle", "eagle": "eagle", "ngram": "ngram"}


class EngineHookConfig(BaseModel):
    """`additional_config["rlsched"]`: what rlsched adds to a vLLM engine."""

    model_config = ConfigDict(extra="forbid")

    policy: str | None = Field(
        None,
        description="a policy name or spec (goodput, static:K, ...) or a policy file; none: vLLM's own draft "
        "length (the engine's records only), until a client hands a policy over (`engine_hook.ask`)",
    )
    cost_model: str | None = Field(
        None, description="a `rlsched fit` cost file, or a hardware preset (the served model's roofline on it)"
    )
    trace_dir: str | None = Field(None, description="folder of the engine core's step and sample records")
    probe_every: int | None = Field(PROBE_EVERY, ge=1)
    seed: int = Field(0, ge=0)


def hook_config(vllm_config) -> EngineHookConfig | None:
    """The engine's `rlsched` block (None: vLLM as is); UserError naming the field."""
    extra = vllm_config.additional_config or {}
    block = extra.get(KEY) if isinstance(extra, dict) else None
    if block is None:
        return None
    where = f"additional_config.{KEY}"
    if not isinstance(block, dict):
        raise UserError(f'{where} must be a mapping such as {{"policy": "goodput"}} (got {type(block).__name__})')
    unknown = [k for k in block if k not in EngineHookConfig.model_fields]
    if unknown:
        raise UserError(
            f"{where} has an unknown field {unknown[0]!r}; its fields are {', '.join(EngineHookConfig.model_fields)}"
        )
    try:
        return EngineHookConfig.model_validate(block)
    except ValidationError as e:
        raise UserError(describe_validation_error(e, prefix=where)) from None


def engine_facts(vllm_config) -> dict:
    """What the policy is built for, from vLLM's config: drafter, k_max, batch limit, tp, model."""
    spec = vllm_config.speculative_config
    method = None if spec is None else spec.method
    if method is not None and method not in DRAFTERS:
        raise UserError(
            f"speculative_config.method {method!r}: rlsched's policies choose the draft length of "
            f"{', '.join(DRAFTERS)} drafters"
        )
    parallel = vllm_config.parallel_config
    drafter = DRAFTERS[method] if method else "off"
    return dict(
        drafter=drafter,
        name=drafter,
        k_max=int(spec.num_speculative_tokens) if spec is not None else 0,
        max_batch=int(vllm_config.scheduler_config.max_num_seqs),
        tp=int(parallel.tensor_parallel_size),
        rank=int(getattr(parallel, "data_parallel_index", None) or parallel.data_parallel_rank or 0),
        model=str(vllm_config.model_config.model),
        max_len=int(vllm_config.model_config.max_model_len),
        world=int(parallel.world_size),
    )


def write_engine_file(folder: Path, tag: str, cfg: EngineHookConfig, vllm_config, facts: dict) -> None:
    """`engine-<tag>.json` in the trace folder: what this engine ran (rlsched's settings, the
    policy named as `static:<num_speculative_tokens>` while vLLM's own draft length runs, and
    vLLM's own scheduling arguments), for `replay` and `report`. The folder's parent must exist."""
    import vllm

    where = f"additional_config.{KEY}.trace_dir"
    if not folder.absolute().parent.is_dir():
        raise UserError(f"{where} '{folder}': its parent folder does not exist; create it or name another")
    check_writable(folder, where)
    sched = vllm_config.scheduler_config
    own = f"static:{facts['k_max']}" if facts["drafter"] != "off" else "off"  # vLLM's own draft length
    record = dict(
        format="rlsched-engine",
        version=1,
        rlsched={**cfg.model_dump(), "policy": cfg.policy or own},
        **{k: facts[k] for k in ("drafter", "name", "k_max", "max_batch", "tp", "rank", "model", "max_len")},
        vllm=vllm.__version__,
        max_num_batched_tokens=int(sched.max_num_batched_tokens),
        enable_chunked_prefill=bool(sched.enable_chunked_prefill),
        enable_prefix_caching=bool(vllm_config.cache_config.enable_prefix_caching),
        async_scheduling=bool(sched.async_scheduling),
        enforce_eager=bool(vllm_config.model_config.enforce_eager),
        cudagraph_capture_sizes=list(vllm_config.compilation_config.cudagraph_capture_sizes or []),
        block_size=int(vllm_config.cache_config.block_size),
        pid=os.getpid(),
        own_process=multiprocessing.parent_process() is not None,  # the engine core apart from its client
        started=time.time(),
    )
    folder.mkdir(parents=True, exist_ok=True)
    write_text_atomic(folder / f"engine-{tag}.json", json_text(record) + "\n")


def model_spec(hf_config, name: str):
    """The simulator's ModelSpec of an HF config (the roofline's architecture numbers)."""
    from rlsched.config import ModelSpec

    heads = int(hf_config.num_attention_heads)
    return ModelSpec(
        name=name,
        hidden=int(hf_config.hidden_size),
        layers=int(hf_config.num_hidden_layers),
        heads=heads,
        kv_heads=int(getattr(hf_config, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads),
        intermediate=int(hf_config.intermediate_size),
        vocab=int(hf_config.vocab_size),
        tied_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
    )


def engine_cost_model(text: str | None, vllm_config, facts: dict):
    """The cost model of `cost_model`: a fit file's, or the roofline of the served model (and
    its draft model) on a hardware preset at vLLM's tensor parallelism."""
    if text is None:
        return None
    drafter, name = facts["drafter"], facts["name"]
    if text.endswith(".json") or os.sep in text or Path(text).exists():
        from rlsched.costs.costfile import load_cost_model

        return load_cost_model(Path(text), drafters=[name] if drafter != "off" else [])
    from rlsched.config import AcceptanceSpec, DrafterSpec, HardwareSpec, load_preset_data
    from rlsched.costs.roofline import RooflineCostModel

    try:
        hardware = HardwareSpec.model_validate(load_preset_data("hardware", text))
    except UserError as e:
        raise UserError(f"additional_config.{KEY}.cost_model: {e}") from None
    drafters = []
    if drafter != "off":
        spec = vllm_config.speculative_config
        draft = model_spec(spec.draft_model_config.hf_config, "drafter") if drafter == "model" else None
        drafters.append(DrafterSpec(name=name, kind=drafter, model=draft, acceptance=AcceptanceSpec(mean=0.6)))
    target = model_spec(vllm_config.model_config.hf_config, facts["model"])
    return RooflineCostModel(hardware, target, drafters, facts["tp"])


def make_policy(cfg: EngineHookConfig, vllm_config, facts: dict):
    """rlsched's DraftPolicy for this engine (None: vLLM's own draft length), checked against
    the served model (a policy file learned for another architecture is refused). The engine's
    one drafter is named by its kind (`facts["name"]`), or as a policy file names its drafter."""
    from rlsched.policies.draft import PolicyContext
    from rlsched.policies.policyfile import SHAPE_KEYS, check_model_shape, load_policy_file
    from rlsched.policies.registry import make_draft_policy

    where = f"additional_config.{KEY}.policy"
    if cfg.policy is None:
        return None
    try:
        spec = as_spec(cfg.policy, "vllm")
    except UserError as e:
        raise UserError(f"{where}: {e}") from None
    if spec.drafts and facts["drafter"] == "off":
        raise UserError(f"{where} '{spec}' drafts, but the engine has no speculative_config; add one")
    if spec.file is not None:
        served = model_spec(vllm_config.model_config.hf_config, facts["model"])
        shape = {k: getattr(served, k) for k in SHAPE_KEYS}
        pf = load_policy_file(spec.file, kinds=(spec.family,) if spec.family else ("table", "twostate"))
        check_model_shape(pf, spec.file, shape, facts["model"])
        facts["name"] = pf.drafter  # the engine's one drafter, as the file names it
    cost = engine_cost_model(cfg.cost_model, vllm_config, facts)
    if spec.priced and cost is None:
        raise UserError(
            f"{where} '{spec}' prices steps: set additional_config.{KEY}.cost_model to a `rlsched fit` "
            "cost file or a hardware preset (h100-sxm, h200, a100-80gb)"
        )
    if not spec.drafts:
        return None
    ctx = PolicyContext(
        cost,
        (facts["name"],),
        k_max=facts["k_max"],
        max_batch=facts["max_batch"],
        typical_ctx=facts["max_len"] // 2,
        seed=cfg.seed,
        calibrate=True,
    )
    return make_draft_policy(spec, ctx, run_words("vllm"))
