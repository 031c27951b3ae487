"""Validated configuration: hardware, models, drafters, workload, cluster, speculation and RL.

Configs are YAML or TOML files (or shipped presets) validated by pydantic; hardware and model
fields may name a shipped preset (`h100-sxm`, `qwen2.5-7b`) or spell the spec inline.
`--set path.to.field=value` overrides are applied to the raw data before validation, so an
override is checked exactly like a file.
"""

from __future__ import annotations

import copy
import re
import tomllib
from collections.abc import Sequence
from functools import cached_property
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    ValidationError,
    field_validator,
    model_validator,
)

from rlsched.engine_config import EngineSpec
from rlsched.errors import UserError, describe_validation_error, printable
from rlsched.policies.registry import PolicySpec, as_spec

Fraction = Annotated[float, Field(ge=0.0, le=1.0)]
OpenFraction = Annotated[float, Field(gt=0.0, le=1.0)]
Positive = Annotated[float, Field(gt=0.0)]
PosInt = Annotated[int, Field(gt=0)]
NonNeg = Annotated[float, Field(ge=0.0)]


def policy_spec(value, engine: str = "simulator") -> PolicySpec:
    """A policy field's value parsed once (YAML reads a bare `off` as false: the name off)."""
    if value is False:
        value = "off"
    if not isinstance(value, (str, PolicySpec)):
        hint = "; YAML reads a name ending in ':' as a mapping: quote it" if isinstance(value, dict) else ""
        raise ValueError(
            f"a policy is a name given as text, such as goodput, static:4 or table:FILE (got {value!r}){hint}"
        )
    return as_spec(value, engine)


# a drafting policy: parsed where the config is read, written back as its text
Policy = Annotated[PolicySpec, PlainValidator(policy_spec), PlainSerializer(str)]


class Strict(BaseModel):
    # numbers must be finite: an infinite peak or a NaN floor has no meaning and would reach
    # the outputs as NaN
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


# ----------------------------------------------------------------------------- presets


_PRESET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # a file name in the presets folder, never a path


def _preset_dir(kind: str):
    return resources.files("rlsched.presets").joinpath(kind)


def preset_names(kind: str) -> list[str]:
    """Names of the shipped presets of one kind: hardware, models or jobs."""
    return sorted(p.name[:-5] for p in _preset_dir(kind).iterdir() if p.name.endswith(".yaml"))


def load_preset_data(kind: str, name: str) -> dict:
    """The raw fields of the shipped preset `name` of `kind` (jobs, hardware, models, ...)."""
    path = _preset_dir(kind).joinpath(f"{name}.yaml") if _PRESET_NAME.fullmatch(name) else None
    if path is None or not path.is_file():
        raise ValueError(f"unknown {kind} preset '{printable(name)}'; known: {', '.join(preset_names(kind))}")
    return yaml.safe_load(path.read_text())


def _resolve(kind: str, value: Any) -> Any:
    return load_preset_data(kind, value) if isinstance(value, str) else value


# ----------------------------------------------------------------------------- specs


class HardwareSpec(Strict):
    """One accelerator: peaks, achievable fractions of them, and fixed overheads."""

    name: str
    description: str = ""
    # bounds far above any accelerator: a typo's 1e30 fails here, not as an overflow inside
    peak_tflops: Annotated[float, Field(gt=0.0, le=1e6)]
    mem_bw_gbs: Annotated[float, Field(gt=0.0, le=1e6)]
    memory_gib: Annotated[float, Field(gt=0.0, le=1e6)]
    compute_efficiency: OpenFraction = 0.74  # of peak, large matmuls
    memory_efficiency: OpenFraction = 0.94  # of peak bandwidth, matmuls reading their weights
    linear_floor_us: NonNeg = 4.2  # per matmul kernel
    linear_knee: Annotated[float, Field(ge=1.0)] = 1.34  # sharpness of a matmul's memory-to-compute turn
    elementwise_efficiency: OpenFraction = 0.54  # of peak bandwidth: norms, rope, activation, residual add
    elementwise_floor_us: NonNeg = 1.3  # per element-wise kernel
    elementwise_row_gbs: Positive = 11.7  # one token's row in one thread block (few tokens)
    attention_efficiency: OpenFraction = 0.75  # of peak bandwidth, reading the KV cache
    attention_floor_us: NonNeg = 15.9  # per attention kernel
    step_overhead_ms: NonNeg = 0.3  # per engine step: scheduling, sampling, launch
    forward_overhead_ms: NonNeg = 0.08  # per extra forward inside a step (draft forwards)
    nvlink_gbs: Positive = 339.0  # per-GPU all-reduce bus bandwidth inside a TP group
    allreduce_latency_us: NonNeg = 28.0
    migrate_link_gbs: Positive = 25.0  # between instances, for KV-cache migration
    migrate_latency_ms: NonNeg = 2.0
    # GPU <-> host memory per GPU (pinned copies over PCIe): training states offloaded for a rollout
    host_link_gbs: Positive = 25.0
    host_draft_us_per_seq: NonNeg = 4.0  # n-gram/suffix drafting on the host
    host_draft_base_us: NonNeg = 50.0


class ModelSpec(Strict):
    """A decoder-only transformer (Llama/Qwen family) by its architecture numbers."""

    name: str
    description: str = ""
    hidden: PosInt
    layers: PosInt
    heads: PosInt
    kv_heads: PosInt
    head_dim: PosInt
    intermediate: PosInt
    vocab: PosInt
    tied_embeddings: bool = False
    dtype_bytes: PosInt = 2
    # another model's hidden states taken in (an EAGLE-3 head fuses 3 of its target's layers):
    # a projection of fused_inputs x hidden to hidden per token, and a first layer whose QKV
    # reads the token's embedding beside it (2 x hidden)
    fused_inputs: Annotated[int, Field(ge=0)] = 0

    @cached_property
    def layer_params(self) -> int:
        h, attn, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return h * attn + 2 * h * kv + attn * h + 3 * h * self.intermediate

    @cached_property
    def fusion_params(self) -> int:
        """The weights that take in another model's hidden states (`fused_inputs`)."""
        if not self.fused_inputs:
            return 0
        return (
            self.fused_inputs * self.hidden * self.hidden
            + self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim
        )

    @cached_property
    def matmul_params(self) -> int:
        """Weights touched by matrix multiplies each forward: all layers and the LM head."""
        return self.layers * self.layer_params + self.fusion_params + self.vocab * self.hidden

    @cached_property
    def params(self) -> int:
        """Total parameters, embeddings included once when tied."""
        embed = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return self.layers * self.layer_params + self.fusion_params + embed

    @cached_property
    def weight_bytes(self) -> int:
        return self.params * self.dtype_bytes

    @cached_property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @cached_property
    def attn_dim(self) -> int:
        return self.heads * self.head_dim


def eagle_head(target: ModelSpec, draft_vocab: int = 32000) -> ModelSpec:
    """An EAGLE-3 draft head for `target`: one decoder layer of the target's shape fed three of
    the target's hidden states (fused to one) beside the token's embedding, and an LM head over
    a reduced draft vocabulary (the embedding is the target's, read by row, not multiplied)."""
    data = target.model_dump() | {
        "name": f"{target.name}-eagle3",
        "layers": 1,
        "tied_embeddings": True,
        "fused_inputs": 3,
        "vocab": min(draft_vocab, target.vocab),
        "description": f"EAGLE-3 head for {target.name}, {draft_vocab} draft tokens",
    }
    return ModelSpec.model_validate(data)  # not model_copy: that would keep the target's cached sizes


class AcceptanceSpec(Strict):
    """Acceptance of a drafter's first draft token: prompt-level Beta around `mean`, sample-level
    Beta around the prompt's value. A concentration of None means no spread at that level."""

    mean: Fraction
    prompt_concentration: Positive | None = 20.0
    sample_concentration: Positive | None = 50.0
    # for draft trees: the share of what the drafter's top candidates miss that its next
    # candidate at the same depth catches (policies/tree.py); the top-r hit rate is
    # 1 - (1 - mean)(1 - tree_gain)^(r - 1)
    tree_gain: Annotated[float, Field(gt=0.0, lt=1.0)] = 0.25
    # a tree's candidates are the drafter's top tokens, not samples from it: its rank-1 child is taken
    # with probability tree_top1 x mean. 1 under greedy decoding (the same token); below 1 when sampling,
    # where a chain draft is accepted with sum_x min(p, q) (bench/tree_hits.py measures both)
    tree_top1: OpenFraction = 1.0
    position_decay: Annotated[float, Field(gt=0.0, le=2.0)] = 1.0  # draft i: mean x decay^(i-1) <= 1 (position.py)


class DrafterSpec(Strict):
    name: str
    kind: Literal["model", "eagle", "ngram"]
    model: ModelSpec | None = None  # required for kind=model
    acceptance: AcceptanceSpec
    # kind=eagle: the head's draft vocabulary (EAGLE-3 heads draft over the target's most
    # frequent tokens: 32000 in the published Llama-3.1-8B and Qwen heads)
    draft_vocab: PosInt = 32000

    @field_validator("model", mode="before")
    @classmethod
    def _preset(cls, v):
        return _resolve("models", v)

    @model_validator(mode="after")
    def _needs_model(self):
        if self.kind == "model" and self.model is None:
            raise ValueError("a drafter of kind 'model' needs a model (a preset name such as qwen2.5-0.5b)")
        return self


class FixedLength(Strict):
    dist: Literal["fixed"] = "fixed"
    value: PosInt


class LognormalLength(Strict):
    """Lognormal lengths capped at `max`; `group_sigma` spreads the medians of prompt groups,
    so the samples of one prompt are correlated (some prompts draw long answers, others short)."""

    dist: Literal["lognormal"] = "lognormal"
    median: Positive
    sigma: NonNeg = 0.8
    group_sigma: NonNeg = 0.0
    min: PosInt = 1
    max: PosInt

    @model_validator(mode="after")
    def _range(self):
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) must not exceed max ({self.max})")
        return self


class EmpiricalLength(Strict):
    dist: Literal["empirical"] = "empirical"
    values: Annotated[list[PosInt], Field(min_length=1)]
    max: PosInt | None = None


LengthDist = Annotated[FixedLength | LognormalLength | EmpiricalLength, Field(discriminator="dist")]


def length_max(d: LengthDist) -> int:
    """The longest length a distribution draws."""
    return d.value if d.dist == "fixed" else d.max if d.dist == "lognormal" else d.max or max(d.values)


class WorkloadSpec(Strict):
    """GRPO-style: `prompts` x `samples_per_prompt` sequences per RL step."""

    prompts: PosInt
    samples_per_prompt: PosInt = 1
    prompt_len: LengthDist
    response_len: LengthDist


class ClusterSpec(Strict):
    instances: PosInt = 1
    tp: PosInt = 1
    max_batch: PosInt = 256
    kv_capacity_tokens: PosInt | None = None  # None: derived from memory, weights and KV size
    gpu_memory_utilization: OpenFraction = 0.9
    activation_reserve_gib: Annotated[float, Field(ge=0.0, le=1e6)] = 2.0
    assignment: Literal["round_robin", "by_prompt"] = "round_robin"
    realloc: str = "none"
    realloc_threshold: PosInt = 16  # an instance whose batch falls below this asks for work
    # samples of a prompt share its prefill while one is on the instance (`replay` sets it from the run)
    share_prompts: bool = False


class SpeculationSpec(Strict):
    policy: Policy = as_spec("goodput")
    k_max: Annotated[int, Field(ge=1, le=32)] = 8
    # off steps in a row (across rollouts) after which a policy that prices acceptance drafts
    # once (`policies/probe.py`); None: never. The executor probes by default (every 64):
    # `replay` sets what the run did.
    probe_every: Annotated[int, Field(ge=1)] | None = None
    # draft trees (policies/tree.py): policies that choose also consider trees up to this
    # width (SGLang's topk; 1: chains only, as vLLM drafts) and up to
    # nodes_max draft tokens (SGLang's num_draft_tokens - 1), k_max deep
    width_max: Annotated[int, Field(ge=1, le=16)] = 1
    nodes_max: Annotated[int, Field(ge=2, le=256)] = 32


class RLSpec(Strict):
    """The RL step around generation, and how acceptance drifts across steps."""

    steps: PosInt = 1
    acceptance_drift_per_step: NonNeg = 0.0  # mean acceptance lost per RL step without update
    acceptance_floor: Fraction = 0.05
    drafter_update_interval: Annotated[int, Field(ge=0)] = 0  # 0: never update the drafter
    # every: each drafter_update_interval steps; pays: the first after the interval, then once the
    # generation time staleness has cost adds up to the last update's exposed cost (ski rental,
    # policies/drafter_schedule.py, as `rlsched run` does)
    drafter_update_schedule: Literal["every", "pays"] = "every"
    drafter_recovery: Fraction = 1.0  # fraction of lost acceptance an update wins back
    overlap_drafter_update: bool = True
    distill_fraction: OpenFraction = 1.0  # share of the last rollout's tokens distilled on
    reference: bool = True
    # the actor's own forward over each rollout for the old-policy log-probs of the PPO/GRPO ratio
    # (verl's actor.compute_log_prob, "old_log_prob"), in the inference stage beside the reference's
    recompute_old_logprobs: bool = True
    critic: bool = False
    reward_model: ModelSpec | None = None  # None: verifiable rewards (no forward)
    # GPUs the inference and training stages run on, apart from the rollout's (a split placement:
    # the rollout instances wait while they run, as a synchronous RL step does); None: colocated,
    # on the rollout's GPUs
    train_gpus: PosInt | None = None
    # colocated: training's sharded states (16 bytes a parameter) go to host memory for each
    # rollout and come back before training (verl's param and optimizer offload), so the rollout
    # may take the memory they held; priced in the training stage over hardware.host_link_gbs
    offload_states: bool = False
    infer_efficiency: OpenFraction = 0.5
    train_efficiency: OpenFraction = 0.3  # achieved MFU of RL training (FSDP, recomputation)

    @field_validator("reward_model", mode="before")
    @classmethod
    def _preset(cls, v):
        return _resolve("models", v)


class SimConfig(Strict):
    name: str = "custom"
    description: str = ""
    hardware: HardwareSpec
    model: ModelSpec
    drafters: list[DrafterSpec] = []
    workload: WorkloadSpec
    cluster: ClusterSpec = ClusterSpec()
    speculation: SpeculationSpec = SpeculationSpec()
    rl: RLSpec = RLSpec()
    engine: EngineSpec = EngineSpec()  # rlsched's engine or vLLM V1's (engine_config.py)
    seed: Annotated[int, Field(ge=0)] = 0
    record_timeline: bool = True
    # Longest run of identical engine steps simulated in one go (the same steps, draws and
    # decisions as step by step, times equal up to float rounding; 1 turns it off).
    max_steady_run: PosInt = 256
    # A fitted cost-model file (`rlsched fit`, `--cost`): verify, draft and prefill times of
    # the profiled machine and models instead of the roofline of `hardware` and `model`
    # (which still set KV capacity, KV transfer and the RL step's other stages).
    cost_file: str | None = None

    @field_validator("hardware", mode="before")
    @classmethod
    def _hw(cls, v):
        return _resolve("hardware", v)

    @field_validator("model", mode="before")
    @classmethod
    def _model(cls, v):
        return _resolve("models", v)

    @model_validator(mode="after")
    def _unique_drafters(self):
        names = [d.name for d in self.drafters]
        if len(set(names)) != len(names):
            raise ValueError(f"drafter names must be unique, got {names}")
        if "off" in names:
            raise ValueError("'off' is reserved and cannot name a drafter")
        return self

    def drafter(self, name: str) -> DrafterSpec:
        for d in self.drafters:
            if d.name == name:
                return d
        raise KeyError(name)


# ----------------------------------------------------------------------------- loading

_PRESET_KEYS = {"hardware": "hardware", "model": "models", "reward_model": "models"}


def read_config_file(path: Path) -> dict:
    """Raw data of a YAML or TOML config file; one clear line when it cannot be read."""
    if path.is_dir():
        raise UserError(f"config file '{path}' is a folder; pass a .yaml/.toml file in it or --preset NAME")
    if not path.is_file():
        raise UserError(f"config file '{path}' does not exist; pass an existing .yaml/.toml file or --preset NAME")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(
            f"config file '{path}' is not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}); "
            "give a YAML or TOML file saved as UTF-8"
        ) from None
    except OSError as e:
        raise UserError(f"config file '{path}' cannot be read ({e.strerror}); check its permissions") from None
    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else yaml.safe_load(text)
    except (yaml.YAMLError, tomllib.TOMLDecodeError) as e:
        where = getattr(e, "problem_mark", None)
        line = f" at line {where.line + 1}" if where is not None else ""
        raise UserError(f"config file '{path}' is malformed{line}: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise UserError(f"config file '{path}' must hold a mapping of fields at the top level")
    return data


def apply_override(data: dict, assignment: str) -> None:
    """Apply one `path.to.field=value` to raw config data (value parsed as YAML)."""
    if "=" not in assignment:
        raise UserError(f"--set '{assignment}' must look like path.to.field=value")
    path, raw = assignment.split("=", 1)
    keys = path.strip().split(".")
    if not all(keys):
        raise UserError(f"--set '{assignment}': empty component in path '{path}'")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    node: Any = data
    key: str | int
    for i, key in enumerate(keys[:-1]):
        where = ".".join(keys[: i + 1])
        if isinstance(node, list):
            if not key.isdigit() or int(key) >= len(node):
                raise UserError(f"--set '{path}': '{where}' is not an index of a list of {len(node)}")
            key = int(key)
        elif not isinstance(node, dict):
            raise UserError(f"--set '{path}': '{'.'.join(keys[:i])}' is a value, not a section")
        else:
            child = node.get(key)
            if isinstance(child, str) and key in _PRESET_KEYS:  # expand a preset name to edit inside it
                try:
                    node[key] = load_preset_data(_PRESET_KEYS[key], child)
                except ValueError as e:
                    raise UserError(f"--set '{path}': {e}") from None
            elif child is None:
                node[key] = {}
        node = node[key]
    last = keys[-1]
    if isinstance(node, list):
        if not last.isdigit() or int(last) >= len(node):
            raise UserError(f"--set '{path}': '{last}' is not an index of a list of {len(node)}")
        node[int(last)] = value
    elif isinstance(node, dict):
        node[last] = value
    else:
        raise UserError(f"--set '{path}': '{'.'.join(keys[:-1])}' is a value, not a section")


def build_config(
    data: dict, overrides: Sequence[str] = (), source: str = "config", model: type[BaseModel] | None = None
):
    """`model` (default SimConfig) validated from raw data with `--set` overrides applied; one
    UserError line naming the field when it does not validate."""
    data = copy.deepcopy(data)
    for o in overrides:
        apply_override(data, o)
    try:
        return (model or SimConfig).model_validate(data)
    except ValidationError as e:
        raise UserError(f"{source}: {describe_validation_error(e, data=data)}") from None


def load_config(preset: str | None = None, config: Path | None = None, overrides: Sequence[str] = ()) -> SimConfig:
    """The config from a preset name or a file (not both), with overrides applied."""
    if preset and config:
        raise UserError("give either --preset or --config, not both")
    if config is not None:
        return build_config(read_config_file(Path(config)), overrides, source=str(config))
    name = preset or "default"
    try:
        data = load_preset_data("jobs", name)
    except ValueError as e:
        raise UserError(f"--preset: {e}") from None
    return build_config(data, overrides, source=f"preset '{name}'")


def list_presets() -> list[tuple[str, str]]:
    """(name, one-line description) of every shipped job preset."""
    return [(n, load_preset_data("jobs", n).get("description", "")) for n in preset_names("jobs")]
