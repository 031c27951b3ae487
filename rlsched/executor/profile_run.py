"""`rlsched profile`: load the target and its drafters, lock and check the out folder
(`rlsched.locks`: one command at a time per folder), measure the grid (`profiler.profile`),
write the step records and profile.json (whole, or nothing: a write failing for want of room
ends the command in one line), and print the verify times."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import pandas as pd
import torch

from rlsched.errors import UserError
from rlsched.executor.decode.sampling import SamplingParams
from rlsched.executor.profiler import STATISTICS, prefill_midpoints, profile, profile_cache_len


def run_profile(
    *,
    model: str,
    drafters: list[str],
    batch_sizes: list[int],
    k_max: int,
    contexts: list[int],
    repeats: int,
    device: str,
    dtype: str,
    threads: int | None,
    out: Path,
    console,
    table_console,
    passes: int = 1,
    compile: bool = False,
    statistic: str = "median",
    width_max: int = 1,
) -> Path:
    """`rlsched profile`: load, check, measure, write `out/traces/steps/` and `out/profile.json`."""
    from rlsched.executor.folders import prepare_out, remove_leftovers, resolve_model_dir
    from rlsched.executor.model.loading import load_model
    from rlsched.locks import FolderLock

    _check_arguments(k_max, repeats, passes, width_max, statistic, threads)
    if threads is not None:
        torch.set_num_threads(threads)
    log = lambda msg: console.print(msg, highlight=False)  # noqa: E731
    target_dir = resolve_model_dir(model, "target", log)
    target = load_model(target_dir, device=device, dtype=dtype)
    sampling = SamplingParams(temperature=1.0)
    max_len = profile_cache_len(contexts, k_max)
    timed = _drafters_to_time(
        drafters, model, target, target_dir, sampling, max(batch_sizes), max_len, device, dtype, log
    )
    with FolderLock(out, "profile"):  # given back at the end: the folder is written whole by then
        prepare_out(out, "profile.json", "profile")
        remove_leftovers(out, siblings=True)
        if compile:  # after every check: compiling takes a while
            _compile(target, timed, k_max, max(batch_sizes), log)
        with console.status("profiling") as status:
            records = profile(
                target.model,
                timed,
                batch_sizes=batch_sizes,
                k_max=k_max,
                contexts=contexts,
                repeats=repeats,
                passes=passes,
                sampling=sampling,
                statistic=STATISTICS[statistic],
                width_max=width_max,
                progress=lambda i, n, b, c: status.update(f"profiling: point {i}/{n} (batch {b}, context {c})"),
            )
        about = {
            "model": str(target_dir),
            "model_shape": target.model.config.shape,
            "drafters": list(timed),
            "batch_sizes": batch_sizes,
            "k_max": k_max,
            "width_max": width_max,
            "contexts": contexts,
            "prefill_contexts": sorted({*contexts, *prefill_midpoints(contexts)}),
            "repeats": repeats,
            "passes": passes,
            "statistic": statistic,
            "device": device,
            "dtype": dtype,
            "compiled": compile,
            "threads": torch.get_num_threads(),
            "machine": platform.node(),
            "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        _write_profile(out, records, about)
    table_console.print(_verify_table(pd.DataFrame(records), contexts, out))
    return out


def _compile(target, timed: dict, k_max: int, max_batch: int, log) -> None:
    """The target's and the model drafters' forwards compiled for the grid (`--compile`)."""
    from rlsched.executor.decode.drafters import ModelDrafter
    from rlsched.executor.model.compiled import compile_for_engine

    drafters = [d.model for d in timed.values() if isinstance(d, ModelDrafter)]
    compile_for_engine(target.model, drafters, k_max, max_batch, log)


def _check_arguments(k_max: int, repeats: int, passes: int, width_max: int, statistic: str, threads: int | None):
    """One UserError line for the first bad command-line value."""
    if k_max < 1 or repeats < 1 or passes < 1 or width_max < 1:
        raise UserError(
            f"--k-max, --repeats, --passes and --width-max must be >= 1 (got {k_max}, {repeats}, {passes}, {width_max})"
        )
    if statistic not in STATISTICS:
        raise UserError(f"--statistic must be one of {', '.join(STATISTICS)} (got {statistic!r})")
    if threads is not None and threads < 1:
        raise UserError(f"--threads must be >= 1 (got {threads})")


def _drafters_to_time(
    specs: list[str], model: str, target, target_dir, sampling, max_batch: int, max_len: int, device, dtype, log
):
    """Name -> drafter for each of `specs` (`off` left out), loaded on the target's device
    and dtype; a model drafter's vocabulary is checked against the target's."""
    from rlsched.executor.decode.drafters import ModelDrafter, make_drafter
    from rlsched.executor.folders import check_drafter_vocab, resolve_model_dir
    from rlsched.executor.model.loading import load_model
    from rlsched.executor.setup import drafter_kind, eagle_head
    from rlsched.policies.drafters import HOST_DRAFTERS

    timed = {}
    for spec in specs:
        if spec == "off":
            continue
        if spec in HOST_DRAFTERS:
            timed[spec] = make_drafter(spec)
            continue
        if drafter_kind(spec) == "eagle":
            from rlsched.executor.decode.eagle_drafter import EagleDrafter

            timed["eagle"] = EagleDrafter(eagle_head(model, spec, target.model, log)[1], target.model, sampling)
            continue
        folder = resolve_model_dir(spec, "drafter", log)
        d = load_model(folder, device=device, dtype=dtype)
        check_drafter_vocab(target, d, target_dir, folder)
        name = "model" if "model" not in timed else f"model:{folder.name}"
        timed[name] = ModelDrafter(d.model, sampling, max_batch, max_len)
    return timed


def _write_profile(out: Path, records: list[dict], about: dict) -> None:
    """The step records under `out/traces/steps/` and `about` as `out/profile.json`, whole (a
    write failing for want of room or permission: one UserError line, nothing written)."""
    from rlsched.atomic import atomic_folder, write_text_atomic
    from rlsched.executor.folders import WriteFailed, writing
    from rlsched.traces.writer import TraceWriter

    try:
        with writing(out), atomic_folder(out) as tmp:
            w = TraceWriter(tmp / "traces", "steps", flush_every=len(records))
            for r in records:
                w.append(r)
            w.close()
            write_text_atomic(tmp / "profile.json", json.dumps(about, indent=2) + "\n")
    except WriteFailed as e:
        raise UserError(
            f"writing {e.path} failed ({e.reason}); nothing was written: {e.fix}, then profile again"
        ) from None


def _verify_table(df: pd.DataFrame, contexts: list[int], out: Path):
    """The verify times by batch x k (mean over the contexts), as `rlsched profile` prints them."""
    from rich.table import Table

    verify = df[df.kind == "verify"].pivot_table(index="batch", columns="k", values="verify_ms", aggfunc="mean")
    t = Table(title=f"verify ms (mean over contexts {contexts}) by batch x k; written to {out}")
    t.add_column("batch", justify="right")
    for k in verify.columns:
        t.add_column(f"k={k}", justify="right")
    for b, row in verify.iterrows():
        t.add_row(str(b), *(f"{v:.2f}" for v in row))
    return t
