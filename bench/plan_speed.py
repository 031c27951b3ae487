"""How fast `rlsched plan` is, and how close its pick is to simulating every candidate.

Runs the CLI (`rlsched plan --workload PRESET --gpus N -j WORKERS`) and times it end to end
(screen, successive halving, the explanation, the files); then simulates every feasible
candidate of the same space on the same seeds (setups the planner knows to be identical are
simulated once). Reported: candidates, the plan's wall time; the simulated step time of the
plan's winner against the best found by simulating everything (mean over the seeds); the
Spearman rank correlation between the plan's order and the exhaustive order over the
exhaustive top 10, and where the exhaustive best sits in the plan's order.

Run: python bench/plan_speed.py [--preset respec-qwen2.5-7b] [--gpus 16] [--seeds 3] [--workers 2].
Results: bench/results/plan_speed.{json,txt}.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from scipy import stats

sys.path.insert(0, str(Path(__file__).parent))
from _common import table, write_result  # noqa: E402

from rlsched.config import load_config  # noqa: E402
from rlsched.plan.screen import screen  # noqa: E402
from rlsched.plan.search import Ranked, run_seed, signature  # noqa: E402
from rlsched.plan.space import Space, candidates  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="respec-qwen2.5-7b")
    ap.add_argument("--gpus", type=int, default=16)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan"
        cmd = [
            sys.executable,
            "-m",
            "rlsched",
            "plan",
            "--workload",
            args.preset,
            "--gpus",
            str(args.gpus),
            "--seeds",
            str(args.seeds),
            "-j",
            str(args.workers),
            "--out",
            str(out),
            "--json",
        ]
        t = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        plan_s = time.perf_counter() - t
        if proc.returncode != 0:
            sys.exit(f"rlsched plan failed ({proc.returncode}): {proc.stderr.strip().splitlines()[-1]}")
        plan = json.loads((out / "plan.json").read_text())
    order = [r["setup"] for r in plan["rows"]]  # the plan's order: simulated by their means, then the screen's
    summary = plan["summary"]

    base = load_config(preset=args.preset, overrides=["record_timeline=false"])
    seeds = list(range(base.seed, base.seed + args.seeds))
    scored, dropped = screen(base, candidates(base, Space(args.gpus)))
    unique: dict = {}
    for s in scored:
        unique.setdefault(signature(s), Ranked(s))
    t = time.perf_counter()
    setups = list(unique.values())
    for seed in seeds:
        run_seed(setups, seed, workers=args.workers)
    exhaustive_s = time.perf_counter() - t
    step = {s.candidate.label: unique[signature(s)].mean("step_s") for s in scored}
    labels = sorted(step, key=step.get)
    best, winner = labels[0], summary["winner"]
    gap = step[winner] / step[best] - 1
    top = labels[:10]
    rho = float(stats.spearmanr([order.index(x) for x in top], np.arange(len(top))).statistic)
    rows = [[x, step[x], order.index(x) + 1] for x in top]
    result = dict(
        preset=args.preset,
        gpus=args.gpus,
        seeds=seeds,
        workers=args.workers,
        candidates=summary["candidates"],
        feasible=len(scored),
        dropped=len(dropped),
        simulations=summary["simulations"],
        plan_s=plan_s,
        exhaustive_simulations=len(setups) * len(seeds),
        exhaustive_s=exhaustive_s,
        winner=winner,
        winner_step_s=step[winner],
        best=best,
        best_step_s=step[best],
        gap=gap,
        spearman_top10=rho,
        best_rank_in_plan=order.index(best) + 1,
    )
    text = "\n".join(
        [
            f"{args.preset}, {args.gpus} GPUs, seeds {seeds}, {args.workers} workers: "
            f"{summary['candidates']} candidates "
            f"({len(dropped)} cannot run)",
            f"rlsched plan: {plan_s:.1f} s ({summary['simulations']} simulations); simulating every distinct feasible "
            f"setup: {exhaustive_s:.1f} s ({len(setups) * len(seeds)} simulations)",
            f"plan's winner {winner}: {step[winner]:.2f} s a step; exhaustive best {best}: {step[best]:.2f} s "
            f"({gap:+.2%})",
            f"Spearman of the plan's order over the exhaustive top 10: {rho:.3f}; the exhaustive best is #"
            f"{order.index(best) + 1} in the plan",
            "",
            "the exhaustive top 10",
            table(["setup", "step s (mean over seeds)", "rank in the plan"], rows),
        ]
    )
    print(text)
    write_result("plan_speed", dict(summary=result, rows=[dict(setup=x, step_s=step[x]) for x in labels]), text)


if __name__ == "__main__":
    main()
