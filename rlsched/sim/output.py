"""Run a simulation with progress on stderr and write its folder atomically.

The folder appears whole or not at all: everything is written to a temporary sibling that is
renamed into place at the end (a previous folder of the same name is replaced).
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import yaml
from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from rlsched import __version__
from rlsched.atomic import atomic_folder, json_text
from rlsched.config import SimConfig
from rlsched.policies.registry import OFF_SPEC, PolicySpec
from rlsched.sim.simulate import SimResult, simulate
from rlsched.sim.sizes import check_fits
from rlsched.traces.writer import to_table, write_table


def run_with_progress(
    cfg: SimConfig, policy: PolicySpec, realloc: str | None, console: Console, label: str
) -> SimResult:
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}", markup=False),  # a config name as written
        BarColumn(),
        TextColumn("{task.completed}/{task.total} RL steps"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    ) as bar:
        task = bar.add_task(label, total=cfg.rl.steps)
        return simulate(cfg, policy, realloc, progress=lambda n: bar.update(task, completed=n))


def write_result(result: SimResult, out: Path, summary: dict, meta: dict) -> None:
    with atomic_folder(out) as tmp:
        if result.timeline.enabled:
            write_table(tmp / "timeline.parquet", to_table("steps", result.timeline_frame()))
        write_table(tmp / "samples.parquet", to_table("samples", result.samples_frame()))
        write_table(tmp / "rl_steps.parquet", to_table("rl_steps", result.steps_frame()))
        (tmp / "config.yaml").write_text(yaml.safe_dump(result.config.model_dump(mode="json"), sort_keys=False))
        (tmp / "summary.json").write_text(json_text(summary))
        (tmp / "meta.json").write_text(json_text(meta))  # creation info: kept out of the summary


def run_and_write(
    cfg: SimConfig, policy: PolicySpec, realloc: str | None, out: Path, baseline: bool, console: Console
) -> dict:
    """Simulate, optionally simulate `off` on the same seed for the speedup, write the folder."""
    check_fits(cfg, policy=policy, out=out)  # memory and the output's disk, before any work
    result = run_with_progress(cfg, policy, realloc, console, f"simulating {cfg.name} ({policy})")
    summary = result.summary()
    if baseline and policy.family != "off":
        ref_cfg = cfg.model_copy(update={"record_timeline": False})
        ref = run_with_progress(ref_cfg, OFF_SPEC, realloc, console, "baseline (off, same seed)").summary()
        summary["off_generation_s"] = ref["generation_s"]
        summary["speedup_vs_off"] = ref["generation_s"] / summary["generation_s"]
        summary["rl_step_speedup_vs_off"] = ref["rl_step_s"] / summary["rl_step_s"]
    elif policy.family == "off":
        summary["speedup_vs_off"] = 1.0
    summary["out"] = str(out)
    meta = {
        "rlsched": __version__,
        "created_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "cost_model": result.cost.describe() if hasattr(result.cost, "describe") else None,
    }
    write_result(result, out, summary, meta)
    return summary
