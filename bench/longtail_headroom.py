"""How much an adaptive draft length can gain over the best static one, across the rollout
settings of the long-tail GRPO preset (H100, Qwen2.5-7B + 0.5B drafter, 8 instances).

An adaptive policy can gain over the best static k only where the oracle (true acceptance
and costs, per step) does: this bench measures the
oracle's and goodput's headroom over the best static k (chosen after the fact, per seed) as
the settings that shape the long tail vary:
- the engine's sequence limit: 256 (vLLM's default `max_num_seqs` on GPUs under 70 GB and on
  the A100) or 1024 (vLLM's default on the H100 and other >= 70 GB GPUs, verl's rollout
  default, and the preset's);
- the KV budget: gpu_memory_utilization 0.9 (vLLM's default, the preset's) or 0.5 (verl's
  rollout default, which shares the GPU with training);
- the response-length cap: 8k (the preset's) or 16k (long reasoning RL).

Usage: python bench/longtail_headroom.py [--seeds N] [--workers N]. Results:
bench/results/longtail_headroom.{json,txt}.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

from _common import table, write_result

from rlsched.config import load_config
from rlsched.sim import compare as cmp
from rlsched.sim.runs import run_jobs

POLICIES = "off,static:1,static:2,static:3,static:4,static:6,goodput,oracle"
GRID = {
    "cluster.max_batch": (256, 1024),
    "cluster.gpu_memory_utilization": (0.9, 0.5),
    "workload.response_len.max": (8192, 16384),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    t0 = time.time()
    rows, out = [], []
    for values in itertools.product(*GRID.values()):
        overrides = [f"{k}={v}" for k, v in zip(GRID, values)]
        cfg = load_config("longtail-grpo", overrides=overrides)
        plan = cmp.make_plan(cfg, POLICIES, "none", args.seeds, 1)
        report = cmp.aggregate(cfg, plan, run_jobs(cfg, plan.jobs(), args.workers))
        agg = {a["policy"]: a for a in report["aggregate"]}
        best = {b["seed"]: b["policy"] for b in report["best_static_per_seed"]}
        row = dict(
            settings=dict(zip(GRID, values)),
            oracle=agg["oracle"]["ratio_vs_best_static"],
            goodput=agg["goodput"]["ratio_vs_best_static"],
            off=agg["off"]["ratio_vs_best_static"],
            best_static=best,
            generation_s={p: a["generation_s"]["mean"] for p, a in agg.items()},
        )
        out.append(row)
        rows.append(
            [
                *values,
                "/".join(sorted(set(best.values()))),
                f"{row['off']['mean']:.3f}",
                f"{row['oracle']['mean']:.3f}",
                f"{row['oracle']['min']:.3f}-{row['oracle']['max']:.3f}",
                f"{row['goodput']['mean']:.3f}",
                f"{row['goodput']['min']:.3f}-{row['goodput']['max']:.3f}",
            ]
        )
        print(
            f"  {overrides}: oracle {row['oracle']['mean']:.3f}, goodput {row['goodput']['mean']:.3f} "
            f"({time.time() - t0:.0f} s)",
            file=sys.stderr,
            flush=True,
        )
    text = (
        f"longtail-grpo with overrides; x best static k per seed (seeds 1..{args.seeds}), mean and range\n\n"
        + table(
            [
                "max_batch",
                "gpu mem util",
                "max response",
                "best static",
                "off",
                "oracle",
                "oracle range",
                "goodput",
                "goodput range",
            ],
            rows,
        )
        + f"\n({time.time() - t0:.0f} s)"
    )
    print(text)
    write_result("longtail_headroom", dict(seeds=args.seeds, policies=POLICIES, rows=out), text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
