"""The simulator's commands: presets, simulate and compare."""

from __future__ import annotations

import re
from pathlib import Path

import typer
from rich.table import Table

from rlsched.atomic import check_writable, json_text
from rlsched.cli.common import (
    ConfigOpt,
    CostOpt,
    JsonOpt,
    PresetOpt,
    SetOpt,
    _print_unwrapped,
    _with_cost,
    app,
    err_console,
    out_console,
)
from rlsched.distributed import import_ray
from rlsched.errors import UserError
from rlsched.policies.registry import usage as policy_usage


@app.command()
def presets(
    show: str | None = typer.Option(None, "--show", help="Print the full, resolved config of a job preset."),
    kind: str = typer.Option("jobs", "--kind", help="jobs, hardware or models."),
):
    """List the shipped presets (one line each), or print one in full."""
    from rlsched.config import load_config, load_preset_data, preset_names

    if kind not in ("jobs", "hardware", "models"):
        raise UserError(f"--kind '{kind}' is not one of jobs, hardware, models")
    if show:
        if kind == "jobs":
            cfg = load_config(preset=show)
            data = cfg.model_dump(mode="json")
        else:
            try:
                data = load_preset_data(kind, show)
            except ValueError as e:
                raise UserError(f"--show: {e}") from None
        import yaml

        print(yaml.safe_dump(data, sort_keys=False), end="")
        return
    names = preset_names(kind)
    width = max(len(n) for n in names)
    for name in names:  # one plain line each, easy to grep
        print(f"{name:<{width}}  {load_preset_data(kind, name).get('description', '')}")


def _default_out(name: str, policy: str, seed: int) -> Path:
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{name}-{policy}-seed{seed}")
    return Path("runs") / "simulate" / slug


@app.command()
def simulate(
    preset: str | None = PresetOpt,
    config: Path | None = ConfigOpt,
    policy: str | None = typer.Option(
        None,
        "--policy",
        help=f"Drafting policy: {policy_usage('simulator')} (default: the config's speculation.policy).",
    ),
    realloc: str | None = typer.Option(
        None,
        "--realloc",
        help="Reallocation policy: none, rebalance, consolidate (default: the config's cluster.realloc).",
    ),
    out: Path | None = typer.Option(
        None, "--out", "-o", help="Output folder (default runs/simulate/NAME-POLICY-seedN)."
    ),
    seed: int | None = typer.Option(None, "--seed", help="Random seed (overrides the config's seed)."),
    baseline: bool = typer.Option(
        True, "--baseline/--no-baseline", help="Also simulate `off` on the same seed to report the speedup."
    ),
    set_: list[str] = SetOpt,
    cost: Path | None = CostOpt,
    as_json: bool = JsonOpt,
):
    """Simulate the generation stage (and the RL steps around it) of a config or preset.

    Writes timeline.parquet (one row per engine step), samples.parquet, rl_steps.parquet,
    summary.json and the resolved config.yaml to the output folder.
    """
    from rlsched.config import load_config
    from rlsched.policies.realloc import make_realloc_policy
    from rlsched.policies.registry import make_draft_policy, parse_policy
    from rlsched.sim.output import run_and_write
    from rlsched.sim.simulate import policy_context

    overrides = list(set_) + ([f"seed={seed}"] if seed is not None else [])
    if seed is not None and seed < 0:
        raise UserError(f"--seed must be >= 0 (got {seed})")
    cfg = _with_cost(load_config(preset, config, overrides), cost)
    pol = parse_policy(policy) if policy else cfg.speculation.policy
    make_draft_policy(pol, policy_context(cfg, true_acceptance=lambda d, ids: None))
    make_realloc_policy(realloc or cfg.cluster.realloc)
    out = out or _default_out(cfg.name, pol.text, cfg.seed)
    check_writable(out, "--out")
    summary = run_and_write(cfg, pol, realloc, out, baseline, err_console)
    if as_json:
        print(json_text(summary))
    else:
        _print_summary(summary)


def _print_summary(s: dict) -> None:
    t = Table(title=f"rlsched simulate: {s['name']}  policy={s['policy']}  realloc={s['realloc']}  seed={s['seed']}")
    t.add_column("metric", style="bold")
    t.add_column("value", justify="right")
    add = t.add_row
    add("RL steps x samples", f"{s['rl_steps']} x {s['samples_per_step']} on {s['instances']} instance(s)")
    add("generation stage (s)", f"{s['generation_s']:.2f}")
    if "speedup_vs_off" in s:
        add("speedup vs off (same seed)", f"{s['speedup_vs_off']:.3f}x")
    add("tokens/s (generation)", f"{s['tokens_per_s']:,.0f}")
    add("mean accepted length (SD steps)", f"{s.get('mean_accept_len', float('nan')):.2f}")
    add("SD step fraction", f"{s.get('sd_step_fraction', 0):.2f}")
    idle = s["idle_fraction"]
    add("idle fraction (mean / max instance)", f"{sum(idle) / len(idle):.3f} / {max(idle):.3f}")
    split = s["time_split"]
    add("RL step time (s)", f"{s['rl_step_s']:.2f}")
    add(
        "time split gen/infer/train/draft-upd",
        " / ".join(f"{split[k]:.0%}" for k in ("generation", "inference", "training", "drafter_update")),
    )
    add("engine steps", f"{s['engine_steps']:,}")
    add("preemptions / migrated sequences", f"{s['preemptions']} / {s['migrations']}")
    add("output", s.get("out", ""))
    out_console.print(t)


COMPARE_HELP = (
    "Simulate several policies side by side on the same seeds and print one table.\n\n"
    "Every (policy, realloc, seed) combination is simulated. Ratios are formed per seed, then averaged: "
    "'x off' is off's generation-stage time / the policy's (same seed and realloc); 'x best static' is the "
    "fastest fixed setting's time on that seed (chosen after the fact among the static:K and tree:K:W:N policies "
    "listed) / the policy's. Above 1 is faster. `off` is added as the baseline when it is not listed.\n\n"
    "Runs go to --workers processes (default: one per CPU); --workers 1 runs them one after the other in this "
    "process; --ray sends them to a Ray cluster. The numbers are the same either way.\n\n"
    "Example: rlsched compare -p longtail-grpo --policies off,static:2,static:4,goodput --seeds 3 "
    "--plot compare.png --out runs/compare/longtail"
)
_POLICIES = typer.Option(
    "off,static:2,static:4,goodput",
    "--policies",
    "-P",
    help="Comma-separated drafting policies, e.g. off,static:2,static:4,goodput "
    "(any name `simulate --policy` takes; only commas separate names).",
)
_REALLOCS = typer.Option(
    None,
    "--realloc",
    help="Comma-separated reallocation policies, e.g. none,rebalance (default: the config's cluster.realloc).",
)
_SEEDS = typer.Option(3, "--seeds", help="Number of seeds; every policy runs on each.")
_FIRST_SEED = typer.Option(
    None, "--first-seed", help="First seed (default: the config's seed); seeds are FIRST..FIRST+N-1."
)
_PLOT = typer.Option(
    None,
    "--plot",
    help="Write a figure (.png or .pdf): speedup over off per "
    "policy, and batch size and k over time for the adaptive policies.",
)
_OUT = typer.Option(
    None,
    "--out",
    "-o",
    help="Write compare.json (every run's summary and the "
    "aggregate) and compare.parquet (one row per run) to this folder.",
)
_WORKERS = typer.Option(
    None, "--workers", "-j", help="Worker processes (default: the number of CPUs); 1 runs serially in this process."
)
_RAY = typer.Option(
    None,
    "--ray",
    help="Run on a Ray cluster at this address ('auto': the running "
    "local cluster; 'local': start a private one); needs pip install "
    "'rlsched\\[distributed]' on this machine and the same rlsched on "
    "every node; --workers is then ignored.",
)


@app.command(help=COMPARE_HELP)
def compare(
    preset: str | None = PresetOpt,
    config: Path | None = ConfigOpt,
    set_: list[str] = SetOpt,
    policies: str = _POLICIES,
    realloc: str | None = _REALLOCS,
    seeds: int = _SEEDS,
    first_seed: int | None = _FIRST_SEED,
    plot: Path | None = _PLOT,
    out: Path | None = _OUT,
    workers: int | None = _WORKERS,
    ray: str | None = _RAY,
    cost: Path | None = CostOpt,
    as_json: bool = JsonOpt,
):
    from rlsched.config import load_config
    from rlsched.sim import compare as cmp

    if workers is not None and workers < 1:
        raise UserError(f"--workers must be >= 1 (got {workers})")
    if seeds < 1:
        raise UserError(f"--seeds must be >= 1 (got {seeds})")
    cmp.check_out_path(out, plot)
    for path, option, folder in ((out, "--out", True), (plot, "--plot", False)):
        if path is not None:
            check_writable(path, option, folder=folder)
    if ray is not None:
        if not ray.strip():
            raise UserError("--ray needs an address (host:port) or 'auto'")
        import_ray("--ray")
    cfg = _with_cost(load_config(preset, config, list(set_)), cost)
    plan = cmp.make_plan(cfg, policies, realloc, seeds, first_seed, trace_instance=0 if plot else None)
    results = _run_compare(cfg, plan, workers, ray)
    report = cmp.aggregate(cfg, plan, results)
    if out is not None:
        cmp.write_report(report, out)
    if plot is not None:
        from rlsched.analysis.plots import plot_compare

        plot_compare(report, cmp.traces_for_plot(plan, results), plot)
    table = cmp.rich_table(report)
    if as_json:
        _print_unwrapped(err_console, table)
        print(json_text(report))
    else:
        _print_unwrapped(out_console, table)
        for label, path in (("output", out), ("plot", plot)):
            if path is not None:
                out_console.print(f"{label}: {path}", highlight=False)


def _run_compare(cfg, plan, workers: int | None, ray: str | None) -> list[dict]:
    """Every run of the compare plan, with a progress bar on stderr (a terminal's only)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from rlsched.sim.runs import default_workers, run_jobs

    jobs = plan.jobs()
    n_workers = workers or default_workers()
    where = (
        f"Ray at {ray}"
        if ray is not None
        else ("1 process" if n_workers == 1 or len(jobs) == 1 else f"{min(n_workers, len(jobs))} processes")
    )
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("runs"),
        TimeElapsedColumn(),
        console=err_console,
        transient=True,
        disable=not err_console.is_terminal,
    ) as bar:  # a pipe would get a stray blank line
        task = bar.add_task(
            f"comparing {len(plan.policies)} policies x {len(plan.reallocs)} realloc x "
            f"{len(plan.seeds)} seeds on {where}",
            total=len(jobs),
        )
        return run_jobs(cfg, jobs, n_workers, ray, on_done=lambda r: bar.advance(task))
