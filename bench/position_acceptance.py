"""Acceptance by draft position on the built-in pair: each drafter's fitted curve, and the
simulator's expected tokens per verify from it against the measured ones for k = 1..8.

Workload. GRPO-like rollouts of the built-in task prompts (`bench/drafters.py`: P prompts x G
samples, temperature 1, at most T tokens, every sample admitted at once), on rlsched's engine
with each drafter (`builtin`: the 2-layer draft model, `eagle`: the EAGLE-3-style head,
`ngram`, `suffix`) as a chain `static:k` for k = 1..8, `--epochs` rollouts each. The n-gram and
suffix drafters draft from the earlier samples of a prompt, so their first epoch only fills
their history and is not recorded; the draft model's and the head's every epoch is. Each run's
step records (written and read back as traces) hold each chain step's counts by draft position
(`accepted_by_position`, `tried_by_position`, `drafted_by_position`).

Fits (`policies/position_fit.py`, alpha_i = alpha x decay^(i - 1)):
- `k=8 counts`: the k = 8 run's counts by position (an exact Binomial chain);
- `all counts`: every k's step records, by their counts;
- `all sums`: every k's step records without the counts (the convolution of each step's sum;
  steps whose rows drafted different lengths are left out).
The fit's error is the largest gap between the observed conditional rate of a position
(accepted / tried, k = 8) and the fitted alpha_i.

Per k: measured tokens per verify = accepted drafts / rows that drafted + 1 over the run's chain
steps; the simulator's expectation from the k = 8 fit, 1 + sum_n R(n) x drafted_n / drafted_1
with R(n) = prod_{i<=n} alpha_i (`policies.position.reach`) and drafted_n the rows that drafted
at least n (the rows' own lengths: capped near their budget, or the drafter's shorter drafts),
and `chain_tokens` at k itself for reference; the `empirical` column takes the k = 8 run's
observed conditional rates instead of the curve (the gap left by rows, not by the curve's
shape). The target is a relative error within 5% for every k.

Run: python bench/position_acceptance.py [--prompts 16] [--group 4] [--max-tokens 64]
[--epochs 2] [--drafters builtin,eagle,ngram,suffix]. Results:
bench/results/position_acceptance.{json,txt} (in $OUT when it is set).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import table, write_result  # noqa: E402
from drafters import Drafters, engine, requests  # noqa: E402

from rlsched.executor.engine.recorder import Recorder  # noqa: E402
from rlsched.policies.position import chain_tokens, reach  # noqa: E402
from rlsched.policies.position_fit import fit_drafter  # noqa: E402
from rlsched.traces.reader import read_trace  # noqa: E402
from rlsched.traces.schema import POSITION_COLUMNS  # noqa: E402

KS = range(1, 9)
NAMES = {"builtin": "model", "eagle": "eagle", "ngram": "ngram", "suffix": "suffix"}  # label -> engine drafter
HISTORY = ("ngram", "suffix")  # drafters whose first epoch only fills their history
TARGET = 0.05


def run_k(d: Drafters, drafter: str, k: int, reqs, epochs: int, folder: Path):
    """One drafter's static:k rollouts; the recorded epochs' chain-step records."""
    eng, gen = engine(d, drafter, f"static:{k}:{drafter}", reqs, len(reqs))
    first = 1 if drafter in HISTORY else 0
    for e in range(epochs):
        if e == first:
            eng.recorder = Recorder(folder)
        gen.manual_seed(1000 * k + e)
        eng.run(reqs)
    eng.recorder.close()
    steps = read_trace(folder, "steps")
    return steps[(steps["drafted"] > 0) & (steps["width"] == 1)].reset_index(drop=True)


def totals(steps, column: str, depth: int) -> np.ndarray:
    """A count column summed by position over the steps (positions 1..depth)."""
    out = np.zeros(depth)
    for c in steps[column]:
        c = np.asarray(c, dtype=float)[:depth]
        out[: len(c)] += c
    return out


def expected_tokens(rates: np.ndarray, steps, k: int) -> float:
    """1 + expected accepted drafts a drafting row at the conditional rates `rates` (k of them),
    each row at its own draft length."""
    drafted = totals(steps, "drafted_by_position", k)
    r = np.cumprod(rates[:k])
    return 1.0 + float(r @ drafted) / drafted[0]


def measured_se(steps, rows: float) -> float:
    """The standard error of accepted / drafting rows over chain steps (a ratio over steps, each
    step's rows taken together: rows of one step share their samples' luck)."""
    if len(steps) < 2 or not rows:
        return float("nan")
    n = np.array([c[0] for c in steps["tried_by_position"]], dtype=float)
    a = np.asarray(steps["accepted"], dtype=float)
    resid = a - n * a.sum() / rows
    return float(np.sqrt(len(n) / (len(n) - 1) * (resid @ resid)) / rows)


def fit_row(label: str, name: str, f, observed: np.ndarray) -> dict:
    fitted = f.alpha * f.decay ** np.arange(len(observed))
    ok = np.isfinite(observed)
    return dict(
        drafter=label,
        fit=name,
        alpha=f.alpha,
        alpha_se=f.alpha_se,
        decay=f.decay,
        decay_se=f.decay_se,
        count_records=f.positions,
        sum_records=f.steps,
        skipped=f.skipped,
        max_rate_gap=float(np.max(np.abs(observed[ok] - fitted[ok]))) if ok.any() else float("nan"),
    )


def drafter_section(d: Drafters, label: str, args, root: Path) -> dict:
    name = NAMES[label]
    reqs = requests(args.prompts, args.group, args.max_tokens)
    runs = {}
    for k in KS:
        t = time.perf_counter()
        runs[k] = run_k(d, name, k, reqs, args.epochs, root / f"{label}-{k}")
        print(f"  {label} static:{k}: {len(runs[k])} chain steps, {time.perf_counter() - t:.1f} s", flush=True)
    both = [s for s in runs.values() if len(s)]
    every = pd.concat(both, ignore_index=True)
    k8 = runs[max(KS)]
    tried, acc = totals(k8, "tried_by_position", max(KS)), totals(k8, "accepted_by_position", max(KS))
    with np.errstate(invalid="ignore", divide="ignore"):
        observed = acc / tried
    fits = {
        "k=8 counts": fit_drafter(name, k8),
        "all counts": fit_drafter(name, every),
        "all sums": fit_drafter(name, every.drop(columns=list(POSITION_COLUMNS))),
    }
    main, alls = fits["k=8 counts"], fits["all counts"]
    curve = main.alpha * main.decay ** np.arange(max(KS))
    curve_all = alls.alpha * alls.decay ** np.arange(max(KS))
    empirical = np.nan_to_num(observed, nan=0.0)
    per_k = []
    for k, s in runs.items():
        rows = float(s["tried_by_position"].map(lambda c: c[0]).sum()) if len(s) else 0.0
        measured = 1.0 + float(s["accepted"].sum()) / rows if rows else float("nan")
        sim = expected_tokens(curve, s, k) if rows else float("nan")
        per_k.append(
            dict(
                drafter=label,
                k=k,
                steps=len(s),
                drafting_rows=int(rows),
                mean_drafts=float(s["drafted"].sum()) / rows if rows else float("nan"),
                measured=measured,
                measured_se=measured_se(s, rows),
                simulated=sim,
                rel_err=sim / measured - 1,
                simulated_at_k=float(chain_tokens(np.array([main.alpha]), np.array([k]), main.decay)[0]),
                rel_err_all_counts=(expected_tokens(curve_all, s, k) if rows else float("nan")) / measured - 1,
                rel_err_empirical=(expected_tokens(empirical, s, k) if rows else float("nan")) / measured - 1,
            )
        )
    reach8 = reach(main.alpha, max(KS), main.decay)[1:]
    return dict(
        fits=[fit_row(label, n, f, observed) for n, f in fits.items()],
        positions=dict(tried=tried.tolist(), accepted=acc.tolist(), observed=observed.tolist(), fitted=curve.tolist()),
        reach_fitted=reach8.tolist(),
        per_k=per_k,
    )


def report(results: dict, args, seconds: float) -> str:
    fits = [f for r in results.values() for f in r["fits"]]
    fit_text = table(
        ["drafter", "fit", "alpha", "± se", "decay", "± se", "count recs", "sum recs", "skipped", "max rate gap"],
        [
            [
                f["drafter"],
                f["fit"],
                f["alpha"],
                f["alpha_se"],
                f["decay"],
                f["decay_se"],
                f["count_records"],
                f["sum_records"],
                f["skipped"],
                f["max_rate_gap"],
            ]
            for f in fits
        ],
    )
    pos_text = table(
        ["drafter", *[f"i={i}" for i in KS]],
        [
            row
            for label, r in results.items()
            for row in (
                [f"{label} observed", *r["positions"]["observed"]],
                [f"{label} fitted", *r["positions"]["fitted"]],
                [f"{label} tried", *[int(t) for t in r["positions"]["tried"]]],
            )
        ],
    )
    rows = [p for r in results.values() for p in r["per_k"]]
    k_heads = ["drafter", "k", "rows", "drafts/row", "measured", "± se", "simulated", "rel err", "sim at k"]
    k_text = table(
        [*k_heads, "err all", "err emp"],
        [
            [
                p["drafter"],
                p["k"],
                p["drafting_rows"],
                p["mean_drafts"],
                p["measured"],
                f"{100 * p['measured_se'] / p['measured']:.1f}%",
                p["simulated"],
                f"{100 * p['rel_err']:+.1f}%",
                p["simulated_at_k"],
                f"{100 * p['rel_err_all_counts']:+.1f}%",
                f"{100 * p['rel_err_empirical']:+.1f}%",
            ]
            for p in rows
        ],
    )
    worst = {label: max(abs(p["rel_err"]) for p in r["per_k"]) for label, r in results.items()}
    noisy = {
        label: sum(abs(p["simulated"] - p["measured"]) > 2 * p["measured_se"] for p in r["per_k"])
        for label, r in results.items()
    }
    verdict = ", ".join(
        f"{label} {100 * w:.1f}% ({'within' if w <= TARGET else 'misses'} {100 * TARGET:.0f}%; "
        f"{noisy[label]} of {len(KS)} k beyond 2 se)"
        for label, w in worst.items()
    )
    head = (
        f"{args.prompts} prompts x {args.group} samples, at most {args.max_tokens} tokens, temperature 1, "
        f"{args.epochs} epochs (n-gram, suffix: the last {args.epochs - 1} recorded); {seconds:.0f} s"
    )
    return (
        f"{head}\n\nfits\n{fit_text}\n\nconditional acceptance by position (k = 8 run)\n{pos_text}\n\n"
        f"tokens per verify (simulated: the k = 8 counts' curve at the rows' own draft lengths)\n{k_text}\n\n"
        f"largest |rel err| over k = 1..8: {verdict}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--drafters", default=",".join(NAMES), help="a subset, comma-separated")
    args = ap.parse_args()
    labels = [x for x in args.drafters.split(",") if x]
    unknown = [x for x in labels if x not in NAMES]
    if unknown:
        ap.error(f"--drafters: unknown {', '.join(unknown)} (choose from {', '.join(NAMES)})")
    if args.epochs < 2:
        ap.error("--epochs must be >= 2 (the n-gram and suffix drafters' first epoch fills their history)")
    torch.set_num_threads(args.threads)
    d = Drafters()
    t0 = time.perf_counter()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label in labels:
            results[label] = drafter_section(d, label, args, Path(tmp))
    seconds = time.perf_counter() - t0
    text = report(results, args, seconds)
    print(text, flush=True)
    payload = {"args": vars(args), "seconds": seconds, "target": TARGET, "drafters": results}
    write_result("position_acceptance", payload, text, os.environ.get("OUT") or None)


if __name__ == "__main__":
    main()
