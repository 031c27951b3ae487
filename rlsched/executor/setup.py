"""What `rlsched generate` and `rlsched run` set up alike, from their own options or config.

- the drafter's kind from its argument (`drafter_kind`; its drafter names are
  `policies.drafters.drafter_names`), known before any model is loaded, so the policy is
  checked first;
- the target and drafter models (`load_models`) and the in-process drafter (`make_drafter`);
- the cost model that prices the policy or a pool's migrations (`cost_model`): a given
  folder's, or a short profile at start.

The rollout backend is built from these by `backends.make_backend`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlsched.errors import UserError
from rlsched.policies.drafters import HOST_DRAFTERS, drafter_names
from rlsched.policies.registry import PolicySpec, as_spec

PROFILE = "profile.parquet"  # the step costs a run profiled at its start


# --- the policy ---------------------------------------------------------------------------------


def check_policy_model(policy: PolicySpec | str, model_dir: Path, config) -> None:
    """A policy file (`table:FILE`, `twostate:FILE`) learned for a model of another
    architecture than the one in `model_dir` (its ModelConfig `config`) is refused, one line."""
    import json

    from rlsched.policies.policyfile import FORMAT, check_model_shape, load_policy_file

    file = as_spec(policy).file
    if file is None or not Path(file).is_file():
        return
    try:
        data = json.loads(Path(file).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return  # refused with its own message where the policy is built
    if isinstance(data, dict) and data.get("format") == FORMAT:  # (not a vLLM batch-size table)
        check_model_shape(load_policy_file(file, kinds=("table", "twostate")), file, config.shape, str(model_dir))


# --- the drafter -------------------------------------------------------------------------------


def drafter_kind(drafter) -> str:
    """What a drafter argument is: off, ngram, suffix, eagle (the built-in target's EAGLE-3
    head, or a folder holding an EAGLE-3 head: `eagle.save_head`'s layout), or model (builtin
    or a model folder)."""
    if drafter in ("off", "eagle") + HOST_DRAFTERS:
        return str(drafter)
    from rlsched.executor.decode.eagle import is_head_folder

    return "eagle" if is_head_folder(drafter) else "model"


def check_width_max(width_max: int, kind: str, backend: str, field: str) -> None:
    """Draft trees a policy may choose (`width_max` > 1) need the local engine and a drafter
    that drafts trees; a UserError naming `field` otherwise."""
    if width_max < 1:
        raise UserError(f"{field} must be >= 1 (got {width_max}; 1: chains only)")
    if width_max == 1:
        return
    if backend != "local":
        raise UserError(f"{field} {width_max}: draft trees run on the local engine only; set it to 1 with {backend}")
    if kind in ("off", "ngram"):
        raise UserError(
            f"{field} {width_max}: the {kind} drafter drafts no trees; use builtin, a model folder, "
            "eagle or suffix, or set it to 1"
        )


# --- models --------------------------------------------------------------------------------------


@dataclass
class Models:
    """The loaded target and model drafter."""

    target_dir: Path
    target: Any  # the target Transformer (an RL run's actor)
    tokenizer: Any
    eos: int | None
    pad_id: int
    drafter_name: str  # off, ngram, suffix, eagle or model
    drafter_dir: Path | None  # a model drafter's or an EAGLE-3 head's folder
    drafter_model: Any  # a model drafter's Transformer, else None

    @property
    def drafter_names(self) -> tuple[str, ...]:
        return drafter_names(self.drafter_name)


def load_models(model: str, drafter: str, *, device: str, dtype: str, log=None) -> Models:
    """The target (with a tokenizer: prompts are encoded with it) and, for a model drafter, the
    drafter, checked to share the target's vocabulary. UserError, one line, otherwise."""
    from rlsched.executor.folders import check_drafter_vocab, eos_id, pad_id, resolve_model_dir
    from rlsched.executor.model.loading import load_model

    target_dir = resolve_model_dir(model, "target", log)
    target = load_model(target_dir, device=device, dtype=dtype)
    if target.tokenizer is None:
        raise UserError(f"model folder {target_dir} has no tokenizer.json, needed to encode the prompts")
    kind, d_dir, d_model = drafter_kind(drafter), None, None
    if kind == "eagle":
        d_dir, d_model = eagle_head(model, drafter, target.model, log)
    if kind == "model":
        d_dir = resolve_model_dir(drafter, "drafter", log)
        d = load_model(d_dir, device=device, dtype=dtype)
        check_drafter_vocab(target, d, target_dir, d_dir)
        d_model = d.model
    return Models(
        target_dir, target.model, target.tokenizer, eos_id(target_dir), pad_id(target_dir), kind, d_dir, d_model
    )


def eagle_head(model: str, drafter, target, log=None):
    """An EAGLE-3 head's folder and the head, reading `target`'s states: `drafter` eagle is the
    built-in target's (trained on first use, then cached; UserError for another target), else
    `drafter` is a head's folder."""
    from rlsched.executor.decode.eagle import load_head
    from rlsched.executor.decode.eagle_builtin import builtin_head

    if drafter != "eagle":
        return Path(drafter), load_head(drafter, target)
    if model != "builtin":
        raise UserError(
            f"drafter eagle is the built-in target's EAGLE-3 head; with model {model} give an EAGLE-3 "
            "head's folder, a model folder, ngram or suffix"
        )
    folder = builtin_head(log=log).folder
    return folder, load_head(folder, target)


def make_drafter(
    m: Models, sampling, max_batch: int, max_len: int, generator, *, ngram_history: int | None = None, history=None
):
    """The in-process drafter (None for off): a model drafter with caches of `max_len`, or an
    n-gram or suffix drafter remembering `ngram_history` samples a prompt (given back its
    `history`)."""
    from rlsched.executor.decode.drafters import ModelDrafter, make_drafter

    if m.drafter_name in HOST_DRAFTERS:
        drafter = make_drafter(m.drafter_name, **history_size(ngram_history))
        if history is not None:
            drafter.history = history
        return drafter
    if m.drafter_name == "model":
        return ModelDrafter(m.drafter_model, sampling, max_batch, max_len, generator)
    if m.drafter_name == "eagle":
        from rlsched.executor.decode.eagle_drafter import EagleDrafter

        return EagleDrafter(m.drafter_model, m.target, sampling, generator)
    return None


def history_size(samples: int | None) -> dict:
    """The keyword that bounds a host drafter's memory of earlier rollouts (None: the drafter's
    own default)."""
    return {} if samples is None else {"max_history": samples}


# --- the cost model ------------------------------------------------------------------------------


def needs_cost(policy: PolicySpec | str, instances: int, realloc: str) -> bool:
    """Whether the run prices steps: a priced policy, or a pool that migrates samples."""
    return as_spec(policy).priced or (instances > 1 and realloc != "none")


def priced_from(folder: Path) -> str | None:
    """What a cost model folder is: a `rlsched profile` output ("profile"), an earlier run
    that profiled at its start ("run"), or neither (None)."""
    if (folder / PROFILE).is_file():  # (a run's folder also holds traces/: its own)
        return "run"
    if (folder / "traces").is_dir():
        return "profile"
    return None


def check_cost_folder(given: str, what: str) -> None:
    """Refuse a cost model folder (option or field `what`) that holds no step costs."""
    if given != "auto" and not priced_from(Path(given)):
        raise UserError(
            f"{what}: {given} is neither a `rlsched profile` folder (traces/) nor an earlier run's "
            "folder (profile.parquet); give one or 'auto'"
        )


def cost_model(
    policy: str,
    given: str,
    target,
    drafter,
    sampling,
    *,
    instances: int,
    realloc: str,
    max_batch: int,
    k_max: int,
    typical_ctx: int,
    seed: int,
    saved: Path | None = None,
    log=None,
    width_max: int = 1,
):
    """(MeasuredCostModel, profile records to save) when the run prices steps (`needs_cost`),
    else (None, None): the `given` folder's (an earlier run's start-up profile, or a `rlsched
    profile` folder's traces), the `saved` profile of a resumed run, or a short profile now
    ('auto'). A profile's prices are wall-clock times: given the same folder, a rerun is priced
    alike, and a policy that reads no step times as they run (`twostate`, `seqgoodput`) decides
    alike; `goodput` also scales its prices by each step's measured time, so its choices vary."""

    from rlsched.costs.measured import MeasuredCostModel

    if not needs_cost(policy, instances, realloc):
        return None, None
    from rlsched.traces.reader import read_profile, read_trace

    if given != "auto":
        folder = Path(given)
        if priced_from(folder) == "run":
            return MeasuredCostModel(read_profile(folder / PROFILE)), None
        return MeasuredCostModel(read_trace(folder / "traces", "steps")), None
    if saved is not None and saved.is_file():
        return MeasuredCostModel(read_profile(saved)), None
    from rlsched.executor.profiler import policy_profile

    records = policy_profile(
        target,
        drafter,
        policy=policy,
        max_batch=max_batch,
        k_max=k_max,
        typical_ctx=typical_ctx,
        sampling=sampling,
        seed=seed,
        log=log,
        width_max=width_max,
    )
    return MeasuredCostModel(records), records
