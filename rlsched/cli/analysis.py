"""The commands that read what was measured: fit, plot, report, replay and import-vllm."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from rlsched.atomic import check_writable, json_text
from rlsched.cli.common import JsonOpt, _print_unwrapped, app, err_console, out_console
from rlsched.errors import UserError

FIT_HELP = (
    "Fit the cost model to measured step times and write a cost-model file for --cost.\n\n"
    "PROFILE_OR_RUNDIR is a `rlsched profile` folder, a run folder (`generate`, `run`): anything holding "
    "traces/steps/, or an engine-core trace folder (engine-*.json, steps/: the trace_dir of rlsched's scheduler "
    "inside vLLM; steps whose drafting was not timed, draft_ms NaN, and mixed prefill/decode steps are left out, "
    "with a note). Verify, prefill and each drafter's draft time (and a model drafter's feed, where "
    "profiled) are fitted as functions of batch size, tokens per row and context per row (roofline-shaped "
    "forms, rlsched/costs/costfile.py) with scipy. Quality is "
    "R^2 and MAPE; held-out MAPE comes from a fit without every other batch size (or without a random 25% of a "
    "run's steps). An op whose held-out MAPE is above --max-mape, where interpolation over the measured grid "
    "does better, is priced by that interpolation instead (the table and the file say so).\n\n"
    "The file holds the costs of the profiled machine and models; `simulate`, `compare` and `learn --cost FILE` "
    "use them whatever the config's model and hardware presets are.\n\n"
    "Example: rlsched profile --out runs/profile/builtin && rlsched fit runs/profile/builtin --out costmodel.json "
    "--plot fit.png"
)


@app.command(help=FIT_HELP)
def fit(
    profile_or_rundir: Path = typer.Argument(
        ...,
        metavar="PROFILE_OR_RUNDIR",
        help="A `rlsched profile` folder, a run folder (holding traces/steps/) or an engine-core trace folder.",
        show_default=False,
    ),
    out: Path = typer.Option(..., "--out", "-o", help="Where to write the cost-model file (.json)."),
    plot: Path | None = typer.Option(
        None,
        "--plot",
        help="Also draw measured points against the fit per batch size and k, with residuals (.png or .pdf).",
    ),
    max_mape: float = typer.Option(
        5.0,
        "--max-mape",
        help="Held-out MAPE (%) above which an op falls back to "
        "interpolation over the measured grid (where that does better).",
    ),
    as_json: bool = JsonOpt,
):
    from rlsched.analysis.engine import fit_folder
    from rlsched.atomic import write_text_atomic

    if out.suffix != ".json":
        raise UserError(f"--out '{out}' must end in .json")
    if out.is_dir():
        raise UserError(f"--out '{out}' is a folder; give a file name ending in .json")
    if plot is not None and plot.suffix.lower() not in (".png", ".pdf"):
        raise UserError(f"--plot '{plot}' must end in .png or .pdf")
    if not 0 < max_mape <= 1e6:  # NaN included
        raise UserError(f"--max-mape must be a percentage above 0 and at most 1e6 (got {max_mape})")
    check_writable(out, "--out", folder=False)
    if plot is not None:
        check_writable(plot, "--plot", folder=False)
    with err_console.status(f"fitting {profile_or_rundir}"):
        result = fit_folder(profile_or_rundir, max_mape / 100)
        figure = None
        if plot is not None:
            from rlsched.analysis.plots import fit_figure

            figure = fit_figure(result)
    write_text_atomic(out, json_text(result.to_json()) + "\n")
    if figure is not None and plot is not None:
        from rlsched.analysis.plots import save_figure

        save_figure(figure, plot)
    table = _fit_table(result, out)
    console = err_console if as_json else out_console
    _print_unwrapped(console, table)
    for note in result.notes:
        console.print(f"note: {note}", highlight=False, soft_wrap=True)
    if plot is not None:
        console.print(f"plot: {plot}", highlight=False)
    if as_json:
        print(json_text({"out": str(out), "plot": str(plot) if plot else None, **result.summary()}))


def _fit_table(result, out: Path) -> Table:
    pct = lambda v: "-" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    t = Table(title=f"rlsched fit: {result.source.get('path')} -> {out}")
    for col in (
        "op",
        "priced by",
        "R^2",
        "MAPE",
        "MAPE train",
        "MAPE held-out",
        "interp. held-out",
        "points",
        "held out",
    ):
        t.add_column(col, justify="left" if col in ("op", "priced by", "held out") else "right")
    for key, f in result.ops.items():
        q = f.quality
        t.add_row(
            key,
            "fitted form" if f.used == "parametric" else "interpolation",
            f"{q['r2']:.4f}",
            pct(q["mape"]),
            pct(q["mape_train"]),
            pct(q["mape_heldout"]),
            pct(q["interp_mape_heldout"]),
            str(q["points"]),
            f"{q['heldout_points']}: {q['heldout']}" if q["heldout_points"] else q["heldout"],
        )
    return t


PLOT_HELP = (
    "Draw the figures a folder's data supports, as PNG and PDF, and print the files written.\n\n"
    "FOLDER is a `rlsched run`, `generate`, `profile`, `simulate` or `compare --out` folder, or an engine-core "
    "trace folder (engine-*.json, steps/, samples/: the trace_dir of rlsched's scheduler inside vLLM). Figures: "
    "fit (the cost-model fit of the folder's profile, or of --cost's file over the folder's steps), speedup (of "
    "each k over plain decoding against batch size, predicted from measured step costs at the measured "
    "acceptance, and measured from the run's own steps where they allow), acceptance (over RL steps), batch_k "
    "(batch size and chosen k over time per instance, one RL step), step_times (each engine step's time, of an "
    "engine-core trace), stages (seconds per stage of each RL step), learning_curve (a run's), compare (a compare "
    "folder's speedups). Those the data does not support are listed on stderr.\n\n"
    "Example: rlsched plot runs/run/latest && rlsched plot runs/profile/builtin --out figs"
)


@app.command(help=PLOT_HELP)
def plot(
    folder: Path = typer.Argument(
        ...,
        metavar="FOLDER",
        help="A run, generate, profile, simulate or compare output folder, or an engine-core trace folder.",
        show_default=False,
    ),
    out: Path | None = typer.Option(None, "--out", "-o", help="Folder for the figures (default FOLDER/plots)."),
    cost: Path | None = typer.Option(
        None,
        "--cost",
        help="A cost-model file (`rlsched fit`): draw its fit over "
        "the folder's step times, and price the speedup figure with it where the "
        "folder holds no profile.",
    ),
    rl_step: int | None = typer.Option(
        None, "--rl-step", help="The RL step of the batch-size and k figure (default: the first)."
    ),
    acceptance: float | None = typer.Option(
        None,
        "--acceptance",
        help="Per-token acceptance for the predicted "
        "speedups (default: measured from the folder's speculative steps; "
        "0.7 where it has none, e.g. a profile).",
    ),
    as_json: bool = JsonOpt,
):
    if out is not None and out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: exists and is not a folder")
    if acceptance is not None and not 0 < acceptance < 1:  # NaN included
        raise UserError(f"--acceptance must be between 0 and 1 (got {acceptance})")
    if out is not None or folder.is_dir():  # a folder that is not there is load_folder's to name
        check_writable(out if out is not None else folder / "plots", "--out")
    from rlsched.analysis.folder import figures_for, load_folder, write_figures

    cost_data = _read_cost(cost)
    with err_console.status(f"drawing {folder}"):
        data = load_folder(folder)
        figs, skipped = figures_for(data, cost_data, cost, rl_step, acceptance)
        if not figs:
            raise UserError(f"'{folder}' has nothing to plot: " + "; ".join(f"{k}: {v}" for k, v in skipped.items()))
        out = out if out is not None else folder / "plots"
        paths = write_figures(figs, out)
    for name, why in skipped.items():
        err_console.print(f"not drawn: {name} ({why})", highlight=False, soft_wrap=True)
    if as_json:
        print(
            json_text(
                {
                    "folder": str(folder),
                    "kind": data.kind,
                    "out": str(out),
                    "files": [str(p) for p in paths],
                    "figures": list(figs),
                    "skipped": skipped,
                }
            )
        )
    else:
        for p in paths:
            print(p)


def _read_cost(cost: Path | None):
    from rlsched.costs.costfile import read_cost_file

    return read_cost_file(cost) if cost is not None else None


REPORT_HELP = (
    "Write one self-contained HTML page of a run: its key numbers (reward first -> last, generation tokens/s, "
    "mean accepted length, acceptance rate, stage split, policy, drafter, algorithm, steps) and every figure "
    "`rlsched plot` draws for it, embedded as PNG (the page is one file, no scripts).\n\n"
    "RUNDIR is a `rlsched run` folder (other folders `rlsched plot` takes work too, with their summary's numbers, "
    "an engine-core trace folder with its engines' settings, windows, tokens/s and acceptance, and an `rlsched "
    "plan` folder).\n\n"
    "Example: rlsched report runs/run/latest --out report.html"
)


@app.command(help=REPORT_HELP)
def report(
    rundir: Path = typer.Argument(..., metavar="RUNDIR", help="A `rlsched run` output folder.", show_default=False),
    out: Path | None = typer.Option(None, "--out", "-o", help="The page to write (.html; default RUNDIR/report.html)."),
    cost: Path | None = typer.Option(None, "--cost", help="A cost-model file (`rlsched fit`), as for `rlsched plot`."),
    as_json: bool = JsonOpt,
):
    if out is not None and (out.suffix.lower() not in (".html", ".htm") or out.is_dir()):
        raise UserError(f"--out {out}: give a file name ending in .html")
    if out is not None or rundir.is_dir():  # a run folder that is not there is build_report's to name
        check_writable(out if out is not None else rundir / "report.html", "--out", folder=False)
    from rlsched.analysis.report import build_report
    from rlsched.atomic import write_text_atomic

    cost_data = _read_cost(cost)
    with err_console.status(f"writing the report of {rundir}"):
        page, info = build_report(rundir, cost_data, cost)
        out = out if out is not None else rundir / "report.html"
        write_text_atomic(out, page)
    info["out"] = str(out)
    if as_json:
        print(json_text(info))
    else:
        print(f"report: {out} ({len(info['figures'])} figures: {', '.join(info['figures'])})")


REPLAY_HELP = (
    "Replay a `rlsched run`, or an engine-core trace folder, in the simulator: each RL step's rollout is rebuilt "
    "from the traces (prompt and response lengths, each sample's acceptance) and its generation stage simulated "
    "with the run's policy, batch limit and k_max; predicted against measured seconds per step (MAPE, worst step), "
    "and the predicted speedup of the run's SD over SD off.\n\n"
    "An engine-core trace folder (the trace_dir of rlsched's scheduler inside vLLM: engine-*.json, steps/, "
    "samples/) is replayed per window (rl_step: what an engine ran between two weight updates) with each engine's "
    "policy, max_num_seqs and num_speculative_tokens, each engine an instance; a window's measured time is the span "
    "of its step records. Such a trace holds no RL stage times or request arrivals: the notes say what the replay "
    "could not know.\n\n"
    "Step costs: --cost (a `rlsched fit` file), or fitted from the folder's own step records; the engine's time "
    "between steps is charged per step as measured. --baseline FOLDER (the same job with SD off) adds the measured "
    "speedup beside the predicted one.\n\n"
    "Example: rlsched replay runs/run/latest --plot replay.png"
)


@app.command(help=REPLAY_HELP)
def replay(
    rundir: Path = typer.Argument(
        ..., metavar="FOLDER", help="A `rlsched run` output folder or an engine-core trace folder."
    ),
    cost: Path | None = typer.Option(
        None, "--cost", help="Cost-model file from `rlsched fit` (default: fit the folder's own step records)."
    ),
    policy: str | None = typer.Option(None, "--policy", help="Replay with another drafting policy (what-if)."),
    baseline: Path | None = typer.Option(
        None, "--baseline", help="The same job with SD off (a run or engine-core trace folder): measured speedup."
    ),
    plot: Path | None = typer.Option(
        None, "--plot", help="Figure of measured and predicted time per step (.png or .pdf)."
    ),
    as_json: bool = JsonOpt,
):
    from rlsched.analysis.replay import measured_generation_s, replay_figure, replay_run

    if plot is not None and plot.suffix.lower() not in (".png", ".pdf"):
        raise UserError(f"--plot {plot}: the file name must end in .png or .pdf")
    if plot is not None:
        check_writable(plot, "--plot", folder=False)
    result = replay_run(rundir, cost, policy)
    summary = result.summary()
    if baseline is not None:
        measured = measured_generation_s(baseline) / float(result.steps["measured_s"].sum())
        summary.update(
            measured_sd_speedup=measured,
            baseline=str(baseline),
            speedup_error_pct=(summary["predicted_sd_speedup"] / measured - 1) * 100,
        )
    if plot is not None:
        from rlsched.analysis.plots import save_figure

        save_figure(replay_figure(result), plot)
        summary["plot"] = str(plot)
    if result.kind == "engine":
        summary["windows"] = result.steps.to_dict(orient="records")
    if as_json:
        print(json_text(summary))
        return
    if result.kind == "engine":
        _print_unwrapped(out_console, _window_table(result, rundir))
    _print_unwrapped(out_console, _replay_table(result, summary, rundir, baseline, plot))
    for note in result.notes:
        err_console.print(f"note: {note}", highlight=False, soft_wrap=True)


def _window_table(result, folder: Path) -> Table:
    """Measured against predicted seconds of each window of an engine-core trace."""
    t = Table(title=f"rlsched replay {folder}: windows (rl_step = weight updates), slowest engine each")
    for col in ("window", "engines", "samples", "measured s", "predicted s", "error", "predicted off s"):
        t.add_column(col, justify="right")
    for r in result.steps.itertuples(index=False):
        t.add_row(
            str(r.rl_step),
            str(r.engines),
            str(r.samples),
            f"{r.measured_s:.3f}",
            f"{r.predicted_s:.3f}",
            f"{r.error * 100:+.1f}%",
            f"{r.predicted_off_s:.3f}",
        )
    return t


def _replay_table(result, summary: dict, rundir: Path, baseline: Path | None, plot: Path | None) -> Table:
    what, one = ("windows", "window") if result.kind == "engine" else ("RL steps", "step")
    t = Table(title=f"rlsched replay {rundir}: policy={result.policy} drafter={result.drafter or 'off'}")
    t.add_column("metric", style="bold")
    t.add_column("value", justify="right")
    t.add_row(what, str(summary["rl_steps"]))
    t.add_row(
        "generation s: measured / predicted",
        f"{summary['measured_generation_s']:.2f} / {summary['predicted_generation_s']:.2f}",
    )
    t.add_row(f"per-{one} MAPE", f"{summary['mape_pct']:.1f}%")
    t.add_row(f"worst {one}", f"{summary['worst_step']} ({summary['worst_error_pct']:+.1f}%)")
    t.add_row("predicted SD speedup over off", f"{summary['predicted_sd_speedup']:.3f}x")
    if baseline is not None:
        t.add_row(
            "measured SD speedup (baseline)",
            f"{summary['measured_sd_speedup']:.3f}x ({summary['speedup_error_pct']:+.1f}% off)",
        )
    who = "engine" if result.kind == "engine" else "executor"
    t.add_row(f"{who} time between steps", f"{summary['overhead_ms_per_step']:.2f} ms per step")
    if plot is not None:
        t.add_row("plot", str(plot))
    return t


IMPORT_VLLM_HELP = (
    "Import vLLM's speculative-decoding metrics as step traces that `rlsched fit DIR` reads.\n\n"
    "METRICS is a sequence of vLLM metric snapshots: LLM.get_metrics() as JSON (bench/peers/vllm_spec_metrics.py "
    "writes one after each generate call) or Prometheus text from /metrics (scrapes separated by '# rlsched-snapshot "
    "{...}' lines). Each interval between snapshots becomes a decode record (counter deltas; plain engines also a "
    "prefill record) in DIR/traces/steps/, and DIR/vllm.json holds the intervals, acceptance per draft position and "
    "what is exact and what approximate. vLLM does not separate draft time from verify time: fit prices verify from "
    "the plain (k = 0) steps and prefill, and no drafter (rlsched/traces/vllm_metrics.py says more)."
)


@app.command("import-vllm", help=IMPORT_VLLM_HELP)
def import_vllm(
    metrics: Path = typer.Argument(
        ..., metavar="METRICS", help="METRICS.json or Prometheus text (.prom).", show_default=False
    ),
    out: Path = typer.Option(..., "--out", "-o", help="Output folder (traces/steps/ and vllm.json)."),
    k: int | None = typer.Option(
        None, "--k", help="Draft length (num_speculative_tokens) where the file does not say it."
    ),
    drafter: str | None = typer.Option(
        None, "--drafter", help="Drafter name of the speculative records (default: the file's, else 'vllm')."
    ),
    as_json: bool = JsonOpt,
):
    from rlsched.traces.vllm_metrics import import_vllm as run_import
    from rlsched.traces.vllm_metrics import report

    check_writable(out, "--out")
    summary = run_import(metrics, out, k, drafter)
    if as_json:
        print(json_text(summary))
        return
    cols, rows, lines = report(summary)
    t = Table(title=f"rlsched import-vllm: {metrics} -> {out}")
    for c in cols:
        t.add_column(c, justify="left" if c in ("interval", "drafter") else "right")
    for r in rows:
        t.add_row(*r)
    _print_unwrapped(out_console, t)
    for line in lines:
        out_console.print(line, highlight=False, soft_wrap=True)
