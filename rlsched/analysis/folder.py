"""What an output folder holds (a `rlsched run`, `generate`, `profile` or `simulate` folder,
a `compare --out` folder, or an engine-core trace folder: analysis/engine.py), and which of
the figures people read (drawn by plots.py) its data supports. Headless and torch-free.

Figures (each a function returning a `matplotlib.figure.Figure`; `figures_for` picks those the
folder's data supports and says why it left the others out):

- fit: the cost-model fit (plots.fit_figure) of the folder's profile (a profile
  folder, or the profile a `run` took for its policy: profile.parquet), or, with a cost-model
  file, that file's fitted forms against the folder's measured step times;
- speedup: per-step speedup of each draft length k over plain decoding against batch size
  (`speedup_figure`: predicted from measured step costs, plus the run's measured ratio where
  its steps allow one);
- acceptance: acceptance rate and mean accepted length over RL steps;
- batch_k: batch size and chosen k over time, one panel per instance, in one RL step;
- step_times: each engine step's time over the trace, per engine (engine-core traces);
- stages: seconds per stage of each RL step (generation, inference, training, drafter update);
- learning_curve: a run's reward, speculation and stages side by side (plots.run_figure);
- compare: a `compare --out` folder's speedups (plots.compare_figure);
- pareto: a `plan` folder's setups, step time against GPUs (plots.plan_figure).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from rlsched.analysis.engine import UNKNOWN, is_engine_trace, read_engine_trace, window_acceptance
from rlsched.analysis.plots import (
    Figure,
    acceptance_figure,
    batch_k_figure,
    compare_figure,
    fit_figure,
    plan_figure,
    run_figure,
    save_figure,
    speedup_figure,
    stage_figure,
    step_time_figure,
)
from rlsched.errors import UserError
from rlsched.policies.tree import chain_tokens
from rlsched.traces.reader import read_json, read_profile, read_trace

ORDER = ("fit", "speedup", "acceptance", "batch_k", "step_times", "stages", "learning_curve", "compare", "pareto")
ASSUMED_ACCEPTANCE = 0.7


@dataclass
class FolderData:
    """What a folder holds that the figures draw on; None where it holds nothing of that kind."""

    path: Path
    kind: str  # run | generate | profile | simulate | compare | plan | engine
    steps: pd.DataFrame | None = None  # engine step records (kind decode | prefill)
    rl_steps: pd.DataFrame | None = None
    profile: pd.DataFrame | None = None  # step-cost records (kind verify | draft | prefill)
    profile_path: Path | None = None
    summary: dict | None = None
    config: dict | None = None
    compare: dict | None = None
    plan: dict | None = None  # plan.json of an `rlsched plan` folder
    samples: pd.DataFrame | None = None  # an engine-core trace's sample records
    engines: list[dict] | None = None  # an engine-core trace's engine files
    notes: list[str] | None = None


def _json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    data = read_json(path)
    if not isinstance(data, dict):
        raise UserError(f"'{path}' does not hold a JSON object; re-run the command that wrote it")
    return data


def _yaml(path: Path) -> dict | None:
    import yaml

    if not path.is_file():
        return None
    fix = "restore the folder's own config.yaml or delete it"
    try:
        data = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise UserError(f"'{path}' is not valid YAML ({str(e).splitlines()[0]}); {fix}") from None
    except OSError as e:
        raise UserError(f"'{path}' cannot be read ({e.strerror or e}); {fix}") from None
    if not isinstance(data, dict):
        raise UserError(f"'{path}' does not hold a config (a YAML mapping); {fix}")
    if not isinstance(data.get("algorithm", {}), dict):
        raise UserError(f"'{path}': algorithm is not a mapping; {fix}")
    for key in ("policy", "drafter", "cost_model"):
        if isinstance(data.get(key), (dict, list)):
            raise UserError(f"'{path}': {key} is not a name; {fix}")
    return data


def _nonempty(df: pd.DataFrame | None) -> pd.DataFrame | None:
    return df if df is not None and len(df) else None


GIVE = "give a run, generate, profile or simulate output folder, or an engine-core trace folder"


def load_folder(path) -> FolderData:
    """Read a run, generate, profile, simulate or compare output folder, or an engine-core
    trace folder. A missing folder, one holding nothing to plot, and a corrupt or mismatched
    file are one UserError naming it."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"'{path}' does not exist; {GIVE}")
    if not path.is_dir():
        raise UserError(f"'{path}' is not a folder; {GIVE}")
    if is_engine_trace(path):
        tr = read_engine_trace(path)
        steps, samples = _nonempty(tr.steps), _nonempty(tr.samples)
        return FolderData(path, "engine", steps=steps, samples=samples, engines=tr.engines, notes=tr.notes)
    d = FolderData(path, "unknown", summary=_json(path / "summary.json"))
    traces = path / "traces"
    if (path / "plan.json").is_file():
        d.kind, d.plan = "plan", _json(path / "plan.json")
        if not isinstance(d.plan, dict) or d.plan.get("format") != "rlsched-plan":
            raise UserError(f"'{path / 'plan.json'}' is not a `rlsched plan` record (no format: rlsched-plan)")
        return d
    if (path / "compare.json").is_file():
        d.kind, d.compare = "compare", _json(path / "compare.json")
        if not {"aggregate", "policies", "realloc", "seeds", "name"} <= set(d.compare or ()):
            raise UserError(
                f"'{path / 'compare.json'}' is not a `rlsched compare` report (it lacks aggregate, "
                "policies, realloc, seeds or name)"
            )
        return d
    if (path / "timeline.parquet").is_file() or (path / "rl_steps.parquet").is_file():
        d.kind = "simulate"
        if (path / "timeline.parquet").is_file():
            d.steps = _nonempty(read_trace(path / "timeline.parquet", "steps"))
        if (path / "rl_steps.parquet").is_file():
            d.rl_steps = _nonempty(read_trace(path / "rl_steps.parquet", "rl_steps"))
        d.config = _yaml(path / "config.yaml")
    elif (traces / "steps").is_dir() or (traces / "rl_steps").is_dir():
        steps = read_trace(traces, "steps") if (traces / "steps").is_dir() else None
        if (path / "profile.json").is_file() or (steps is not None and set(steps["kind"]) & {"verify", "draft"}):
            d.kind, d.profile, d.profile_path = "profile", _nonempty(steps), path
        else:
            d.steps = _nonempty(steps)
            d.rl_steps = _nonempty(read_trace(traces, "rl_steps")) if (traces / "rl_steps").is_dir() else None
            d.kind = "run" if d.rl_steps is not None or (path / "rollouts").is_dir() else "generate"
            d.config = _yaml(path / "config.yaml")
            if (path / "profile.parquet").is_file():
                d.profile = _nonempty(read_profile(path / "profile.parquet"))
                d.profile_path = path / "profile.parquet"
            elif d.config and isinstance(d.config.get("cost_model"), str) and d.config["cost_model"] != "auto":
                prof = Path(d.config["cost_model"])
                if (prof / "traces" / "steps").is_dir():
                    d.profile, d.profile_path = _nonempty(read_trace(prof / "traces", "steps")), prof
    if d.steps is None and d.rl_steps is None and d.profile is None:
        what = "its traces hold no records" if traces.is_dir() or d.kind == "simulate" else "no traces"
        raise UserError(
            f"'{path}' has nothing to plot ({what}: no traces/steps, traces/rl_steps, timeline.parquet, "
            f"rl_steps.parquet, compare.json, profile or engine-*.json); {GIVE}"
        )
    return d


# ----------------------------------------------------------------------------- numbers


def _sd_uniform(steps: pd.DataFrame) -> pd.DataFrame:
    """Decode steps that drafted k for every row (a row capped near its budget, or per-row
    lengths, leave the step's shape unknown)."""
    dec = steps[(steps["kind"] == "decode") & (steps["k"] > 0) & (steps["batch"] > 0)]
    return dec[dec["drafted"] == dec["batch"] * dec["k"] * dec["width"].clip(lower=1)]


def chain_acceptance(steps: pd.DataFrame | None) -> float | None:
    """The per-token acceptance `a` of chain drafting that explains the folder's speculative
    steps: sum over steps of batch x (a + a^2 + ... + a^k) = accepted (bisection); None
    without such steps."""
    if steps is None:
        return None
    sd = _sd_uniform(steps)
    if sd.empty or sd["drafted"].sum() == 0:
        return None
    accepted = float(sd["accepted"].sum())
    rows = sd.groupby("k")["batch"].sum()
    ks, n = rows.index.to_numpy(float), rows.to_numpy(float)
    expected = lambda a: float((n * a * (1 - a**ks) / (1 - a)).sum())  # noqa: E731
    lo, hi = 0.0, 1.0 - 1e-9
    if accepted >= expected(hi):
        return hi
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected(mid) < accepted else (lo, mid)
    return (lo + hi) / 2


def expected_tokens(a: float, k) -> np.ndarray:
    """Tokens per row of a chain-drafting step of length k at per-token acceptance a:
    (1 - a^(k+1)) / (1 - a), the accepted drafts plus the target's own token."""
    k = np.asarray(k, dtype=float)
    return k + 1 if a >= 1 else chain_tokens(a, k)


def per_step_acceptance(d: FolderData) -> pd.DataFrame | None:
    """rl_step, mean_accept_len (tokens per SD step per row), accept_rate (accepted / drafted)
    and any accept_mean_<drafter> per RL step: a run's own rl_steps records, or (simulator)
    derived from its step records the way the executor counts them."""
    rl = d.rl_steps
    if rl is not None and {"mean_accept_len", "accept_rate"} <= set(rl.columns):
        return rl.sort_values("rl_step")
    if d.steps is None:
        return None
    sd = d.steps[(d.steps["kind"] == "decode") & (d.steps["k"] > 0)]
    if sd.empty:
        return None
    g = sd.groupby("rl_step")[["emitted", "batch", "accepted", "drafted"]].sum()
    out = pd.DataFrame(
        {
            "rl_step": g.index.to_numpy(),
            "mean_accept_len": (g["emitted"] / g["batch"]).to_numpy(),
            "accept_rate": (g["accepted"] / g["drafted"].where(g["drafted"] > 0)).to_numpy(),
        }
    )
    if rl is not None:
        extra = [c for c in rl.columns if c.startswith("accept_mean_")]
        out = out.merge(rl[["rl_step", *extra]], on="rl_step", how="left")
    elif (estimates := window_acceptance(d.steps, d.samples)) is not None:
        out = out.merge(estimates, on="rl_step", how="left")  # an engine's per-sample estimates
    return out.sort_values("rl_step").reset_index(drop=True)


# ----------------------------------------------------------------------------- figures


def fit_result_for(d: FolderData, cost: dict | None = None, cost_path: Path | None = None):
    """A FitResult for plots.fit_figure: the fit of the folder's profile, or (with a
    cost-model file's data) that file's forms over the folder's measured step times, their
    R^2 and MAPE on those points (no held-out check: the file was fitted elsewhere)."""
    from rlsched.costs.costfile import PER_DRAFTER
    from rlsched.costs.fit import FitResult, OpFit, fit_records, mape, op_tables, r_squared

    records = d.profile if d.profile is not None else d.steps
    if records is None:
        raise UserError(f"'{d.path}' holds no measured step times to draw a fit against")
    if cost is None:
        return fit_records(
            records, {"path": str(d.profile_path or d.path), "kind": "profile" if d.profile is not None else d.kind}
        )
    tables, notes = op_tables(records)
    entries = {
        "verify": cost["ops"]["verify"],
        "prefill": cost["ops"]["prefill"],
        **{f"{op}:{k}": v for op in PER_DRAFTER for k, v in cost["ops"].get(op, {}).items()},
    }
    ops = {}
    for key, entry in entries.items():
        t = tables.get(key)
        if t is None:
            continue
        op = OpFit(key, {k: float(v) for k, v in entry["params"].items()}, entry["used"], {}, t)
        pred = op.predict_ms(t["batch"], t["tokens"], t["per_row"])
        op.quality = {"r2": r_squared(pred, t["ms"]), "mape": mape(pred, t["ms"]), "mape_heldout": None}
        ops[key] = op
    src = d.profile_path if d.profile is not None else d.path / ("steps" if d.kind == "engine" else "traces/steps")
    return FitResult(ops, {"path": f"{cost_path} over {src}"}, cost.get("max_mape", 0.05), notes)


def fit_figure_for(d: FolderData, cost: dict | None = None, cost_path: Path | None = None) -> Figure:
    """The cost-model fit figure (plots.fit_figure) of `fit_result_for`."""

    return fit_figure(fit_result_for(d, cost, cost_path))


def predicted_speedup(
    profile: pd.DataFrame, a: float, per_row: float | None = None, drafter: str | None = None
) -> tuple[pd.DataFrame, float, str | None]:
    """Per (batch, k >= 1): verify(B, 0) / (verify(B, k) + draft(B, k)) x expected tokens per
    row at acceptance `a`, from measured step costs (profile records) at the profiled context
    per row nearest `per_row` (default: the median one). Returns (batch, k, speedup), that
    context and the drafter."""
    p = profile[profile["batch"] > 0].assign(per_row=lambda x: (x["ctx_tokens"] / x["batch"]).round())
    v = p[p["kind"] == "verify"]
    dr = p[p["kind"] == "draft"]
    if v.empty or dr.empty or not (v["k"] == 0).any():
        raise UserError("the profile holds no verify times at k = 0 and draft times to price speculation with")
    names = sorted(dr["drafter"].unique())
    drafter = drafter if drafter in names else names[0]
    dr = dr[dr["drafter"] == drafter]
    ctxs = np.array(sorted(set(v["per_row"]) & set(dr["per_row"])))
    if not len(ctxs):
        raise UserError("the profile's verify and draft times share no context length")
    ctx = float(ctxs[np.abs(ctxs - (per_row if per_row is not None else np.median(ctxs))).argmin()])
    vt = v[v["per_row"] == ctx].groupby(["batch", "k"])["verify_ms"].median()
    dt = dr[dr["per_row"] == ctx].groupby(["batch", "k"])["draft_ms"].median()
    rows = []
    for (b, k), draft in dt.items():
        if k > 0 and (b, k) in vt.index and (b, 0) in vt.index:
            rows.append((int(b), int(k), float(expected_tokens(a, k) * vt[(b, 0)] / (vt[(b, k)] + draft))))
    return pd.DataFrame(rows, columns=["batch", "k", "speedup"]), ctx, drafter


def cost_model_speedup(
    cost: dict, cost_path: Path, a: float, batches, per_row: float, drafter: str | None = None
) -> tuple[pd.DataFrame, str]:
    """As `predicted_speedup`, priced by a fitted cost-model file at k = 1..6."""
    from rlsched.costs.costfile import FittedCostModel

    m = FittedCostModel(cost, path=cost_path)
    if not m.drafters:
        raise UserError(f"cost model file '{cost_path}' prices no drafter")
    drafter = drafter if drafter in m.drafters else m.drafters[0]
    rows = []
    for b in batches:
        plain = m.verify_time(b, 1, b * per_row)
        for k in range(1, 7):
            t = m.verify_time(b, k + 1, b * per_row) + m.draft_time(drafter, b, k, b * per_row)
            rows.append((int(b), k, float(expected_tokens(a, k) * plain / t)))
    return pd.DataFrame(rows, columns=["batch", "k", "speedup"]), drafter


def measured_speedup(steps: pd.DataFrame | None, min_steps: int = 3) -> pd.DataFrame | None:
    """From decode step records: per batch-size bucket (powers of two) and k, tokens per row per
    second of the steps with that k over those with k = 0 in the same bucket (sums of tokens
    per row over sums of step time, buckets with at least `min_steps` of each). An adaptive
    policy chooses k by batch size, so few buckets hold both; None where none does."""
    if steps is None:
        return None
    dec = steps[(steps["kind"] == "decode") & (steps["batch"] > 0) & (steps["step_ms"] > 0)]
    if dec.empty:
        return None
    dec = dec.assign(bucket=2 ** np.floor(np.log2(dec["batch"])).astype(int), per_row=dec["emitted"] / dec["batch"])
    g = dec.groupby(["bucket", "k"]).agg(n=("per_row", "size"), tok=("per_row", "sum"), ms=("step_ms", "sum"))
    g = g[g["n"] >= min_steps]
    rate = (g["tok"] / g["ms"]).rename("rate").reset_index()
    plain = rate[rate["k"] == 0].set_index("bucket")["rate"]
    sd = rate[(rate["k"] > 0) & rate["bucket"].isin(plain.index)]
    if sd.empty:
        return None
    return pd.DataFrame(
        {
            "batch": sd["bucket"].to_numpy(),
            "k": sd["k"].to_numpy(),
            "speedup": (sd["rate"] / plain.loc[sd["bucket"]].to_numpy()).to_numpy(),
        }
    )


# ----------------------------------------------------------------------------- the folder's figures


def _drafter(d: FolderData) -> str | None:
    """The drafter of most of the folder's speculative steps (else the summary's)."""
    if d.steps is not None:
        used = d.steps.loc[(d.steps["k"] > 0) & (d.steps["drafter"] != "off"), "drafter"].dropna()
        if len(used):
            return str(used.value_counts().index[0])
    return (d.summary or {}).get("drafter")


def _per_row(steps: pd.DataFrame | None) -> float | None:
    if steps is None:
        return None
    dec = steps[(steps["kind"] == "decode") & (steps["batch"] > 0)]
    return float((dec["ctx_tokens"] / dec["batch"]).median()) if len(dec) else None


def _speedup(d: FolderData, cost: dict | None, cost_path: Path | None, acceptance: float | None):
    measured_a = chain_acceptance(d.steps)
    a = acceptance if acceptance is not None else measured_a
    how = (
        "given"
        if acceptance is not None
        else "measured in this folder's SD steps"
        if measured_a is not None
        else "assumed; --acceptance sets it"
    )
    a = ASSUMED_ACCEPTANCE if a is None else a
    drafter, per_row = _drafter(d), _per_row(d.steps)
    predicted, title, why = None, "", ""
    if d.profile is not None:
        assert d.profile_path is not None  # loaded with its profile
        try:
            predicted, ctx, drafter = predicted_speedup(d.profile, a, per_row, drafter)
            title = (
                f"predicted from measured step costs ({d.profile_path.name}), context {ctx:g} per row, "
                f"drafter {drafter}\nper-token acceptance {a:.2f} ({how})"
            )
        except UserError as e:
            why = f"{d.profile_path}: {e}; "
    if predicted is None and cost is not None:
        assert cost_path is not None  # given with its cost model
        ctx = per_row if per_row is not None else 128.0
        top = int(d.steps["batch"].max()) if d.steps is not None else 256
        batches = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if b <= max(top, 1)] or [1]
        predicted, drafter = cost_model_speedup(cost, cost_path, a, batches, ctx, drafter)
        title = (
            f"predicted by {cost_path.name}, context {ctx:g} per row, drafter {drafter}\n"
            f"per-token acceptance {a:.2f} ({how})"
        )
    measured = measured_speedup(d.steps)
    if predicted is not None and predicted.empty:
        predicted = None
    if predicted is None and measured is None:
        return None, (why or "no step costs to predict from (no profile; --cost gives a cost-model file); ") + (
            "no batch-size bucket with both plain and speculative decode steps"
        )
    mtitle = (
        "measured: tokens per row per second of decode steps with k over k = 0\n"
        "in the same batch-size bucket (at least 3 steps each)"
    )
    return speedup_figure(predicted, measured, title, mtitle), None


def figures_for(
    d: FolderData,
    cost: dict | None = None,
    cost_path: Path | None = None,
    rl_step: int | None = None,
    acceptance: float | None = None,
) -> tuple[dict, dict]:
    """({name: Figure} of every figure the folder's data supports, {name: why not} of the rest)."""
    figs, skipped = {}, {}
    if d.kind == "compare" and d.compare is not None:
        return {"compare": compare_figure(d.compare, [])}, {}
    if d.kind == "plan" and d.plan is not None:
        return {"pareto": plan_figure(d.plan)}, {}
    if d.profile is not None or cost is not None or (d.kind == "engine" and d.steps is not None):
        try:
            figs["fit"] = fit_figure_for(d, cost, cost_path)
        except UserError as e:
            skipped["fit"] = str(e)
    else:
        skipped["fit"] = "no profile in the folder (give a cost-model file with --cost to draw one against its steps)"
    try:
        fig, why = _speedup(d, cost, cost_path, acceptance)
    except UserError as e:
        fig, why = None, str(e)
    if fig is not None:
        figs["speedup"] = fig
    else:
        skipped["speedup"] = why
    per_step = per_step_acceptance(d)
    if per_step is not None and d.kind in ("run", "simulate", "engine"):
        figs["acceptance"] = acceptance_figure(per_step)
    else:
        skipped["acceptance"] = "no RL steps with speculative decode steps"
    if d.steps is not None and (d.steps["kind"] == "decode").any():
        figs["batch_k"] = batch_k_figure(d.steps, rl_step)
    else:
        skipped["batch_k"] = "no decode step records"
    if d.kind == "engine" and d.steps is not None:
        figs["step_times"] = step_time_figure(d.steps)
    if d.rl_steps is not None:
        figs["stages"] = stage_figure(d.rl_steps)
    else:
        skipped["stages"] = UNKNOWN if d.kind == "engine" else "no RL step records"
    if d.rl_steps is not None and {"reward_mean", "reward_std", "samples", "mean_accept_len", "accept_rate"} <= set(
        d.rl_steps.columns
    ):
        figs["learning_curve"] = run_figure(d.rl_steps)
    return {k: figs[k] for k in ORDER if k in figs}, skipped


def write_figures(figs: dict, out: Path) -> list[Path]:
    """Each figure as NAME.png and NAME.pdf under `out` (each file atomically)."""
    paths = []
    for name, fig in figs.items():
        for suffix in (".png", ".pdf"):
            p = Path(out) / f"{name}{suffix}"
            save_figure(fig, p)
            paths.append(p)
    return paths
