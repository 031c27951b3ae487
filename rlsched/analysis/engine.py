"""Engine-core trace folders: what rlsched's scheduler inside vLLM wrote (its `trace_dir`).

Such a folder holds one `engine-<tag>.json` per engine process (rlsched's settings, the
drafter, k_max, batch limit, tensor parallelism, model and vLLM's scheduling arguments; tag
= e<data-parallel rank>-<pid>), `steps/` (one record per engine step) and `samples/` (one
record per finished request), in parts of each engine's tag. `rl_step` counts weight updates:
a window is what an engine ran between two of them. What such a trace does not hold: request
arrival times, RL stage times (inference, training, drafter updates), rewards.

`read_engine_trace` reads one (each engine's parts by its tag, column `engine`);
`windows` measures each engine's window as the span of its step records; `engine_numbers`
are the key numbers `rlsched report` shows. No torch, no matplotlib.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from rlsched.errors import UserError
from rlsched.traces.reader import engine_file_paths, part_files, part_tag, read_engine_files, read_trace
from rlsched.traces.schema import SCHEMAS

UNKNOWN = (
    "an engine-core trace holds no RL stage times (inference, training, drafter update), rewards or "
    "request arrival times"
)


@dataclass
class EngineTrace:
    path: Path
    engines: list[dict]  # the engine files, checked, with tag and file
    steps: pd.DataFrame  # step records, column engine: the tag of the engine that wrote each
    samples: pd.DataFrame  # sample records, likewise
    notes: list[str] = field(default_factory=list)


def is_engine_trace(path) -> bool:
    """Whether `path` is an engine-core trace folder (it holds engine-*.json)."""
    return bool(engine_file_paths(Path(path)))


def _read(path: Path, kind: str, tags: list[str]) -> pd.DataFrame:
    """The records of `kind` of each engine's parts (none: the schema's columns, empty)."""
    folder = path / kind
    schema = SCHEMAS[kind]
    empty = pd.DataFrame({n: pd.Series(dtype=t.to_pandas_dtype()) for n, t in zip(schema.names, schema.types)})
    parts = [read_trace(folder, kind, tag).assign(engine=tag) for tag in tags] if folder.is_dir() else []
    parts = [p for p in parts if len(p)]
    return pd.concat(parts, ignore_index=True) if parts else empty.assign(engine=pd.Series(dtype=str))


def read_engine_trace(path) -> EngineTrace:
    """An engine-core trace folder's engine files and records; one UserError for a folder that
    is none, a damaged engine file or part, or a folder without records."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"'{path}' is not a folder; give an engine-core trace folder (the rlsched trace_dir)")
    engines = read_engine_files(path)
    if not engines:
        raise UserError(f"'{path}' is not an engine-core trace folder (no engine-*.json)")
    tags = [e["tag"] for e in engines]
    steps, samples = _read(path, "steps", tags), _read(path, "samples", tags)
    if steps.empty and samples.empty:
        raise UserError(
            f"engine-core trace '{path}' holds no step or sample records (steps/, samples/ of tags "
            f"{', '.join(tags)}); the engine wrote none yet, or they were moved"
        )
    notes = []
    found = {part_tag(p) for kind in ("steps", "samples") if (path / kind).is_dir() for p in part_files(path / kind)}
    orphans = sorted(found - set(tags))
    if orphans:
        notes.append(f"parts of tag(s) {', '.join(t or '(none)' for t in orphans)} have no engine file: left out")
    ranks = [e["rank"] for e in engines]
    if len(set(ranks)) < len(ranks):
        notes.append(
            "several engine processes share a data-parallel rank (a restarted engine): each counts "
            "its windows from its own start"
        )
    return EngineTrace(path, engines, steps, samples, notes)


_ENGINE_FLAGS = ("enable_chunked_prefill", "enable_prefix_caching", "async_scheduling", "enforce_eager")
_ENGINE_SIZES = ("max_num_batched_tokens", "block_size")


def engine_section(engine: dict | None) -> dict:
    """The simulator's `engine` section (kind vllm) of a vLLM engine as its engine file records
    it: the token budget, chunked prefill, prefix caching, async scheduling, block size and
    CUDA-graph capture sizes (none under enforce_eager). A knob the file lacks (None: no file)
    is left out, to take vLLM's default (engine_config.py); a knob of the wrong type is one
    UserError naming the file and the field."""
    out: dict = {"kind": "vllm"}
    if engine is None:
        return out
    where, fix = engine.get("file", "engine file"), "restore the file the engine wrote"

    def bad(key: str, what: str) -> UserError:
        return UserError(f"engine file '{where}': {key} is {engine[key]!r}, not {what}; {fix}")

    for key in _ENGINE_FLAGS:
        if engine.get(key) is not None and not isinstance(engine[key], bool):
            raise bad(key, "true or false")
        if key in engine and key != "enforce_eager":
            out[key] = engine[key]
    for key in _ENGINE_SIZES:
        v = engine.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise bad(key, "a whole number >= 1")
        if v is not None:
            out[key] = v
    sizes = engine.get("cudagraph_capture_sizes")
    if sizes is not None:
        whole = isinstance(sizes, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in sizes)
        if not whole or min(sizes, default=1) < 1:
            raise bad("cudagraph_capture_sizes", "a list of token counts")
        out["cudagraph_capture_sizes"] = sorted(set(sizes))
    if engine.get("enforce_eager"):
        out["cudagraph_capture_sizes"] = []
    return out


def run_engine(rundir: Path, run_cfg: dict) -> tuple[dict | None, list[str]]:
    """The `engine` section a run's instances replay as (None: rlsched's engine) and notes: a
    `--backend vllm` run's vLLM engine, with the scheduling arguments its engine files
    (traces/engine-*.json) record, vLLM's defaults where it has none."""
    if run_cfg["rollout"].get("backend", "local") != "vllm":
        return None, []
    engines = read_engine_files(rundir / "traces")
    if not engines:
        return engine_section(None), [
            "the run's traces hold no engine files (engine-*.json): its vLLM engine is replayed with vLLM's defaults"
        ]
    return engine_section(engines[0]), []


def untimed_notes(steps: pd.DataFrame) -> list[str]:
    """What the cost fit leaves out of engine step records: decode steps whose drafting was
    not timed (draft_ms, verify_ms NaN: the step is timed as a whole). (Mixed steps: the fit's
    own notes.)"""
    if steps is None or steps.empty:
        return []
    notes = []
    dec = steps[steps["kind"] == "decode"]
    untimed = dec["draft_ms"].isna() | dec["verify_ms"].isna()
    if untimed.any():
        notes.append(
            f"{int(untimed.sum())} of {len(dec)} decode steps have no draft/verify split (drafting was not "
            "timed where vLLM's runner ran: draft_ms is NaN): left out of the verify and draft fits"
        )
    return notes


def windows(steps: pd.DataFrame, samples: pd.DataFrame) -> pd.DataFrame:
    """Per engine and window (rl_step): start_s, end_s (engine clock: seconds since that
    engine started), measured_s (the span of its step records), steps, samples and
    response tokens."""
    cols = ["engine", "rl_step", "start_s", "end_s", "measured_s", "steps", "samples", "response_tokens"]
    if steps is None or steps.empty:
        return pd.DataFrame(columns=cols)
    end = steps["time_s"] + steps["step_ms"].fillna(0) / 1e3
    g = steps.assign(end_s=end).groupby(["engine", "rl_step"])
    out = g.agg(start_s=("time_s", "min"), end_s=("end_s", "max"), steps=("step", "size")).reset_index()
    out["measured_s"] = out["end_s"] - out["start_s"]
    if samples is not None and len(samples):
        s = samples.groupby(["engine", "rl_step"]).agg(
            samples=("sample_id", "size"), response_tokens=("response_len", "sum")
        )
        out = out.merge(s.reset_index(), on=["engine", "rl_step"], how="left")
    else:
        out = out.assign(samples=0, response_tokens=0)
    out[["samples", "response_tokens"]] = out[["samples", "response_tokens"]].fillna(0).astype(int)
    return out[cols].sort_values(["rl_step", "engine"]).reset_index(drop=True)


def _same(values: list):
    """The one value all engines share, else their distinct values joined by " / "."""
    distinct = sorted({str(v) for v in values})
    return values[0] if len(distinct) == 1 else " / ".join(distinct)


def engine_numbers(engines: list[dict], steps: pd.DataFrame | None, samples: pd.DataFrame | None) -> dict:
    """An engine-core trace's key numbers: what the engines ran, windows, samples, tokens per
    second of generation (response tokens over the windows' spans), acceptance."""
    out: dict = {
        "engines": len(engines),
        **{k: _same([e["rlsched"].get(k) for e in engines]) for k in ("policy", "cost_model")},
        **{k: _same([e.get(k) for e in engines]) for k in ("drafter", "k_max", "max_batch", "tp", "model", "vllm")},
    }
    steps = steps if steps is not None else pd.DataFrame()
    samples = samples if samples is not None else pd.DataFrame()
    w = windows(steps, samples) if len(steps) else pd.DataFrame()
    out["windows"] = int(w["rl_step"].nunique()) if len(w) else 0
    out["steps"] = int(len(steps))
    out["samples"] = int(len(samples))
    span = float(w["measured_s"].sum()) if len(w) else 0.0
    tokens = float(samples["response_len"].sum()) if len(samples) else 0.0
    out["generation_s"] = span
    out["tokens_per_s"] = tokens / span if span > 0 else float("nan")
    dec = steps[(steps["kind"] == "decode") & (steps["k"] > 0)] if len(steps) else steps
    drafted = float(dec["drafted"].sum()) if len(dec) else 0.0
    out["accept_rate"] = float(dec["accepted"].sum()) / drafted if drafted else float("nan")
    out["mean_accept_len"] = float(dec["emitted"].sum() / dec["batch"].sum()) if len(dec) else float("nan")
    untimed = steps["draft_ms"].isna().sum() if len(steps) else 0
    out["untimed_steps"] = int(untimed)
    return out


def window_acceptance(steps: pd.DataFrame, samples: pd.DataFrame | None) -> pd.DataFrame | None:
    """accept_mean_<drafter> per window: the mean of the engine's per-sample acceptance
    estimates (acceptance_<drafter> of the sample records)."""
    if samples is None or samples.empty:
        return None
    cols = [c for c in samples.columns if c.startswith("acceptance_")]
    if not cols:
        return None
    g = samples.groupby("rl_step")[cols].mean()
    g.columns = [f"accept_mean_{c.removeprefix('acceptance_')}" for c in cols]
    return g.reset_index().replace([np.inf, -np.inf], np.nan)


def fit_folder(path, max_mape: float):
    """`rlsched fit` of a profile, run or engine-core trace folder: an engine trace's engine
    files are checked and named in the fit's source; the steps the fit leaves out (untimed
    drafting, mixed steps) are said in its notes."""
    from rlsched.costs.fit import fit_records, read_records

    path = Path(path)
    if path.is_dir() and not any((path / sub).is_dir() for sub in ("traces/steps", "steps")):
        raise UserError(
            f"fit: '{path}' holds no step traces (no traces/steps/ or steps/); give a `rlsched profile` folder, "
            "a run folder or an engine-core trace folder"
        )
    engines = read_engine_files(path) if is_engine_trace(path) else []
    df, source = read_records(path)
    if engines:
        keys = ("tag", "model", "drafter", "k_max", "max_batch", "tp", "vllm")
        source["kind"] = "engine"
        source["engines"] = [{k: e.get(k) for k in keys} for e in engines]
    result = fit_records(df, source, max_mape)
    result.notes[:0] = untimed_notes(df)
    result.acceptance = position_curves(df)
    for d, f in result.acceptance.items():
        known = f["decay_se"] is not None and f["decay_se"] < 0.25
        decay = f"then x {f['decay']:.3f} (± {f['decay_se']:.3f}) a position" if known else "its decay not told"
        alpha_se = "± nan" if f["alpha_se"] is None else f"± {f['alpha_se']:.3f}"
        result.notes.append(
            f"acceptance by draft position, {d}: first draft {f['alpha']:.3f} ({alpha_se}), {decay}, "
            f"from {_informed_by(f)}; the simulator takes them as acceptance.mean and acceptance.position_decay"
        )
    return result


def _informed_by(f: dict) -> str:
    """Which records a drafter's position curve was fitted to, in words."""
    parts = []
    if f["positions"]:
        parts.append(f"{f['positions']} steps' counts by position")
    if f["steps"] or not parts:
        parts.append(f"{f['steps']} steps' accepted sums")
    return " and ".join(parts)


def position_curves(df: pd.DataFrame) -> dict[str, dict]:
    """Each drafter's acceptance by draft position (`policies.position_fit`), fitted to the
    records' counts by draft position where a chain step holds them (`accepted_by_position`,
    `tried_by_position`: an exact Binomial chain, decode and mixed steps, any per-row lengths),
    else to its decode steps' sums of one k a row; none for a drafter without such steps. Each
    fit says how many records of each kind informed it (`positions`, `steps`); an error the
    fit cannot tell (an optimum on a bound) is None."""
    from rlsched.policies.position_fit import fit_drafter

    need = {"kind", "drafter", "k", "batch", "drafted", "accepted"}
    if not need <= set(df.columns):
        return {}
    counted = np.zeros(len(df), dtype=bool)
    if "accepted_by_position" in df.columns:
        counted = np.array([c is not None and np.ndim(c) == 1 and len(c) > 0 for c in df["accepted_by_position"]])
    steps = df[((df["kind"] == "decode") | counted) & (df["drafted"] > 0)]
    out = {}
    for d in sorted({str(x) for x in steps["drafter"] if isinstance(x, str) and x not in ("", "off")}):
        try:
            fit = fit_drafter(d, steps[steps["drafter"] == d]).as_dict()
        except ValueError:  # no chain step of one k a row, no counts by position
            continue
        out[d] = {k: None if isinstance(v, float) and not np.isfinite(v) else v for k, v in fit.items()}
    return out
