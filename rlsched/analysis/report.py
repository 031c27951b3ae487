"""`rlsched report`: one self-contained HTML page (figures embedded as PNG data URIs, a little
CSS, no scripts) with a folder's key numbers and the figures analysis/folder.py picks."""

from __future__ import annotations

import base64
import html
import math
import time
from pathlib import Path

import pandas as pd

from rlsched import __version__
from rlsched.analysis.engine import UNKNOWN, engine_numbers
from rlsched.analysis.folder import FolderData, figures_for, load_folder
from rlsched.analysis.plots import STAGES, figure_png

CAPTIONS = {
    "fit": "Cost-model fit: measured step times (points) against the fitted forms (lines) per batch size and "
    "draft length, residuals below.",
    "speedup": "Speedup of each draft length k over plain decoding against batch size: predicted from measured "
    "step costs at the acceptance named in the title; measured from the run's own steps where they allow.",
    "acceptance": "Acceptance over RL steps: tokens per speculative step and acceptance rate (accepted / drafted); "
    "dashed: the drafter's per-token acceptance estimate.",
    "batch_k": "Batch size and chosen draft length k of every decode step over one RL step's rollout, per instance.",
    "step_times": "Time of each engine step over the trace, per engine: decode steps by draft length k, prefill and "
    "mixed steps as crosses; dashed lines where a window (a weight update) begins.",
    "stages": "Seconds per stage of each RL step.",
    "learning_curve": "Learning curve: reward (band: +-1 standard error), speculation and time per stage.",
    "compare": "Generation-stage speedup over off per policy (mean over seeds, whiskers min-max).",
    "pareto": "Each setup's RL step time against the GPUs it holds: the screen's estimate (grey), the simulated "
    "mean over seeds (blue; the line: the Pareto front), the best plain decoding per GPU count (red), the "
    "workload's own setup and the winner.",
}

CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2rem auto; max-width: 1100px;
       padding: 0 1rem; color: #222; line-height: 1.4; }
h1 { font-size: 1.5rem; margin-bottom: 0.2rem; } h2 { font-size: 1.15rem; margin-top: 2rem;
     border-bottom: 1px solid #ddd; padding-bottom: 0.2rem; }
.meta { color: #666; font-size: 0.9rem; }
table { border-collapse: collapse; font-size: 0.95rem; }
td, th { padding: 0.25rem 0.8rem; border-bottom: 1px solid #eee; text-align: left; vertical-align: top; }
td.v { font-variant-numeric: tabular-nums; }
figure { margin: 1.5rem 0; } img { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption { color: #555; font-size: 0.9rem; margin-top: 0.3rem; }
.skipped { color: #777; font-size: 0.9rem; }
"""


RUN_COLUMNS = ("reward_mean", "mean_accept_len")  # besides the schema's: a run's rl_steps records


def _windows(df: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The first and last 20% of the RL steps (at least one each), as the run's summary takes them."""
    n = max(1, len(df) // 5)
    return df.head(n), df.tail(n)


def _rate(df: pd.DataFrame) -> float:
    drafted = float(df["drafted"].sum())
    return float(df["accepted"].sum()) / drafted if drafted else float("nan")


def run_numbers(d: FolderData) -> dict:
    """A run's key numbers from its rl_steps records (the definitions of the run's summary.json),
    and its settings from summary.json or config.yaml."""
    s, c = d.summary or {}, d.config or {}
    assert d.rl_steps is not None  # a run folder's
    rl = d.rl_steps.sort_values("rl_step")
    head, tail = _windows(rl)
    stage = {k: float(rl[f"{k}_s"].sum()) for k in STAGES}
    algo = s.get("algorithm") or (c.get("algorithm") or {}).get("name")
    out = {
        "algorithm": algo,
        "policy": s.get("policy", c.get("policy")),
        "drafter": s.get("drafter", c.get("drafter")),
        "steps": int(len(rl)),
        "seed": s.get("seed", c.get("seed")),
        "reward_start": float(head["reward_mean"].mean()),
        "reward_end": float(tail["reward_mean"].mean()),
        "tokens_per_s": float(rl["response_tokens"].sum() / rl["generation_s"].sum()),
        "accept_len_start": float(head["mean_accept_len"].mean()),
        "accept_len_end": float(tail["mean_accept_len"].mean()),
        "accept_len_mean": float(rl["mean_accept_len"].mean()),
    }
    if {"accepted", "drafted"} <= set(rl.columns):
        out.update(accept_rate=_rate(rl), accept_rate_start=_rate(head), accept_rate_end=_rate(tail))
    out.update(seconds=float(rl["total_s"].sum()), stage_s=stage)
    for k in ("machine", "threads", "created_utc"):
        if k in s:
            out[k] = s[k]
    return out


def _num(v) -> str:
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if not math.isfinite(v):
            return "n/a"
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}"
    return str(v)


def engine_rows(d: FolderData) -> tuple[list[tuple[str, str]], dict]:
    """An engine-core trace's rows: what the engines ran, windows, tokens/s, acceptance, and
    what such a trace does not hold."""
    n = engine_numbers(d.engines or [], d.steps, d.samples)
    rows = [
        ("engines / policy / cost model", f"{n['engines']} / {n['policy']} / {n['cost_model']}"),
        ("drafter / k_max / max_num_seqs / tp", f"{n['drafter']} / {n['k_max']} / {n['max_batch']} / {n['tp']}"),
        ("model (vLLM)", f"{n['model']} ({n['vllm']})"),
        ("windows (weight updates) / engine steps / samples", f"{n['windows']} / {n['steps']:,} / {n['samples']:,}"),
        (
            "generation s (span of each window's steps) / tokens/s",
            f"{_num(n['generation_s'])} / {_num(n['tokens_per_s'])}",
        ),
        (
            "acceptance rate (accepted / drafted) / tokens per SD step",
            f"{_num(n['accept_rate'])} / {_num(n['mean_accept_len'])}",
        ),
        ("steps without a draft/verify split", str(n["untimed_steps"])),
        ("not in this trace", UNKNOWN.removeprefix("an engine-core trace holds no ")),
    ]
    rows += [("note", note) for note in d.notes or []]
    return rows, n


def number_rows(d: FolderData) -> tuple[list[tuple[str, str]], dict]:
    """(label, value) rows for the page, and the raw numbers (for --json)."""
    if d.kind == "engine":
        return engine_rows(d)
    if d.kind == "run" and d.rl_steps is not None and set(RUN_COLUMNS) <= set(d.rl_steps.columns):
        n = run_numbers(d)
        st, total = n["stage_s"], sum(n["stage_s"].values())
        rows = [
            ("algorithm / policy / drafter", f"{n['algorithm']} / {n['policy']} / {n['drafter']}"),
            ("RL steps (seed)", f"{n['steps']} ({n['seed']})"),
            ("reward: first 20% -> last 20% of steps", f"{n['reward_start']:.3f} -> {n['reward_end']:.3f}"),
            ("generation tokens/s", f"{n['tokens_per_s']:,.0f}"),
            (
                "mean accepted length (tokens per SD step): first -> last (mean)",
                f"{n['accept_len_start']:.2f} -> {n['accept_len_end']:.2f} ({n['accept_len_mean']:.2f})",
            ),
        ]
        if "accept_rate" in n:
            r = {
                k: "n/a" if math.isnan(n[k]) else f"{n[k]:.3f}"
                for k in ("accept_rate_start", "accept_rate_end", "accept_rate")
            }
            rows.append(
                (
                    "acceptance rate (accepted / drafted): first -> last (all)",
                    f"{r['accept_rate_start']} -> {r['accept_rate_end']} ({r['accept_rate']})",
                )
            )
        rows.append(
            (
                "seconds: total (generation / inference / training / drafter update)",
                f"{n['seconds']:.1f} (" + " / ".join(f"{st[k]:.1f}" for k in STAGES) + ")",
            )
        )
        rows.append(
            (
                "stage split",
                " / ".join(f"{k.replace('_', ' ')} {st[k] / total:.0%}" for k in STAGES) if total > 0 else "n/a",
            )
        )
        for k in ("machine", "threads", "created_utc"):
            if k in n:
                rows.append((k.replace("_", " "), str(n[k])))
        return rows, n
    flat = {
        k: v
        for k, v in (d.summary or {}).items()
        if isinstance(v, (int, float, str, bool)) and k not in ("out", "traces")
    }
    return [(k.replace("_", " "), _num(v)) for k, v in flat.items()], flat


def render_html(d: FolderData, images: dict[str, bytes], skipped: dict[str, str]) -> tuple[str, dict]:
    rows, numbers = number_rows(d)
    e = html.escape
    title = f"rlsched report: {d.path.resolve().name} ({d.kind})"
    parts = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{e(title)}</title><style>{CSS}</style></head><body>",
        f"<h1>{e(title)}</h1>",
        f'<p class="meta">{e(str(d.path.resolve()))} &middot; '
        f"written {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} "
        f"by rlsched {e(__version__)}</p>",
        "<h2>Key numbers</h2>",
    ]
    if rows:
        parts.append(
            "<table>" + "".join(f'<tr><th>{e(k)}</th><td class="v">{e(v)}</td></tr>' for k, v in rows) + "</table>"
        )
    else:
        parts.append('<p class="skipped">no summary.json in the folder</p>')
    parts.append("<h2>Figures</h2>")
    for name, png in images.items():
        data = base64.b64encode(png).decode("ascii")
        parts.append(
            f'<figure id="{e(name)}"><img src="data:image/png;base64,{data}" alt="{e(name)}">'
            f"<figcaption><b>{e(name)}</b>: {e(CAPTIONS.get(name, ''))}</figcaption></figure>"
        )
    if skipped:
        parts.append(
            '<p class="skipped">Not drawn: ' + "; ".join(f"{e(k)} ({e(v)})" for k, v in skipped.items()) + "</p>"
        )
    parts.append("</body></html>")
    return "\n".join(parts) + "\n", numbers


def build_report(folder, cost: dict | None = None, cost_path: Path | None = None) -> tuple[str, dict]:
    """(the page, a JSON-able summary: folder, kind, figures, skipped, numbers)."""
    d = load_folder(folder)
    figs, skipped = figures_for(d, cost, cost_path)
    images = {name: figure_png(fig) for name, fig in figs.items()}
    page, numbers = render_html(d, images, skipped)
    return page, {
        "folder": str(folder),
        "kind": d.kind,
        "figures": list(images),
        "skipped": skipped,
        "numbers": numbers,
    }
