"""How well the planner's fluid screen ranks setups: every feasible candidate of a plan
(`plan/space.py`) priced by the screen and simulated, side by side.

Workload: a preset's first RL step (default respec-qwen2.5-7b on 16 GPUs: the planner's space
without reallocation: placements, tp x instances, batch limits, memory, off / static:K /
goodput over chains and over trees / twostate over its drafter). Reported:
the screen's seconds against the simulator's generation time (mean and worst error), Spearman
rank correlation over all candidates and over the simulator's top 10, and how far the
simulated time of the screen's pick is from the simulated best; and each side's wall time.

Run: python bench/plan_screen.py [--preset respec-qwen2.5-7b] [--gpus 16] [--seed 0].
Results: bench/results/plan_screen.{json,txt}.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from scipy import stats

sys.path.insert(0, str(Path(__file__).parent))
from _common import table, write_result  # noqa: E402

from rlsched.config import load_config  # noqa: E402
from rlsched.plan.screen import screen  # noqa: E402
from rlsched.plan.space import Space, candidates  # noqa: E402
from rlsched.sim.simulate import simulate  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="respec-qwen2.5-7b")
    ap.add_argument("--gpus", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    base = load_config(preset=args.preset, overrides=["rl.steps=1", "record_timeline=false", f"seed={args.seed}"])
    t = time.perf_counter()
    scored, dropped = screen(base, candidates(base, Space(args.gpus, reallocs=("none",))))
    screen_s = time.perf_counter() - t
    t = time.perf_counter()
    sim = np.array(
        [simulate(s.config, policy=s.candidate.policy, realloc="none").summary()["generation_s"] for s in scored]
    )
    sim_s = time.perf_counter() - t
    fluid = np.array([s.generation_s for s in scored])
    err = fluid / sim - 1
    top = np.argsort(sim)[:10]
    rho_all = float(stats.spearmanr(fluid, sim).statistic)
    rho_top = float(stats.spearmanr(fluid[top], sim[top]).statistic)
    pick = int(np.argmin(fluid))  # the screen's fastest generation stage
    gap = float(sim[pick] / sim.min() - 1)
    rows = [[scored[i].candidate.label, fluid[i], sim[i], err[i]] for i in top]
    summary = dict(
        preset=args.preset,
        gpus=args.gpus,
        seed=args.seed,
        candidates=len(scored) + len(dropped),
        feasible=len(scored),
        dropped=len(dropped),
        screen_s=screen_s,
        simulate_all_s=sim_s,
        mean_abs_error=float(np.mean(np.abs(err))),
        worst_error=float(err[np.argmax(np.abs(err))]),
        spearman_all=rho_all,
        spearman_top10=rho_top,
        pick_gap=gap,
        pick=scored[pick].candidate.label,
        best=scored[int(np.argmin(sim))].candidate.label,
    )
    text = "\n".join(
        [
            f"{args.preset}, {args.gpus} GPUs, seed {args.seed}: {summary['candidates']} candidates, "
            f"{len(dropped)} infeasible",
            f"screen {screen_s:.1f} s, simulating all {sim_s:.1f} s; "
            f"screen error mean {summary['mean_abs_error']:.2%}, "
            f"worst {summary['worst_error']:+.2%}",
            f"Spearman all {rho_all:.3f}, top 10 {rho_top:.3f}; the screen's pick {summary['pick']} is "
            f"{gap:.2%} slower (simulated) than the best, {summary['best']}",
            "",
            "the simulator's top 10",
            table(["candidate", "screen s", "simulated s", "error"], rows),
        ]
    )
    print(text)
    write_result(
        "plan_screen",
        dict(
            summary=summary,
            rows=[dict(candidate=s.candidate.label, screen_s=f, sim_s=x) for s, f, x in zip(scored, fluid, sim)],
        ),
        text,
    )


if __name__ == "__main__":
    main()
