"""Every figure rlsched draws (matplotlib, headless). Never imports torch, never touches pyplot's global state:
figures are built with `matplotlib.figure.Figure` and saved through the Agg (PNG) or PDF
canvas, so they work without a display and inside worker processes."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np
import pandas as pd

matplotlib.use("Agg")  # in case anything downstream reaches for pyplot: never a GUI backend

from matplotlib.figure import Figure  # noqa: E402

from rlsched.atomic import atomic_path  # noqa: E402
from rlsched.errors import UserError  # noqa: E402

FORMATS = {".png": "png", ".pdf": "pdf"}
DPI = 120
MAX_PANELS = 8  # instances drawn in the batch/k figure
BELOW: dict[str, Any] = {"loc": "upper center", "bbox_to_anchor": (0.5, -0.16), "ncol": 4}  # a legend under the axes


def save_figure(fig: Figure, path: Path) -> None:
    """Save atomically (temp file, then rename), the format from the suffix (.png or .pdf)."""
    path = Path(path)
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ValueError(f"{path}: the file name must end in .png or .pdf")
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format=fmt, dpi=DPI, bbox_inches="tight")


def figure_png(fig: Figure) -> bytes:
    """The figure as PNG bytes (as save_figure writes it), e.g. to embed in a page."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight")
    return buf.getvalue()


def compare_figure(report: dict, traces: list[dict]) -> Figure:
    """(a) speedup over `off` per policy (bars: mean over seeds, whiskers: min-max), one bar
    per realloc policy; (b) batch size and (c) chosen k over time on one instance in the first
    RL step of the first seed, one step line per adaptive policy."""
    reallocs = report["realloc"]
    policies = report["policies"]
    panels = 3 if traces else 1
    fig = Figure(
        figsize=(max(6.5, 1.1 * len(policies) * max(1, len(reallocs)) + 2), 3.6 + 2.6 * (panels - 1)),
        layout="constrained",
    )
    heights = [1.4] + [1] * (panels - 1)
    axes = fig.subplots(panels, 1, gridspec_kw={"height_ratios": heights}, squeeze=False)[:, 0]

    ax = axes[0]
    width = 0.8 / len(reallocs)
    stats = {(a["policy"], a["realloc"]): a["speedup_vs_off"] for a in report["aggregate"]}
    for j, realloc in enumerate(reallocs):
        xs, means, lo, hi = [], [], [], []
        for i, p in enumerate(policies):
            st = stats.get((p, realloc))
            if st is None:
                continue
            xs.append(i - 0.4 + width * (j + 0.5))
            means.append(st["mean"])
            lo.append(st["mean"] - st["min"])
            hi.append(st["max"] - st["mean"])
        bars = ax.bar(
            xs, means, width * 0.9, yerr=[lo, hi], capsize=3, label=f"realloc={realloc}" if len(reallocs) > 1 else None
        )
        ax.bar_label(bars, labels=[f"{m:.2f}x" for m in means], padding=2, fontsize=8)
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(policies)), policies)
    ax.set_ylabel("speedup over off")
    seeds = report["seeds"]
    ax.set_title(
        f"{report['name']}: generation-stage speedup over off (mean of {len(seeds)} seed(s); whiskers min-max)",
        fontsize=10,
    )
    if len(reallocs) > 1:
        ax.legend(fontsize=8)
    ax.margins(y=0.15)

    if traces:
        ax_b, ax_k = axes[1], axes[2]
        for tr in traces:
            t = list(tr["time_s"]) + [tr["end_s"]]
            ax_b.step(t, list(tr["batch"]) + [tr["batch"][-1]], where="post", label=tr["label"], linewidth=1.2)
            ax_k.step(t, list(tr["k"]) + [tr["k"][-1]], where="post", label=tr["label"], linewidth=1.2)
        first = traces[0]
        ax_b.set_ylabel("batch size")
        ax_b.set_title(
            f"instance {first['instance']}, RL step {first['rl_step']}, seed {first['seed']}: "
            "batch size and chosen k per engine step",
            fontsize=10,
        )
        ax_b.legend(fontsize=8)
        ax_k.set_ylabel("draft length k (0 = off)")
        ax_k.set_xlabel("time since the rollout began (s)")
        ax_k.sharex(ax_b)
        ax_k.yaxis.get_major_locator().set_params(integer=True)
        ax_k.set_ylim(-0.3, max(max(tr["k"]) for tr in traces) + 0.5)
        ax_b.set_ylim(bottom=0)
    return fig


def plan_figure(plan: dict) -> Figure:
    """A plan (`plan.json`): each setup's RL step time against the GPUs it holds: screened
    estimates (grey), simulated means (blue), the fastest plain decoding setup per GPU count
    (red), the workload's own setup and the winner; the line joins the simulated Pareto front
    (no setup both faster and on fewer GPUs)."""
    rows = pd.DataFrame(plan["rows"])
    s = plan["summary"]
    fig = Figure(figsize=(7.0, 4.4), layout="constrained")
    ax = fig.subplots()
    counts = sorted(set(rows["gpus"]) | {s["winner_gpus"], s.get("own_gpus", s["winner_gpus"])})
    slot = {g: i for i, g in enumerate(counts)}  # one column a GPU count, setups spread in it by tp
    x = rows["gpus"].map(slot) + rows["tp"].map({1: -0.15, 2: -0.05, 4: 0.05, 8: 0.15}).fillna(0.0)
    screened = rows[rows["step_s"].isna()]
    ax.scatter(x[screened.index], screened["screen_step_s"], s=8, color="0.75", label="screened (estimate)")
    sim = rows[rows["step_s"].notna()]
    ax.scatter(x[sim.index], sim["step_s"], s=18, color="C0", label="simulated (mean over seeds)")
    front, best = [], float("inf")
    for g, grp in sim.groupby("gpus"):
        if grp["step_s"].min() < best:
            best = grp["step_s"].min()
            front.append((slot[g], best))
    if len(front) > 1:
        ax.plot(*zip(*front), color="C0", linewidth=1.0, drawstyle="steps-post")
    off = rows[rows["policy"] == "off"].assign(t=lambda d: d["step_s"].fillna(d["screen_step_s"]))
    off = off.loc[off.groupby("gpus")["t"].idxmin()]
    ax.plot(
        off["gpus"].map(slot), off["t"], "s--", color="C3", markersize=5, linewidth=0.8, label="no speculation (best)"
    )
    if s.get("own_setup"):
        ax.scatter(
            [slot[s["own_gpus"]]],
            [s["own_step_s"]],
            marker="D",
            s=50,
            facecolor="none",
            edgecolor="C2",
            linewidth=1.5,
            label="the workload's own setup",
        )
    ax.scatter([slot[s["winner_gpus"]]], [s["winner_step_s"]], marker="*", s=160, color="C1", zorder=5, label="winner")
    ax.set_xlabel("GPUs held")
    ax.set_ylabel("RL step time (s)")
    ax.set_xticks(range(len(counts)), [str(g) for g in counts])
    ax.set_xlim(-0.6, len(counts) - 0.4)
    ax.set_ylim(bottom=0)
    ax.set_title(
        f"{s['model']} on {s['gpus']} x {s['hardware']}, {s['workload']}: {s['candidates']} setups, "
        f"{s['simulations']} simulations\nwinner: {s['winner']}",
        fontsize=9,
    )
    ax.legend(fontsize=7, **{**BELOW, "ncol": 3})
    return fig


def plot_compare(report: dict, traces: list[dict], path: Path) -> None:
    save_figure(compare_figure(report, traces), path)


STAGES = ("generation", "inference", "training", "drafter_update")


def reward_panel(ax, df) -> None:
    """Mean reward per RL step of `df` (rl_steps records, sorted), band: +-1 standard error."""
    x = df["rl_step"].to_numpy()
    mean = df["reward_mean"].to_numpy()
    sem = df["reward_std"].to_numpy() / np.sqrt(np.maximum(df["samples"].to_numpy(), 1))
    ax.plot(x, mean, marker=".", label="reward (mean)")
    ax.fill_between(x, mean - sem, mean + sem, alpha=0.25, label="+-1 standard error")
    ax.set(xlabel="RL step", ylabel="reward", title="reward")
    ax.legend(fontsize="small")


def speculation_panel(ax, df, estimates: bool = False, legend: dict | None = None) -> None:
    """Mean accepted length (tokens per SD step, left axis) and acceptance rate (accepted /
    drafted, right axis) per RL step of `df` (rl_step, mean_accept_len, accept_rate, sorted);
    with `estimates`, also every accept_mean_<drafter> column (per-token acceptance) on the
    right axis, dashed. `legend`: the legend's placement (default upper left, inside)."""
    x = df["rl_step"].to_numpy()
    lines = ax.plot(x, df["mean_accept_len"], marker=".", label="tokens per SD step")
    ax.set(xlabel="RL step", ylabel="tokens per SD step", title="speculation")
    extra = [c for c in df.columns if c.startswith("accept_mean_")] if estimates else []
    if df["accept_rate"].notna().any() or extra:
        twin = ax.twinx()
        lines += twin.plot(x, df["accept_rate"], color="C1", marker=".", label="acceptance rate")
        for i, col in enumerate(extra):
            lines += twin.plot(
                x,
                df[col],
                color=f"C{2 + i}",
                ls="--",
                marker=".",
                label=f"per-token acceptance, {col.removeprefix('accept_mean_')} (estimate)",
            )
        twin.set_ylabel("acceptance rate (accepted / drafted)")
        twin.set_ylim(0, 1)
    ax.legend(lines, [ln.get_label() for ln in lines], fontsize="small", **(legend or {"loc": "upper left"}))


def stage_panel(ax, df, legend: dict | None = None) -> None:
    """Seconds per stage of each RL step of `df` (rl_steps records, sorted), stacked bars."""
    x = df["rl_step"].to_numpy()
    bottom = 0 * x.astype(float)
    for stage in STAGES:
        v = df[f"{stage}_s"].to_numpy()
        ax.bar(x, v, bottom=bottom, label=stage)
        bottom = bottom + v
    ax.set(xlabel="RL step", ylabel="seconds", title="time per stage")
    ax.legend(fontsize="small", **(legend or {}))


def run_figure(rl_steps) -> Figure:
    """An RL run's learning curve: (a) mean reward per RL step (band: +-1 standard error),
    (b) mean accepted length and acceptance rate of the drafter (drift and recovery), (c)
    seconds per stage of each RL step, stacked."""
    df = rl_steps.sort_values("rl_step")
    fig = Figure(figsize=(12, 3.6))
    for i, panel in enumerate((reward_panel, speculation_panel, stage_panel)):
        panel(fig.add_subplot(1, 3, i + 1), df)
    fig.tight_layout()
    return fig


def plot_run(rl_steps, out: Path) -> list[Path]:
    """The run's figures under `out/plots/`: learning_curve.png and .pdf."""
    fig = run_figure(rl_steps)
    paths = [Path(out) / "plots" / "learning_curve.png", Path(out) / "plots" / "learning_curve.pdf"]
    for p in paths:
        save_figure(fig, p)
    return paths


# ----------------------------------------------------------------------------- a folder's figures


def speedup_figure(
    predicted: pd.DataFrame | None, measured: pd.DataFrame | None, title: str = "", measured_title: str = ""
) -> Figure:
    """Speedup of each draft length k over plain decoding against batch size, one line per k.

    Left panel, `predicted`: per-step speedup from measured step costs (a profile's verify and
    draft times, or a fitted cost-model file) at an acceptance rate, expected tokens per row
    (1 - a^(k+1)) / (1 - a) x plain step time / (verify + draft time). This is the panel to read:
    every (batch, k) is timed on the same inputs side by side, so the ratio is clean, and it
    covers every k at every batch size. Right panel, `measured` (drawn only where a run's own
    decode steps give it): tokens per row per second of steps with k over steps with k = 0 in
    the same batch-size bucket. It checks the prediction, but it is observational: an adaptive
    policy picks k by batch size, so the buckets that hold both are few, and their steps differ
    in context length and timing noise."""
    panels = [x for x in (predicted, measured) if x is not None]
    if not panels:
        raise ValueError("speedup_figure needs predicted or measured speedups")
    fig = Figure(figsize=(6.2 * len(panels), 4.2), layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, df, t, style in zip(
        axes,
        panels,
        [title if predicted is not None else measured_title, measured_title],
        ["-", ":"] if predicted is not None else [":"],
    ):
        for k, g in df.sort_values(["k", "batch"]).groupby("k"):
            ax.plot(
                g["batch"],
                g["speedup"],
                marker="o",
                ms=3.5,
                ls=style,
                color=f"C{(int(k) - 1) % 10}",
                label=f"k={int(k)}",
            )
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set(xlabel="batch size (rows)", ylabel="speedup over plain decoding (x)")
        ax.set_title(t, fontsize=9)
        ax.legend(fontsize="x-small", ncol=2)
    return fig


def acceptance_figure(per_step: pd.DataFrame) -> Figure:
    """Mean accepted length (tokens per SD step per row) and acceptance rate (accepted / drafted)
    over RL steps, with the drafters' per-token acceptance estimates (accept_mean_<drafter>)
    where recorded: the drafter's drift as the policy trains away from it, and its recovery
    after each update (plots.speculation_panel)."""
    fig = Figure(figsize=(8, 4.4), layout="constrained")
    speculation_panel(fig.add_subplot(1, 1, 1), per_step.sort_values("rl_step"), estimates=True, legend=BELOW)
    fig.axes[0].set_title("acceptance over RL steps")
    return fig


def stage_figure(rl_steps: pd.DataFrame) -> Figure:
    """Seconds per stage of each RL step, stacked: generation, inference, training, drafter
    update (plots.stage_panel)."""
    fig = Figure(figsize=(max(6.0, min(14.0, 0.18 * len(rl_steps) + 4)), 4), layout="constrained")
    stage_panel(fig.add_subplot(1, 1, 1), rl_steps.sort_values("rl_step"), legend=BELOW)
    fig.axes[0].set_title("time per stage of each RL step")
    return fig


def batch_k_figure(steps: pd.DataFrame, rl_step: int | None = None) -> Figure:
    """Batch size (left axis) and chosen draft length k (right axis, 0 = off) of every decode
    step over time since the RL step's rollout began, one panel per instance (the first
    MAX_PANELS), in RL step `rl_step` (default: the first)."""
    dec = steps[steps["kind"] == "decode"]
    if dec.empty:
        raise UserError("no decode steps to draw batch size and k from")
    have = sorted(int(s) for s in dec["rl_step"].unique())
    if rl_step is None:
        rl_step = have[0]
    elif rl_step not in have:
        raise UserError(f"--rl-step {rl_step}: the step records hold RL steps {have[0]}..{have[-1]}")
    one = dec[dec["rl_step"] == rl_step].sort_values(["instance", "time_s", "step"])
    start = float(steps.loc[steps["rl_step"] == rl_step, "time_s"].min())
    instances = sorted(int(i) for i in one["instance"].unique())
    shown = instances[:MAX_PANELS]
    fig = Figure(figsize=(8, 2.3 * len(shown) + 0.6), layout="constrained")
    axes = fig.subplots(len(shown), 1, squeeze=False, sharex=True)[:, 0]
    kmax = int(one["k"].max())
    for ax, inst in zip(axes, shown):
        g = one[one["instance"] == inst]
        t = g["time_s"].to_numpy(float) - start
        lines = ax.step(t, g["batch"].to_numpy(), where="post", color="C0", lw=1.2, label="batch size")
        ax.set_ylabel("batch size")
        ax.set_ylim(bottom=0)
        twin = ax.twinx()
        lines += twin.step(t, g["k"].to_numpy(), where="post", color="C1", lw=1.0, label="k (0 = off)")
        twin.set_ylabel("draft length k")
        twin.set_ylim(-0.3, kmax + 0.5)
        twin.yaxis.get_major_locator().set_params(integer=True)
        ax.set_title(f"instance {inst}", fontsize=9, loc="left")
        ax.legend(lines, [ln.get_label() for ln in lines], fontsize="x-small", loc="upper right")
    axes[-1].set_xlabel("time since the rollout began (s)")
    more = f" (first {len(shown)} of {len(instances)} instances)" if len(instances) > len(shown) else ""
    fig.suptitle(f"RL step {rl_step}: batch size and chosen k per decode step{more}", fontsize=10)
    return fig


def step_time_figure(steps: pd.DataFrame) -> Figure:
    """Each engine step's time over the trace, one panel per engine (the first MAX_PANELS;
    column `engine`, else `instance`): decode steps coloured by k (0 = off), prefill and mixed
    steps as crosses, dashed lines where a window (rl_step) begins. Times are each engine's
    own clock (seconds since it started)."""
    key = "engine" if "engine" in steps else "instance"
    engines = sorted(steps[key].unique(), key=str)
    shown = engines[:MAX_PANELS]
    fig = Figure(figsize=(8, 2.3 * len(shown) + 0.6), layout="constrained")
    axes = fig.subplots(len(shown), 1, squeeze=False)[:, 0]
    for ax, name in zip(axes, shown):
        g = steps[steps[key] == name].sort_values("time_s")
        dec = g[g["kind"] == "decode"]
        for k, gk in dec.groupby("k"):
            ax.plot(gk["time_s"], gk["step_ms"], ".", ms=4, color=f"C{int(k) % 10}", label=f"k={int(k)}")
        other = g[g["kind"] != "decode"]
        if len(other):
            ax.plot(other["time_s"], other["step_ms"], "x", ms=5, color="k", label="prefill / mixed")
        for t in g.groupby("rl_step")["time_s"].min().iloc[1:]:
            ax.axvline(t, color="grey", ls="--", lw=0.8)
        ax.set_ylabel("step (ms)")
        ax.set_ylim(bottom=0)
        ax.set_title(f"engine {name}", fontsize=9, loc="left")
        ax.legend(fontsize="x-small", ncol=3, loc="upper right")
    axes[-1].set_xlabel("time since the engine started (s); dashed: a window (rl_step) begins")
    more = f" (first {len(shown)} of {len(engines)} engines)" if len(engines) > len(shown) else ""
    fig.suptitle(f"time of each engine step{more}", fontsize=10)
    return fig


# ----------------------------------------------------------------------------- the cost-model fit

MARKERS = "os^Dv<>"
TOKEN_LABEL = {"verify": "q", "draft": "k", "prefill": "", "feed": ""}


def _levels(values: np.ndarray, most: int) -> np.ndarray:
    """The distinct values, or `most` quantiles of them when there are more."""
    u = np.unique(values)
    return u if len(u) <= most else np.unique(np.quantile(values, np.linspace(0, 1, most)).round())


def _nearest(values: np.ndarray, levels: np.ndarray) -> np.ndarray:
    return np.abs(values[:, None] - levels[None, :]).argmin(axis=1)


def fit_figure(result):
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    fits = list(result.ops.values())
    fig = Figure(figsize=(4.6 * len(fits), 6.4), layout="constrained")
    axes = fig.subplots(2, len(fits), squeeze=False, gridspec_kw={"height_ratios": [2.2, 1]}, sharex="col")
    for j, f in enumerate(fits):
        top, bottom = axes[0, j], axes[1, j]
        d = f.data
        B, tok, L, y = (d[c].to_numpy(float) for c in ("batch", "tokens", "per_row", "ms"))
        toks, ctxs = _levels(tok, 8), _levels(L, 4)
        ti, ci = _nearest(tok, toks), _nearest(L, ctxs)
        colors = [f"C{i % 10}" for i in range(len(toks))] if len(toks) > 1 else None
        pred = f.predict_ms(B, tok, L)
        xs = np.geomspace(B.min(), max(B.max(), B.min() * 1.01), 60)
        for c, ctx in enumerate(ctxs):
            for t, tv in enumerate(toks):
                color = colors[t] if colors else f"C{c % 10}"
                m = (ti == t) & (ci == c)
                if m.any():
                    top.scatter(B[m], y[m], s=14, color=color, marker=MARKERS[c % len(MARKERS)], zorder=3)
                    bottom.scatter(
                        B[m], 100 * (pred[m] - y[m]) / y[m], s=12, color=color, marker=MARKERS[c % len(MARKERS)]
                    )
                top.plot(
                    xs,
                    f.predict_ms(xs, np.full_like(xs, tv), np.full_like(xs, ctx)),
                    color=color,
                    lw=1,
                    ls=("-", "--", ":", "-.")[c % 4],
                )
        q = f.quality
        held = "n/a" if q["mape_heldout"] is None else f"{q['mape_heldout']:.1%}"
        top.set(
            xscale="log",
            yscale="log",
            ylabel="ms",
            title=f"{f.key} ({f.used})\nR² {q['r2']:.3f}, MAPE {q['mape']:.1%}, held-out {held}",
        )
        top.set_xscale("log", base=2)
        top.yaxis.set_major_locator(LogLocator(base=10, subs=(1, 2, 5)))
        for axis in (top.xaxis, top.yaxis):
            axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        top.yaxis.set_minor_formatter(NullFormatter())
        handles = []
        if colors:
            handles += [
                Line2D([], [], color=colors[t], marker="o", ls="-", ms=4, label=f"{TOKEN_LABEL[f.op]}={tv:g}")
                for t, tv in enumerate(toks)
            ]
        handles += [
            Line2D(
                [],
                [],
                color="0.3" if colors else f"C{c % 10}",
                marker=MARKERS[c % len(MARKERS)],
                ls=("-", "--", ":", "-.")[c % 4],
                ms=4,
                label=f"context {ctx:g}",
            )
            for c, ctx in enumerate(ctxs)
        ]
        top.legend(handles=handles, fontsize="x-small", ncol=2, loc="upper left")
        bottom.axhline(0, color="0.5", lw=0.8)
        bottom.set(xlabel="batch size (rows)", ylabel="fit - measured (%)")
    fig.suptitle(f"cost-model fit: points measured, lines fitted ({result.source.get('path', '')})", fontsize="small")
    return fig
