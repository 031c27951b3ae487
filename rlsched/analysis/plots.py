"""Figures (matplotlib, headless). Never imports torch, never touches pyplot's global state:
figures are built with `matplotlib.figure.Figure` and saved through the Agg (PNG) or PDF
canvas, so they work without a display and inside worker processes."""

from __future__ import annotations

import io
from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")  # in case anything downstream reaches for pyplot: never a GUI backend

from matplotlib.figure import Figure  # noqa: E402

from rlsched.atomic import atomic_path  # noqa: E402

FORMATS = {".png": "png", ".pdf": "pdf"}
DPI = 120


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
    fig = Figure(figsize=(max(6.5, 1.1 * len(policies) * max(1, len(reallocs)) + 2), 3.6 + 2.6 * (panels - 1)),
                 layout="constrained")
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
        bars = ax.bar(xs, means, width * 0.9, yerr=[lo, hi], capsize=3,
                      label=f"realloc={realloc}" if len(reallocs) > 1 else None)
        ax.bar_label(bars, labels=[f"{m:.2f}x" for m in means], padding=2, fontsize=8)
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(policies)), policies)
    ax.set_ylabel("speedup over off")
    seeds = report["seeds"]
    ax.set_title(f"{report['name']}: generation-stage speedup over off "
                 f"(mean of {len(seeds)} seed(s); whiskers min-max)", fontsize=10)
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
        ax_b.set_title(f"instance {first['instance']}, RL step {first['rl_step']}, seed {first['seed']}: "
                       "batch size and chosen k per engine step", fontsize=10)
        ax_b.legend(fontsize=8)
        ax_k.set_ylabel("draft length k (0 = off)")
        ax_k.set_xlabel("time since the rollout began (s)")
        ax_k.sharex(ax_b)
        ax_k.yaxis.get_major_locator().set_params(integer=True)
        ax_k.set_ylim(-0.3, max(max(tr["k"]) for tr in traces) + 0.5)
        ax_b.set_ylim(bottom=0)
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
            lines += twin.plot(x, df[col], color=f"C{2 + i}", ls="--", marker=".",
                               label=f"per-token acceptance, {col.removeprefix('accept_mean_')} (estimate)")
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
