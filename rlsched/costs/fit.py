"""`rlsched fit`: fit the cost model's forms to measured step times, check them on held-out
points, and write the versioned cost-model file (`costs/costfile.py`).

Records come from a `rlsched profile` folder (kind verify | draft | prefill | feed, one record
per grid point) or a run folder (`generate`, `run`: kind decode | prefill, one record per engine
step), anything holding `traces/steps/`. Each operation (verify, prefill, and per drafter its
drafting and its feed, the catch-up a profile times) is fitted with scipy's least_squares on
log residuals (relative error, which is what MAPE counts) with a soft-L1 loss (a point
disturbed by another process on a shared machine weighs little), from a linear least-squares
start plus a few perturbed ones.

A vLLM engine's records add two optional entries: `mixed`, what prompt chunks add to the
decode/verify rows' forward in one step (records of kind mixed that say the step's prompt
tokens, `prompt_tokens` and `prompt_sq`; verify as fitted), and `host`, the host
work with every step outside the timed forward (the median gap between one step record and the
next of an engine; `hook` the median `hook_ms`, the policy's part of it, where recorded).

Held-out check: on a full grid of at least three batch sizes the fit is repeated without every
other interior batch size (1, 4, 16, 64 kept; 2, 8, 32 held out), so held-out points are whole
batch sizes the fit never saw; otherwise (run traces) a seeded random 25% of the records. The
file's parameters are then fitted on all points. Where the form's held-out MAPE exceeds the
threshold and interpolation over the measured grid (MeasuredCostModel's) does better on the
same held-out points, the op keeps the grid and is priced by interpolation; the output says so.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from scipy.optimize import least_squares, nnls

from rlsched import __version__
from rlsched.costs.costfile import FORMS, KIND, PARAMS, PER_DRAFTER, VERSION, grid_interpolator, op_ms
from rlsched.costs.measured import grid_time
from rlsched.errors import UserError
from rlsched.traces.reader import read_trace

DEFAULT_MAX_MAPE = 0.05
# terms dropped when an op has fewer than two points per parameter: prefill's cache spill
FROZEN = {"prefill": {"g": 0.0, "s_c": 1.0, "h": 1.0}}
FROZEN["feed"] = FROZEN["prefill"]
# and, with fewer than two points per parameter still free, attention's quadratic term: a few
# prompts of a few lengths cannot tell it from the per-token cost, and a fit through two points
# can put it all on the pairs and price a batch of prompts many times over
FEWER = {"prefill": {"c": 0.0}, "feed": {"c": 0.0}}
_STARTS = 6


@dataclass
class OpFit:
    """One operation's fit: `key` is verify, prefill, draft:<drafter> or feed:<drafter>."""

    key: str
    params: dict
    used: str  # parametric | interpolation
    quality: dict
    data: pd.DataFrame  # batch, tokens, ctx_tokens, per_row, ms (for the plot and the grid)
    grid: list | None = None
    note: str = ""

    @property
    def op(self) -> str:
        return self.key.partition(":")[0]

    def predict_ms(self, batch, tokens, per_row):
        """The fitted form (always; the plot shows it even where the grid is used)."""
        return op_ms(self.op, self.params, batch, tokens, per_row)

    def entry(self) -> dict:
        out: dict[str, Any] = {
            "used": self.used,
            "form": FORMS[self.op],
            "params": dict(self.params),
            "quality": dict(self.quality),
        }
        if self.used == "interpolation":
            out["grid"] = self.grid
        return out


@dataclass
class FitResult:
    ops: dict[str, OpFit]
    source: dict
    max_mape: float
    notes: list[str] = field(default_factory=list)
    extra: dict[str, dict] = field(default_factory=dict)  # the optional entries: mixed, host
    acceptance: dict[str, dict] = field(default_factory=dict)  # per drafter: its curve by draft position

    def to_json(self) -> dict:
        per = {op: {k.partition(":")[2]: f.entry() for k, f in self.ops.items() if f.op == op} for op in PER_DRAFTER}
        if not per["feed"]:
            del per["feed"]  # (optional in the file)
        return {
            "kind": KIND,
            "version": VERSION,
            "ops": {"verify": self.ops["verify"].entry(), "prefill": self.ops["prefill"].entry(), **per, **self.extra},
            "max_mape": self.max_mape,
            "source": self.source,
            "notes": self.notes,
            "created": {"rlsched": __version__, "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
        }

    def summary(self) -> dict:
        return {
            "ops": {
                **{k: {"used": f.used, **f.quality} for k, f in self.ops.items()},
                **{k: {"used": e["used"], **e["quality"], **e["params"]} for k, e in self.extra.items()},
            },
            "source": self.source,
            "notes": self.notes,
            "max_mape": self.max_mape,
            "acceptance_by_position": self.acceptance,
        }


# ----------------------------------------------------------------------------- records


def read_records(path) -> tuple[pd.DataFrame, dict]:
    """Step records of a profile or run folder (or of its traces/ folder), and where they came from."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"fit: '{path}' does not exist; give a `rlsched profile` folder or a run folder")
    for steps in (path / "traces" / "steps", path / "steps"):
        if steps.is_dir():
            break
    else:
        raise UserError(
            f"fit: '{path}' holds no step traces (no traces/steps/); give a `rlsched profile` folder or a run folder"
        )
    df = read_trace(steps, "steps")
    if df.empty:
        raise UserError(f"fit: '{steps}' holds no step records; re-run the profile or the run")
    source = {"path": str(path.resolve()), "records": int(len(df))}
    for name in ("profile.json", "summary.json"):
        info = path / name
        if info.is_file():
            try:
                meta = json.loads(info.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError):
                meta = {}
            if isinstance(meta, dict):
                source.update(
                    {
                        k: meta[k]
                        for k in (
                            "model",
                            "model_shape",
                            "drafter",
                            "drafters",
                            "device",
                            "dtype",
                            "threads",
                            "machine",
                            "created_utc",
                        )
                        if k in meta
                    }
                )
            source["kind"] = "profile" if name == "profile.json" else "run"
            break
    else:
        source["kind"] = "profile" if set(df["kind"]) & {"verify", "draft"} else "run"
    return df, source


def op_tables(df: pd.DataFrame) -> tuple[dict[str, pd.DataFrame], list[str]]:
    """Per operation: rows (batch, tokens, ctx_tokens, per_row, ms). Profile kinds map directly;
    a run's decode steps give verify (q = k + 1) and drafting, kept only where every row drafted
    k (a row capped near its budget makes the step's shape unknown)."""
    notes = []
    df = df[(df["batch"] > 0)]
    parts: dict[str, list] = {}

    def add(key, d, tokens, ms):
        d = pd.DataFrame(
            {
                "batch": d["batch"].to_numpy(float),
                "tokens": np.asarray(tokens, dtype=float),
                "ctx_tokens": d["ctx_tokens"].to_numpy(float),
                "ms": np.asarray(ms, dtype=float),
            }
        )
        parts.setdefault(key, []).append(d)

    v = df[df["kind"] == "verify"]
    add("verify", v, v["k"] + 1, v["verify_ms"])
    drafts = df[df["kind"] == "draft"]
    if "width" in drafts:  # a profile's tree drafts: the fit prices trees as width rows a row
        drafts = drafts[drafts["width"].fillna(1) <= 1]
    for name, d in drafts.groupby("drafter"):
        add(f"draft:{name}", d, d["k"], d["draft_ms"])
    dec = df[df["kind"] == "decode"]
    if len(dec):
        covered = dec["steps"].fillna(1) if "steps" in dec else 1  # an imported record spans several steps
        uniform = dec["drafted"] == dec["batch"] * dec["k"] * dec["width"].clip(lower=1) * covered
        if (~uniform).any():
            notes.append(
                f"{int((~uniform).sum())} of {len(dec)} decode steps drafted ragged lengths (rows capped "
                "near their budget, or per-sequence k) and were left out"
            )
        dec = dec[uniform & (dec["width"] <= 1)]
        add("verify", dec, dec["k"] + 1, dec["verify_ms"])
        sd = dec[dec["k"] > 0]
        for name, d in sd.groupby("drafter"):
            add(f"draft:{name}", d, d["k"], d["draft_ms"])
    p = df[df["kind"] == "prefill"]
    add("prefill", p, np.ones(len(p)), p["step_ms"])
    for name, d in df[df["kind"] == "feed"].groupby("drafter"):
        add(f"feed:{name}", d, np.ones(len(d)), d["step_ms"])
    tables = {}
    for key, ds in parts.items():
        t = pd.concat(ds, ignore_index=True)
        t = t[np.isfinite(t["ms"]) & (t["ms"] > 0) & (t["ctx_tokens"] > 0)]
        if len(t):
            tables[key] = t.assign(per_row=t["ctx_tokens"] / t["batch"]).reset_index(drop=True)
    if "verify" not in tables:
        whole = df[(df["kind"] == "decode") & (df["k"] > 0)]
        if len(whole) and whole["verify_ms"].isna().all() and whole["step_ms"].notna().any():
            raise UserError(
                "fit: these speculative steps are timed as a whole (vLLM does not time drafting and "
                "verification apart); fit a run with policy off, or an `rlsched import-vllm` of a sweep "
                "over k (bench/peers/vllm_spec_metrics.py)"
            )
        raise UserError("fit: the records hold no verify (or decode) step times; profile with `rlsched profile`")
    if "prefill" not in tables:
        raise UserError("fit: the records hold no prefill step times; profile with `rlsched profile`")
    return tables, notes


# ----------------------------------------------------------------------------- fitting


def mape(pred, y) -> float:
    y = np.asarray(y, dtype=float)
    return float(np.mean(np.abs(np.asarray(pred, dtype=float) - y) / y))


def r_squared(pred, y) -> float:
    y = np.asarray(y, dtype=float)
    ss_tot = float(((y - y.mean()) ** 2).sum())
    ss_res = float(((y - np.asarray(pred, dtype=float)) ** 2).sum())
    return 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0)


def _linear_start(op: str, t: pd.DataFrame) -> dict:
    """Non-negative least squares on the forms with the bend removed (p -> 0, no spill)."""
    B, q, L, y = (t[c].to_numpy(float) for c in ("batch", "tokens", "per_row", "ms"))
    if op == "verify":
        X = np.column_stack([np.ones_like(B), q > 1, (q == 1) & (B > 1), B * q, B, B * q * (L + (q - 1) / 2), B * L])
        names: tuple[str, ...] = ("t0", "s", "u", "a", "r", "c", "kv")
    elif op == "draft":
        X = np.column_stack([np.ones_like(B), B * L, q, q * B, q * B * L, np.maximum(q - 1, 0) * (B > 1)])
        names = ("e", "d", "t0", "a", "c", "s")
    else:
        n = B * L
        X = np.column_stack([np.ones_like(B), n, n * L / 2])
        names = ("t0", "a", "c")
    w = 1.0 / y  # relative error
    sol, _ = nnls(X * w[:, None], y * w)
    p = dict(zip(names, sol))
    if op in ("verify", "draft"):
        p.update(m=max(float(np.min(y)) * 0.2, 1e-6), p=1.0)
    else:
        pairs = B * L * L / 2  # the prompts' token pairs (S / 2)
        p.update(g=max(p["c"], 1e-9) * 0.5, s_c=float(np.median(pairs)), h=max(float(np.median(pairs)) / 4, 1.0))
    return p


def fit_form(op: str, t: pd.DataFrame, seed: int = 0, frozen: dict | None = None) -> dict:
    """Least-squares parameters of `op`'s form on rows `t` (batch, tokens, per_row, ms);
    `frozen` parameters keep their given values."""
    names = PARAMS[op]
    frozen = frozen or {}
    free = [n for n in names if n not in frozen]
    start = {**_linear_start(op, t), **frozen}
    B, q, L, y = (t[c].to_numpy(float) for c in ("batch", "tokens", "per_row", "ms"))
    logy = np.log(y)
    scale = {n: max(abs(start[n]), 1e-6) for n in free}
    # every parameter is a scale times exp(x): positive, and fitted on a log scale
    # (p and n_c span decades; x = 0 is the start)

    def params(x):
        return {**frozen, **{n: scale[n] * np.exp(v) for n, v in zip(free, x)}}

    def resid(x):
        return np.log(np.maximum(op_ms(op, params(x), B, q, L), 1e-12)) - logy

    rng = np.random.default_rng(seed)
    best = None
    for i in range(_STARTS):
        x0 = np.zeros(len(free)) if i == 0 else rng.normal(0.0, 1.0, len(free))
        with np.errstate(all="ignore"):
            r = least_squares(resid, x0, loss="soft_l1", f_scale=0.05, method="trf", max_nfev=400)
        if np.all(np.isfinite(r.fun)) and (best is None or r.cost < best.cost):
            best = r
    if best is None:
        raise UserError(f"fit: the {op} measurements could not be fitted (no finite solution); check the records")
    return {n: float(v) for n, v in params(best.x).items()}


def _holdout(t: pd.DataFrame, seed: int) -> tuple[np.ndarray, str, bool]:
    """(held-out mask, how, whether the rest is a full grid)."""
    keys = t[["batch", "tokens", "per_row"]].drop_duplicates()
    sizes = [t[c].nunique() for c in ("batch", "tokens", "per_row")]
    batches = sorted(t["batch"].unique())
    if len(keys) == int(np.prod(sizes)) and len(batches) >= 3:
        held = batches[1:-1:2]
        return t["batch"].isin(held).to_numpy(), "batch sizes " + ", ".join(str(int(b)) for b in held), True
    if len(t) >= 8:
        mask = np.zeros(len(t), dtype=bool)
        mask[np.random.default_rng(seed).permutation(len(t))[: max(1, len(t) // 4)]] = True
        return mask, "a random 25% of the records", False
    return np.zeros(len(t), dtype=bool), "none: too few points", False


def _grid_points(t: pd.DataFrame) -> list:
    g = t.groupby(["batch", "tokens", "per_row"], as_index=False)["ms"].median()
    return [
        [float(b), float(k), float(b * L), float(ms)]
        for b, k, L, ms in g[["batch", "tokens", "per_row", "ms"]].itertuples(index=False)
    ]


def _interp_ms(op: str, points: list, t: pd.DataFrame):
    interp = grid_interpolator(op, points, op)
    return np.array(
        [grid_time(interp, b, k, b * L) * 1e3 for b, k, L in t[["batch", "tokens", "per_row"]].itertuples(index=False)]
    )


def fit_op(key: str, t: pd.DataFrame, max_mape: float = DEFAULT_MAX_MAPE, seed: int = 0) -> OpFit:
    op = key.partition(":")[0]
    frozen = FROZEN.get(op, {}) if len(t) < 2 * len(PARAMS[op]) else {}
    if frozen and len(t) < 2 * (len(PARAMS[op]) - len(frozen)):
        frozen = {**frozen, **FEWER.get(op, {})}
    held, how, grid = _holdout(t, seed)
    q: dict[str, Any] = {
        "points": int(len(t)),
        "heldout": how,
        "heldout_points": int(held.sum()),
        "mape_train": None,
        "mape_heldout": None,
        "max_ape_heldout": None,
        "interp_mape_heldout": None,
    }
    if held.any():
        train, test = t[~held], t[held]
        p = fit_form(op, train, seed, frozen)
        pred = op_ms(op, p, test["batch"], test["tokens"], test["per_row"])
        q["mape_train"] = mape(op_ms(op, p, train["batch"], train["tokens"], train["per_row"]), train["ms"])
        q["mape_heldout"] = mape(pred, test["ms"])
        q["max_ape_heldout"] = float(np.max(np.abs(pred - test["ms"]) / test["ms"]))
        if grid:
            with contextlib.suppress(UserError):
                q["interp_mape_heldout"] = mape(_interp_ms(op, _grid_points(train), test), test["ms"])
    p = fit_form(op, t, seed, frozen)
    pred = op_ms(op, p, t["batch"], t["tokens"], t["per_row"])
    q["r2"], q["mape"] = r_squared(pred, t["ms"]), mape(pred, t["ms"])
    used, note, points = "parametric", "", None
    mh, mi = q["mape_heldout"], q["interp_mape_heldout"]
    bar = f"{100 * max_mape:g}%"
    if mh is not None and mh > max_mape:
        if mi is not None and mi < mh:
            try:
                points = _grid_points(t)
                grid_interpolator(op, points, key)
                used = "interpolation"
                note = (
                    f"{key}: the form's held-out MAPE {mh:.1%} is above {bar}; interpolating over "
                    f"the measured grid instead (held-out MAPE {mi:.1%})"
                )
            except UserError:
                points = None
        if used == "parametric":
            why = (
                f"interpolation does no better ({mi:.1%})"
                if mi is not None
                else "there is no full grid to interpolate over"
            )
            note = f"{key}: the form's held-out MAPE {mh:.1%} is above {bar} and {why}; kept the form"
    return OpFit(key, p, used, q, t, points, note)


def mixed_table(df: pd.DataFrame) -> tuple[pd.DataFrame | None, list[str]]:
    """Mixed steps (decode/verify rows beside prompt chunks) whose records say their prompt
    tokens: batch, tokens (q, mean over rows), per_row, n (prompt tokens), S (`prompt_sq`, or
    n^2 where not recorded: one chunk), ms (the forward: verify_ms, or step_ms of a step that
    drafted nothing)."""
    m = df[df["kind"] == "mixed"]
    if m.empty:
        return None, []
    if "prompt_tokens" not in m:
        return None, [
            f"{len(m)} mixed steps left out: their records do not say the prompt tokens they computed "
            "(prompt_tokens); the file prices mixed steps by its verify and prefill"
        ]
    n = m["prompt_tokens"].to_numpy(float)
    sq = m["prompt_sq"].to_numpy(float) if "prompt_sq" in m else np.full(len(m), np.nan)
    ms = np.where(np.isfinite(m["verify_ms"]), m["verify_ms"], np.where(m["drafted"] == 0, m["step_ms"], np.nan))
    b = (m["decode_rows"] if "decode_rows" in m else m["batch"]).to_numpy(float)  # rows not in a prompt
    t = pd.DataFrame(
        {
            "batch": b,
            "tokens": 1.0 + m["drafted"].to_numpy(float) / np.maximum(b, 1.0),
            "per_row": m["ctx_tokens"].to_numpy(float) / np.maximum(b, 1.0),
            "n": n,
            "S": np.where(np.isfinite(sq) & (sq > 0), sq, n * n),
            "ms": ms,
        }
    )
    t = t[(t["batch"] > 0) & np.isfinite(t["n"]) & (t["n"] > 0) & np.isfinite(t["ms"]) & (t["ms"] > 0)]
    return t.reset_index(drop=True), []


def fit_mixed(ops: dict[str, OpFit], t: pd.DataFrame) -> dict:
    """The mixed entry: the chunks' part (t0, a, c >= 0; `costfile.py`) fitted to mixed steps `t`
    (`mixed_table`) beside their rows' verify as fitted, on log residuals with a soft-L1 loss as
    the other ops; it starts from prefill's slope."""
    v = np.asarray(op_ms("verify", ops["verify"].params, t["batch"], t["tokens"], t["per_row"]), dtype=float)
    n, half_s, y = t["n"].to_numpy(float), t["S"].to_numpy(float) / 2, t["ms"].to_numpy(float)
    pp = ops["prefill"].params

    def chunks(x):
        return x[0] + x[1] * n + x[2] * half_s

    def resid(x):
        return np.log(np.maximum(v + chunks(x), 1e-12)) - np.log(y)

    scale = [1.0, max(pp["a"], 1e-6), max(pp["c"], 1e-9)]
    with np.errstate(all="ignore"):
        r = least_squares(
            resid, scale, bounds=([0.0] * 3, [np.inf] * 3), x_scale=scale, loss="soft_l1", f_scale=0.05, max_nfev=400
        )
    x = r.x if np.all(np.isfinite(r.fun)) else np.array([0.0, pp["a"], pp["c"]])
    quality = {"points": int(len(t)), "mape": mape(v + chunks(x), y), "r2": r_squared(v + chunks(x), y)}
    params = {"t0": float(x[0]), "a": float(x[1]), "c": float(x[2])}
    return {"used": "parametric", "form": FORMS["mixed"], "params": params, "quality": quality}


def fit_host(df: pd.DataFrame) -> dict | None:
    """The host entry from an engine's step records (decode, prefill, mixed; a profile has
    none): `step`, the median gap between one record's end and the next one's start within a
    rollout of one instance (at least 0), and `hook`, the median `hook_ms` where recorded."""
    d = df[df["kind"].isin(("decode", "prefill", "mixed"))]
    if "source" in d:  # an import of vLLM's metrics: each record an interval's mean step, no gaps between
        d = d[d["source"] != "vllm"]
    if "time_s" not in d or not d["kind"].isin(("decode", "mixed")).any():
        return None  # (a profile: its prefill points are timed apart)
    keys = [k for k in ("rl_step", "instance") if k in d]
    gaps = []
    for _, g in d.sort_values([*keys, "time_s"]).groupby(keys):
        t, ms = g["time_s"].to_numpy(float), g["step_ms"].to_numpy(float)
        gap = t[1:] - (t[:-1] + ms[:-1] / 1e3)
        gaps.append(gap[np.isfinite(gap)])
    gaps = [g for g in gaps if len(g)]
    if not gaps:
        return None
    step = max(float(np.median(np.concatenate(gaps))) * 1e3, 0.0)
    hook = d["hook_ms"].to_numpy(float) if "hook_ms" in d else np.zeros(0)
    hook = hook[np.isfinite(hook)]
    params = {"step": step, "hook": float(np.median(hook)) if len(hook) else 0.0}
    quality = {"points": int(sum(len(g) for g in gaps)), "hook_points": int(len(hook))}
    return {"used": "parametric", "form": FORMS["host"], "params": params, "quality": quality}


def fit_records(
    df: pd.DataFrame, source: dict | None = None, max_mape: float = DEFAULT_MAX_MAPE, seed: int = 0
) -> FitResult:
    tables, notes = op_tables(df)
    ops = {}
    for key in ["verify", "prefill"] + sorted(k for k in tables if k.partition(":")[0] in PER_DRAFTER):
        ops[key] = fit_op(key, tables[key], max_mape, seed)
        if ops[key].note:
            notes.append(ops[key].note)
    if not any(k.startswith("draft:") for k in ops):
        notes.append("no draft measurements: the file prices no drafter (profile with --drafter)")
    extra = {}
    mixed, more = mixed_table(df)
    notes += more
    if mixed is not None and len(mixed):
        extra["mixed"] = fit_mixed(ops, mixed)
    host = fit_host(df)
    if host is not None:
        extra["host"] = host
    return FitResult(ops, source or {}, max_mape, notes, extra)


def fit_path(path, max_mape: float = DEFAULT_MAX_MAPE, seed: int = 0) -> FitResult:
    df, source = read_records(path)
    return fit_records(df, source, max_mape, seed)
