"""`rlsched compare`: several drafting and reallocation policies side by side on the same seeds.

Every (policy, realloc, seed) combination is one independent, deterministic simulation, so
runs go to worker processes or a Ray cluster (`sim/runs.py`) and come back as small dicts: the run's summary
and, for the plot, a compressed batch/k trace of one instance. Results do not depend on where
or in which order the runs ran.

Ratios are formed per seed, then averaged over seeds:
- speedup over `off` = off's generation-stage time / the policy's, same seed and realloc;
- ratio against the best static k = the fastest `static:K` (or fixed `tree:K:W:N`) policy's time on that seed and
  realloc (chosen after the fact) / the policy's time. Above 1 means faster than the best static.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from rlsched import __version__
from rlsched.config import SimConfig
from rlsched.errors import UserError
from rlsched.policies.registry import OFF_SPEC, PolicySpec, parse_policy

BASELINE = "off"
ORACLE = "oracle"  # where listed, every policy is also set against it (ratio_vs_oracle)
# ----------------------------------------------------------------------------- plan


def policy_kind(spec: PolicySpec) -> str:
    """'off', 'static' (a fixed setting: static:K, or a fixed tree tree:K:W:N) or 'adaptive'
    (every other policy)."""
    family = spec.family
    return "static" if family == "tree" else family if family in ("off", "static") else "adaptive"


@dataclass
class ComparePlan:
    policies: list[str]  # the names, the baseline first when it was added
    specs: dict[str, PolicySpec]  # each name's parsed spec
    reallocs: list[str]
    seeds: list[int]
    baseline_added: bool = False
    trace_instance: int | None = None  # instance whose batch/k trace adaptive runs return (for --plot)

    def kind(self, name: str) -> str:
        return policy_kind(self.specs[name])

    @property
    def static(self) -> list[str]:
        return [p for p in self.policies if self.kind(p) == "static"]

    @property
    def adaptive(self) -> list[str]:
        return [p for p in self.policies if self.kind(p) == "adaptive"]

    def jobs(self) -> list[tuple[PolicySpec, str, int, int | None]]:
        """(policy, realloc, seed, trace instance or None), slowest kinds first (for load balance)."""
        rank = {"adaptive": 0, "static": 1, "off": 2}
        out = []
        for p in sorted(self.policies, key=lambda p: rank[self.kind(p)]):
            for r in self.reallocs:
                for s in self.seeds:
                    trace = self.trace_instance if (self.kind(p) == "adaptive" and s == self.seeds[0]) else None
                    out.append((self.specs[p], r, s, trace))
        return out


def split_names(text: str, option: str) -> list[str]:
    """A comma-separated list (only commas separate: names may hold ':' and paths), stripped,
    without duplicates, in order."""
    names: list[str] = []
    for part in text.split(","):
        name = part.strip()
        if not name:
            raise UserError(f"{option}: empty name in '{text}'; separate names with single commas, as in off,static:4")
        if name not in names:
            names.append(name)
    return names


def make_plan(
    cfg: SimConfig,
    policies: str,
    realloc: str | None,
    seeds: int,
    first_seed: int | None,
    trace_instance: int | None = None,
) -> ComparePlan:
    """Check every name and number before anything runs; raises UserError naming the option."""
    from rlsched.policies.realloc import make_realloc_policy
    from rlsched.policies.registry import make_draft_policy
    from rlsched.sim.rlstep import TrueAcceptance
    from rlsched.sim.simulate import policy_context

    if seeds < 1:
        raise UserError(f"--seeds must be >= 1 (got {seeds})")
    first = cfg.seed if first_seed is None else first_seed
    if first < 0:
        raise UserError(f"--first-seed must be >= 0 (got {first})")
    names = split_names(policies, "--policies")
    # what `simulate` gives its policies, without a cost model (name checks only); the oracle may run here
    ctx = policy_context(cfg, None, TrueAcceptance())
    specs = {}
    for name in names:
        try:
            specs[name] = parse_policy(name)
            make_draft_policy(specs[name], ctx)
        except UserError as e:
            raise UserError(f"--policies: {e}") from None
    reallocs = split_names(realloc or cfg.cluster.realloc, "--realloc")
    for name in reallocs:
        try:
            make_realloc_policy(name)
        except UserError as e:
            raise UserError(f"--realloc: {e}") from None
    added = BASELINE not in names
    if added:
        names.insert(0, BASELINE)
        specs[BASELINE] = OFF_SPEC
    if trace_instance is not None and not 0 <= trace_instance < cfg.cluster.instances:
        trace_instance = 0
    return ComparePlan(names, specs, reallocs, list(range(first, first + seeds)), added, trace_instance)


# ----------------------------------------------------------------------------- aggregation


def _stats(values: Iterable[float | None]) -> dict | None:
    vals = [float(v) for v in values if v is not None and not math.isnan(v)]
    if not vals:
        return None
    lo, hi = min(vals), max(vals)
    mean = lo if lo == hi else statistics.fmean(vals)  # identical values average to themselves exactly
    std = statistics.stdev(vals) if len(vals) > 1 else 0.0
    return {"mean": mean, "std": std, "min": lo, "max": hi, "per_seed": vals}


def _runs(plan: ComparePlan, by: dict, gen: dict, best_static: dict) -> list[dict]:
    """One row per (policy, realloc, seed): its summary and its ratios on that seed."""
    runs = []
    for p in plan.policies:
        for realloc in plan.reallocs:
            for s in plan.seeds:
                summ = by[(p, realloc, s)]["summary"]
                g = summ["generation_s"]
                off = gen[(BASELINE, realloc, s)]
                bs = best_static.get((realloc, s))
                oracle = gen.get((ORACLE, realloc, s))
                runs.append(
                    {
                        "policy": p,
                        "realloc": realloc,
                        "seed": s,
                        "speedup_vs_off": off / g if g > 0 else None,
                        "best_static": bs,
                        "ratio_vs_best_static": (gen[(bs, realloc, s)] / g if g > 0 else None) if bs else None,
                        "ratio_vs_oracle": oracle / g if oracle is not None and g > 0 else None,
                        "summary": summ,
                    }
                )
    return runs


def aggregate(cfg: SimConfig, plan: ComparePlan, results: list[dict]) -> dict:
    """The compare report: per-run rows with their per-seed ratios, and per (policy, realloc)
    statistics over seeds."""
    by = {(r["policy"], r["realloc"], r["seed"]): r for r in results}
    gen = {key: r["summary"]["generation_s"] for key, r in by.items()}
    best_static: dict[tuple[str, int], str] = {}
    for realloc in plan.reallocs:
        for s in plan.seeds:
            if plan.static:
                best_static[(realloc, s)] = min(plan.static, key=lambda p: gen[(p, realloc, s)])  # first on ties

    runs = _runs(plan, by, gen, best_static)

    agg = []
    for p in plan.policies:
        for realloc in plan.reallocs:
            rows = [r for r in runs if r["policy"] == p and r["realloc"] == realloc]
            su = [r["summary"] for r in rows]
            agg.append(
                {
                    "policy": p,
                    "realloc": realloc,
                    "kind": plan.kind(p),
                    "seeds": len(rows),
                    "generation_s": _stats(x["generation_s"] for x in su),
                    "tokens_per_s": _stats(x["tokens_per_s"] for x in su),
                    "speedup_vs_off": _stats(r["speedup_vs_off"] for r in rows),
                    "ratio_vs_best_static": _stats(r["ratio_vs_best_static"] for r in rows),
                    "ratio_vs_oracle": _stats(r["ratio_vs_oracle"] for r in rows),
                    "mean_accept_len": _stats(x.get("mean_accept_len") for x in su),
                    "sd_step_fraction": _stats(x.get("sd_step_fraction") for x in su),
                    "migrations": _stats(x["migrations"] for x in su),
                    "preemptions": _stats(x["preemptions"] for x in su),
                }
            )

    notes = []
    if plan.baseline_added:
        notes.append("'off' was not in --policies: added as the baseline")
    if not plan.static:
        notes.append("no static:K policy in --policies: no ratio against the best static k")
    if not cfg.record_timeline:
        notes.append("record_timeline=false: no accepted length or SD-step fraction")
    return {
        "name": cfg.name,
        "rlsched": __version__,
        "policies": plan.policies,
        "realloc": plan.reallocs,
        "seeds": plan.seeds,
        "baseline": BASELINE,
        "baseline_added": plan.baseline_added,
        "static_policies": plan.static,
        "adaptive_policies": plan.adaptive,
        "best_static_per_seed": [
            {"realloc": r, "seed": s, "policy": p, "generation_s": gen[(p, r, s)]} for (r, s), p in best_static.items()
        ],
        "ratios": "per seed, then averaged over seeds: speedup_vs_off = off time / policy time (same realloc); "
        "ratio_vs_best_static = fastest static:K time on that seed / policy time; ratio_vs_oracle = the "
        "oracle's time / policy time (where the oracle is listed); >1 is faster",
        "notes": notes,
        "aggregate": agg,
        "runs": runs,
        "config": cfg.model_dump(mode="json"),
    }


def traces_for_plot(plan: ComparePlan, results: list[dict]) -> list[dict]:
    """The batch/k traces of the adaptive policies (first seed), labelled, in plan order."""
    order = {(p, x): i for i, (p, x) in enumerate((p, x) for p in plan.policies for x in plan.reallocs)}
    out = []
    for r in sorted((r for r in results if r.get("trace")), key=lambda r: order[(r["policy"], r["realloc"])]):
        label = r["policy"] if len(plan.reallocs) == 1 else f"{r['policy']} / {r['realloc']}"
        out.append({"label": label, "seed": r["seed"], **r["trace"]})
    return out


# ----------------------------------------------------------------------------- table


def _fmt(st: dict | None, spec: str, spread: bool = True, suffix: str = "") -> str:
    if st is None:
        return "n/a"
    s = f"{st['mean']:{spec}}{suffix}"
    lo, hi = f"{st['min']:{spec}}", f"{st['max']:{spec}}"
    return s + f" ({lo}-{hi})" if spread and lo != hi else s


def table_rows(report: dict) -> tuple[list[str], list[list[str]]]:
    """Column headers and string cells of the side-by-side table (mean over seeds, min-max)."""
    multi = len(report["realloc"]) > 1
    cols = (
        ["policy"]
        + (["realloc"] if multi else [])
        + ["gen. stage s", "tokens/s", "x off", "x best static", "accept len", "SD steps", "migrations"]
    )
    rows = []
    no_static = not report["static_policies"]
    for a in report["aggregate"]:
        rows.append(
            [a["policy"]]
            + ([a["realloc"]] if multi else [])
            + [
                _fmt(a["generation_s"], ".2f"),
                _fmt(a["tokens_per_s"], ",.0f", spread=False),
                _fmt(a["speedup_vs_off"], ".3f", suffix="x"),
                "no static" if no_static else _fmt(a["ratio_vs_best_static"], ".3f", suffix="x"),
                _fmt(a["mean_accept_len"], ".2f", spread=False),
                _fmt(a["sd_step_fraction"], ".2f", spread=False),
                _fmt(a["migrations"], ".0f", spread=False),
            ]
        )
    return cols, rows


def table_notes(report: dict) -> list[str]:
    seeds = report["seeds"]
    same = " and realloc" if len(report["realloc"]) > 1 else ""
    lines = [
        f"{len(seeds)} seed(s) {seeds[0]}..{seeds[-1]}; mean over seeds (min-max); ratios per seed{same}, "
        "then averaged; x > 1 is faster"
    ]
    if report["best_static_per_seed"]:
        multi = len(report["realloc"]) > 1
        lines.append(
            "best static per seed: "
            + ", ".join(
                f"{b['seed']}{'/' + b['realloc'] if multi else ''}={b['policy']}"
                for b in report["best_static_per_seed"]
            )
        )
    lines += report["notes"]
    return lines


def rich_table(report: dict):
    from rich.table import Table

    cols, rows = table_rows(report)
    t = Table(
        title=f"rlsched compare: {report['name']}  ({len(report['runs'])} runs)",
        caption="\n".join(table_notes(report)),
        caption_justify="left",
    )
    for i, c in enumerate(cols):
        t.add_column(c, style="bold" if i == 0 else None, justify="left" if c in ("policy", "realloc") else "right")
    for r in rows:
        t.add_row(*r)
    return t


# ----------------------------------------------------------------------------- output


def run_rows(report: dict):
    """One row per run, scalar columns only (for Parquet)."""
    import pandas as pd

    rows = []
    for r in report["runs"]:
        s = r["summary"]
        idle = s.get("idle_fraction") or [float("nan")]
        rows.append(
            {
                "name": report["name"],
                "policy": r["policy"],
                "realloc": r["realloc"],
                "seed": r["seed"],
                "generation_s": s["generation_s"],
                "tokens_per_s": s["tokens_per_s"],
                "speedup_vs_off": r["speedup_vs_off"],
                "best_static": r["best_static"],
                "ratio_vs_best_static": r["ratio_vs_best_static"],
                "mean_accept_len": s.get("mean_accept_len"),
                "sd_step_fraction": s.get("sd_step_fraction"),
                "migrations": s["migrations"],
                "preemptions": s["preemptions"],
                "response_tokens": s["response_tokens"],
                "engine_steps": s["engine_steps"],
                "rl_steps": s["rl_steps"],
                "rl_step_s": s["rl_step_s"],
                "idle_fraction_mean": sum(idle) / len(idle),
                "idle_fraction_max": max(idle),
            }
        )
    df = pd.DataFrame(rows)
    for col in ("speedup_vs_off", "ratio_vs_best_static", "mean_accept_len", "sd_step_fraction"):
        df[col] = df[col].astype(float)
    df["best_static"] = df["best_static"].astype(object)
    return df


def check_out_path(out: Path | None, plot: Path | None) -> None:
    """Refuse unusable output paths before anything runs."""
    if plot is not None:
        if plot.suffix.lower() not in (".png", ".pdf"):
            raise UserError(f"--plot {plot}: the file name must end in .png or .pdf")
        if plot.exists() and plot.is_dir():
            raise UserError(f"--plot {plot}: is a folder; give a file name ending in .png or .pdf")
    if out is not None and out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: exists and is not a folder")


def write_report(report: dict, out: Path) -> None:
    """compare.json and compare.parquet in `out`, atomically: written to a temporary sibling
    that is renamed into place (a previous folder of the same name is replaced)."""
    import pyarrow as pa

    from rlsched.atomic import atomic_folder, json_text
    from rlsched.traces.writer import write_table

    with atomic_folder(out) as tmp:
        (tmp / "compare.json").write_text(json_text(report))
        write_table(tmp / "compare.parquet", pa.Table.from_pandas(run_rows(report), preserve_index=False))
