"""What a user adds to a vLLM engine, verl or OpenRLHF so that rlsched's draft-length policy
runs inside vLLM's scheduler, written from the engine's facts and the policy's settings
(torch-free, without vLLM).

vLLM resolves `scheduler_cls` (rlsched's scheduler) by name inside its engine-core process and
hands it `additional_config["rlsched"]` (the policy, its cost model, where the engine core writes
its traces, the seed); the drafter, the longest draft (`speculative_config.num_speculative_tokens`),
the batch limit (`max_num_seqs`), tensor parallelism and the scheduling knobs a plan chooses
(`max_num_batched_tokens`, `enable_chunked_prefill`, `enable_prefix_caching`,
`cudagraph_capture_sizes` or `enforce_eager`, `async_scheduling`, `block_size`) are vLLM's own
settings. Writers:

- `vllm_engine_kwargs`: `vllm.LLM(**kw)` / `AsyncEngineArgs(**kw)`;
- `vllm_serve_argv` / `vllm_serve_script`: the same as a `vllm serve` command line;
- `verl_rollout_section`: verl's `actor_rollout_ref.rollout` section (verl 0.9 hands `engine_kwargs.vllm`
  to vLLM as engine arguments, `speculative_config` among them);
- `openrlhf_flags` / `openrlhf_launcher`: OpenRLHF 0.11's `train_ppo_ray` flags, and a launcher
  that adds the engine arguments OpenRLHF has no flag for to every vLLM engine it starts;
- `engine_files` / `framework_files`: all of them as file texts, by file name.
"""

from __future__ import annotations

import json
import pprint
import shlex
from dataclasses import dataclass
from typing import Literal

from rlsched.errors import UserError
from rlsched.policies.registry import as_spec
from rlsched.policies.vllm_plan import NGRAM, speculative_plan

SCHEDULER_CLS = "rlsched.vllm.PolicyScheduler"
METHODS = {"model": "draft_model", "eagle": "eagle3"}  # rlsched's drafter kinds as vLLM's methods
# the drafter written where an EAGLE-3 head's folder is not given (a simulated drafter has no folder)
EAGLE_PLACEHOLDER = "REPLACE-ME/eagle3-head-of-{model}"
DrafterKind = Literal["off", "model", "eagle", "ngram"]
# engine arguments OpenRLHF sets from its own flags (or fixes) when it starts a vLLM engine
OPENRLHF_OWN = ("model", "tensor_parallel_size", "gpu_memory_utilization", "max_model_len")


@dataclass(frozen=True)
class EngineFacts:
    """One vLLM engine as the frameworks start it: the target (a folder or HF id), the drafter
    (`off`, `ngram`, or `model`/`eagle` with its folder), the longest draft (k_max), the batch
    limit, tensor parallelism; memory, window and dtype where set (None: the framework's own)."""

    model: str
    drafter: DrafterKind = "off"
    drafter_path: str | None = None
    k_max: int = 8
    max_num_seqs: int = 256
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float | None = None
    max_model_len: int | None = None
    dtype: str | None = None
    # vLLM's scheduling knobs (None: vLLM's default); capture sizes () run eagerly (enforce_eager)
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool | None = None
    enable_prefix_caching: bool | None = None
    cudagraph_capture_sizes: tuple[int, ...] | None = None
    async_scheduling: bool | None = None
    block_size: int | None = None


@dataclass(frozen=True)
class HookSettings:
    """`additional_config["rlsched"]`: the policy (a name or a policy file, as `rlsched run`
    takes it), the cost model pricing it (a `rlsched fit` .json or a hardware preset), the
    engine core's trace folder, the probe period and the seed."""

    policy: str
    cost_model: str | None = None
    trace_dir: str | None = None
    probe_every: int | None = None
    seed: int = 0

    def block(self) -> dict:
        fields = {
            "policy": self.policy,
            "cost_model": self.cost_model,
            "trace_dir": self.trace_dir,
            "probe_every": self.probe_every,
            "seed": self.seed,
        }
        return {"rlsched": {k: v for k, v in fields.items() if v is not None}}


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _check_knobs(f: EngineFacts) -> None:
    """vLLM's scheduling knobs as vLLM's SchedulerConfig and CompilationConfig accept them."""
    budget = f.max_num_batched_tokens
    if budget is not None:
        if not _whole(budget):
            raise UserError(f"max_num_batched_tokens must be a whole number >= 1 (got {budget!r})")
        if budget < f.max_num_seqs:
            raise UserError(
                f"max_num_batched_tokens {budget} is below max_num_seqs {f.max_num_seqs}, which vLLM refuses; "
                "raise it or lower max_num_seqs"
            )
        if f.enable_chunked_prefill is False and f.max_model_len is not None and budget < f.max_model_len:
            raise UserError(
                f"max_num_batched_tokens {budget} is below max_model_len {f.max_model_len} with chunked prefill "
                "off, which vLLM refuses; raise it or turn enable_chunked_prefill on"
            )
    sizes = f.cudagraph_capture_sizes
    if sizes is not None and (not all(_whole(s) for s in sizes) or any(b <= a for a, b in zip(sizes, sizes[1:]))):
        raise UserError(
            f"cudagraph_capture_sizes must be strictly increasing token counts >= 1, such as [1, 2, 4, 8] "
            f"(got {list(sizes)!r})"
        )
    if f.block_size is not None and not _whole(f.block_size):
        raise UserError(f"block_size must be a whole number >= 1 (got {f.block_size!r})")


def _knob_kwargs(f: EngineFacts) -> dict:
    """The scheduling knobs set, as vLLM's engine arguments (no capture sizes: enforce_eager)."""
    kw: dict = {
        "max_num_batched_tokens": f.max_num_batched_tokens,
        "enable_chunked_prefill": f.enable_chunked_prefill,
        "enable_prefix_caching": f.enable_prefix_caching,
        "async_scheduling": f.async_scheduling,
        "block_size": f.block_size,
    }
    if f.cudagraph_capture_sizes is not None:
        sizes = list(f.cudagraph_capture_sizes)
        kw.update({"cudagraph_capture_sizes": sizes} if sizes else {"enforce_eager": True})
    return {k: v for k, v in kw.items() if v is not None}


def _check_facts(f: EngineFacts) -> None:
    for name, value in (
        ("k_max", f.k_max),
        ("max_num_seqs", f.max_num_seqs),
        ("tensor_parallel_size", f.tensor_parallel_size),
    ):
        if not _whole(value):
            raise UserError(f"{name} must be a whole number >= 1 (got {value!r})")
    if f.gpu_memory_utilization is not None and not 0 < f.gpu_memory_utilization <= 1:
        raise UserError(f"gpu_memory_utilization must be in (0, 1] (got {f.gpu_memory_utilization!r})")
    if f.max_model_len is not None and f.max_model_len < 1:
        raise UserError(f"max_model_len must be >= 1 (got {f.max_model_len!r})")
    if not f.model.strip():
        raise UserError("model is empty; give the target's folder or HF id")
    if f.drafter not in ("off", "ngram", *METHODS):
        raise UserError(f"drafter '{f.drafter}' is not one of off, model, eagle, ngram")
    if f.drafter in METHODS and not (f.drafter_path or "").strip():
        raise UserError(f"drafter {f.drafter} needs its folder (drafter_path): vLLM loads it from there")
    _check_knobs(f)


def _check_hook(h: HookSettings, priced: bool) -> None:
    from rlsched.config import preset_names

    presets = preset_names("hardware")
    if h.cost_model is None and priced:
        raise UserError(
            f"policy '{h.policy}' prices its steps: give cost_model, a `rlsched fit` .json file or a "
            f"hardware preset ({', '.join(presets)})"
        )
    if h.cost_model is not None and not (h.cost_model.endswith(".json") or h.cost_model in presets):
        raise UserError(
            f"cost_model '{h.cost_model}' is neither a .json file (`rlsched fit --out FILE.json`) nor a "
            f"hardware preset ({', '.join(presets)})"
        )
    if h.probe_every is not None and h.probe_every < 1:
        raise UserError(f"probe_every must be >= 1 (got {h.probe_every!r})")
    if h.seed < 0:
        raise UserError(f"seed must be >= 0 (got {h.seed!r})")


def speculative_config(facts: EngineFacts, plan: dict | None) -> dict | None:
    """vLLM's speculative_config for a `speculative_plan`: its longest draft as
    num_speculative_tokens (rlsched's scheduler picks each step's length up to it), the drafter
    as vLLM's method (a model's drafts sampled, so that rejection sampling stays lossless)."""
    if plan is None:
        return None
    if plan["drafter"] == "ngram":
        return dict(NGRAM, num_speculative_tokens=plan["k"])
    return {
        "method": METHODS[plan["drafter"]],
        "model": facts.drafter_path,
        "num_speculative_tokens": plan["k"],
        "draft_sample_method": "probabilistic",
    }


def vllm_engine_kwargs(facts: EngineFacts, hook: HookSettings) -> dict:
    """vLLM engine arguments (`vllm.LLM(**kw)`, `AsyncEngineArgs(**kw)`) running `hook.policy` in
    rlsched's scheduler; UserError, one line naming the field, for what cannot run."""
    _check_facts(facts)
    policy = as_spec(hook.policy, "vllm")
    plan = speculative_plan(policy, facts.drafter, k_max=facts.k_max, max_batch=facts.max_num_seqs)
    _check_hook(hook, policy.priced)
    kw: dict = {
        "model": facts.model,
        "tensor_parallel_size": facts.tensor_parallel_size,
        "max_num_seqs": facts.max_num_seqs,
        "gpu_memory_utilization": facts.gpu_memory_utilization,
        "max_model_len": facts.max_model_len,
        "dtype": facts.dtype,
    }
    kw = {k: v for k, v in kw.items() if v is not None}
    kw.update(_knob_kwargs(facts))
    spec = speculative_config(facts, plan)
    if spec is not None:
        kw["speculative_config"] = spec
    elif policy.drafts:  # drafts nowhere at these limits (a table of zeros): plain decoding, said so
        hook = HookSettings("off", hook.cost_model, hook.trace_dir, hook.probe_every, hook.seed)
    kw["scheduler_cls"] = SCHEDULER_CLS
    kw["additional_config"] = hook.block()
    return kw


def _flag_value(value) -> str:
    return json.dumps(value, separators=(",", ":")) if isinstance(value, (dict, list)) else str(value)


# engine arguments `vllm serve` takes as several words (nargs "+"), not as one JSON word
SERVE_LISTS = ("cudagraph_capture_sizes",)


def _serve_words(k: str, v) -> list[str]:
    """One engine argument as `vllm serve`'s words: a switch for a bool (`--no-FLAG` for
    false), a word a value for a list vLLM reads so, else the value (dicts and lists as JSON)."""
    flag = f"--{k.replace('_', '-')}"
    if isinstance(v, bool):
        return [flag if v else f"--no-{flag[2:]}"]
    if k in SERVE_LISTS:
        return [flag, *(str(x) for x in v)]
    return [flag, _flag_value(v)]


def vllm_serve_argv(kw: dict) -> list[str]:
    """`vllm serve MODEL --flag value ...` for engine kwargs (`_serve_words`)."""
    argv = ["vllm", "serve", kw["model"]]
    for k, v in kw.items():
        if k != "model":
            argv += _serve_words(k, v)
    return argv


def vllm_serve_script(kw: dict, title: str) -> str:
    """`vllm_serve_argv` as a shell script, one flag a line, every word quoted for the shell."""
    lines = [" ".join(shlex.quote(a) for a in ["vllm", "serve", kw["model"]])]
    lines += [" ".join(shlex.quote(a) for a in _serve_words(k, v)) for k, v in kw.items() if k != "model"]
    return f"#!/bin/sh\n# {title}\nexec " + " \\\n  ".join(lines) + ' "$@"\n'


def verl_rollout_section(kw: dict) -> dict:
    """verl's `actor_rollout_ref.rollout` section for engine kwargs `kw` (`vllm_engine_kwargs`):
    its own keys for tensor parallelism, batch limit, memory, window, dtype, token budget,
    chunked prefill, prefix caching and CUDA graphs (capture sizes, enforce_eager), the rest through
    `engine_kwargs.vllm`. A drafter with weights is read from its folder only when verl's rollout
    loads weights from disk (`load_format: auto`; verl's default `dummy` would give it random ones,
    and verl's weight sync updates the target alone)."""
    own = {
        "tensor_parallel_size": "tensor_model_parallel_size",
        "max_num_seqs": "max_num_seqs",
        "gpu_memory_utilization": "gpu_memory_utilization",
        "max_model_len": "max_model_len",
        "dtype": "dtype",
        "max_num_batched_tokens": "max_num_batched_tokens",
        "enable_chunked_prefill": "enable_chunked_prefill",
        "enable_prefix_caching": "enable_prefix_caching",
        "cudagraph_capture_sizes": "cudagraph_capture_sizes",
        "enforce_eager": "enforce_eager",
    }
    rollout: dict = {"name": "vllm"}
    rollout.update({own[k]: v for k, v in kw.items() if k in own})
    if kw.get("speculative_config", {}).get("method") in METHODS.values():
        rollout["load_format"] = "auto"
    rollout["engine_kwargs"] = {"vllm": {k: v for k, v in kw.items() if k not in own and k != "model"}}
    return {"actor_rollout_ref": {"rollout": rollout}}


def openrlhf_flags(kw: dict) -> tuple[list[str], dict]:
    """(OpenRLHF 0.11 `train_ppo_ray` flags, the engine arguments it has no flag for). Prefix
    caching is on: OpenRLHF resets the cache after each weight sync only then, and rlsched's
    scheduler takes that reset as the next RL step in its records."""
    flags = ["--actor.model_name_or_path", kw["model"], "--vllm.tensor_parallel_size", str(kw["tensor_parallel_size"])]
    flags.append("--vllm.enable_prefix_caching")
    if "gpu_memory_utilization" in kw:
        flags += ["--vllm.gpu_memory_utilization", str(kw["gpu_memory_utilization"])]
    if "max_model_len" in kw:
        flags += ["--data.max_len", str(kw["max_model_len"])]
    return flags, {k: v for k, v in kw.items() if k not in OPENRLHF_OWN}


LAUNCHER = '''#!/usr/bin/env python
# {title}
#
#     python {name} --vllm.num_engines N [your other train_ppo_ray flags]
"""OpenRLHF's PPO trainer (openrlhf.cli.train_ppo_ray, 0.11) with rlsched's draft-length policy in
its vLLM engines.

OpenRLHF starts each vLLM engine with a fixed set of engine arguments; this launcher adds
ENGINE_KWARGS to every engine it starts, then runs train_ppo_ray with FLAGS and your own flags
after them (a flag given twice: the last one counts). rlsched must be installed where the
engines run.
"""

import runpy
import sys

import openrlhf.trainer.ray.vllm_engine as vllm_engine

FLAGS = {flags}

ENGINE_KWARGS = {engine}

_actor = vllm_engine.RolloutRayActor


class _Started:
    def __init__(self, handle):
        self._handle = handle

    def remote(self, *args, **kwargs):
        return self._handle.remote(*args, **{{**kwargs, **ENGINE_KWARGS}})


class _RolloutRayActor:
    """OpenRLHF's engine actor, started with ENGINE_KWARGS among its engine arguments."""

    def options(self, **options):
        return _Started(_actor.options(**options))

    def remote(self, *args, **kwargs):
        return _actor.remote(*args, **{{**kwargs, **ENGINE_KWARGS}})

    def __getattr__(self, name):
        return getattr(_actor, name)


vllm_engine.RolloutRayActor = _RolloutRayActor()
sys.argv = [sys.argv[0], *FLAGS, *sys.argv[1:]]
runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__", alter_sys=True)
'''


def _py_list(flags: list[str]) -> str:
    """`flags` as a Python list literal, each flag on a line with its value."""
    lines: list[list[str]] = []
    for word in flags:
        if word.startswith("--") or not lines:
            lines.append([])
        lines[-1].append(repr(word))
    return "[\n" + "".join(f"    {', '.join(line)},\n" for line in lines) + "]"


def openrlhf_launcher(kw: dict, title: str, name: str) -> str:
    """A Python launcher of OpenRLHF's trainer holding its flags and extra engine arguments."""
    flags, engine = openrlhf_flags(kw)
    return LAUNCHER.format(
        title=title,
        name=name,
        flags=_py_list(flags),
        engine=pprint.pformat(engine, width=100, sort_dicts=False),
    )


FILES = ("vllm_engine.json", "vllm_serve.sh", "verl_rollout.yaml", "openrlhf_launch.py")


def engine_files(kw: dict, prefix: str = "", title: str | None = None) -> dict[str, str]:
    """Every framework's file for engine kwargs `kw` (`vllm_engine_kwargs`), {PREFIX + name: text}
    for the names in FILES: vllm.LLM's arguments, the `vllm serve` script, verl's rollout section
    and OpenRLHF's launcher; `title`: their one-line comment (default: the policy's; its line
    breaks, which would end the comment in a script, as spaces)."""
    import yaml

    title = title or f"rlsched's policy {kw['additional_config']['rlsched']['policy']} in vLLM's scheduler"
    title = " ".join(title.split())
    verl = yaml.safe_dump(verl_rollout_section(kw), sort_keys=False, width=120)
    engine, serve, verl_name, launcher = (prefix + name for name in FILES)
    return {
        engine: json.dumps(kw, indent=2) + "\n",
        serve: vllm_serve_script(kw, title + " (rlsched must be installed where vLLM runs)"),
        verl_name: f"# {title}: merge into verl's trainer config (verl 0.9)\n{verl}",
        launcher: openrlhf_launcher(kw, title, launcher),
    }


def framework_files(facts: EngineFacts, hook: HookSettings, stem: str) -> dict[str, str]:
    """Every framework's snippet for one engine, {file name: text}: `STEM.vllm_engine.json`
    (vllm.LLM's arguments), `STEM.vllm_serve.sh`, `STEM.verl_rollout.yaml` and
    `STEM.openrlhf_launch.py` (`engine_files`). UserError, one line, for what cannot run."""
    return engine_files(vllm_engine_kwargs(facts, hook), stem + ".")
