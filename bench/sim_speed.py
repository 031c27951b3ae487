"""How fast the simulator runs, on one core (pinned), each scenario in a fresh process.

- engine steps simulated per second (longtail-grpo: 8 instances, 8,192 samples), per policy,
  on rlsched's engine and on the model of vLLM V1's scheduler (`engine.kind=vllm`);
- a 64-instance, 8,192-sample, up-to-16k-token generation stage: wall time and peak memory
  (targets: <= 10 s, < 1 GiB; >= 50,000 engine steps/s);
- a 1,024-instance, 131,072-sample stage, far beyond one machine: its time and memory.

Usage: python bench/sim_speed.py [--skip-huge]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

LONG = ["workload.response_len.median=2000", "workload.response_len.max=16384"]
SCENARIOS = {
    "longtail-8x8192": ("longtail-grpo", []),
    "longtail-8x8192-vllm": ("longtail-grpo", ["engine.kind=vllm"]),
    "cluster-64x8192-16k": ("longtail-grpo", ["cluster.instances=64", *LONG]),
    "cluster-1024x131072-16k": ("longtail-grpo", ["cluster.instances=1024", "workload.prompts=8192", *LONG]),
}


def run_one(name: str, policy: str) -> dict:
    """In this (child) process: pin to one core, simulate, report time, steps and peak RSS."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    from rlsched.config import load_config
    from rlsched.sim.simulate import simulate

    preset, over = SCENARIOS[name]
    cfg = load_config(preset, overrides=over)
    t0, c0 = time.perf_counter(), time.process_time()
    res = simulate(cfg, policy)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    s = res.summary()
    return {
        "scenario": name,
        "policy": policy,
        "instances": cfg.cluster.instances,
        "samples": s["samples_per_step"],
        "engine_steps": s["engine_steps"],
        "wall_s": wall,
        "cpu_s": cpu,
        "steps_per_s": s["engine_steps"] / cpu,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "generation_s_simulated": s["generation_s"],
    }


def child(name: str, policy: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--one", name, policy], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--one", nargs=2, metavar=("SCENARIO", "POLICY"), help=argparse.SUPPRESS)
    ap.add_argument("--skip-huge", action="store_true", help="skip the 1,024-instance stage")
    args = ap.parse_args()
    if args.one:
        print(json.dumps(run_one(*args.one)))
        return 0
    sys.path.insert(0, os.path.dirname(__file__))
    from _common import table, write_result

    plan = [(s, p) for s in ("longtail-8x8192", "longtail-8x8192-vllm") for p in ("off", "static:4", "goodput")]
    plan += [("cluster-64x8192-16k", p) for p in ("off", "static:4", "goodput")]
    if not args.skip_huge:
        plan.append(("cluster-1024x131072-16k", "goodput"))
    results = []
    for name, policy in plan:
        r = child(name, policy)
        results.append(r)
        print(
            f"{name:26s} {policy:9s} {r['engine_steps']:>10,d} steps  {r['wall_s']:7.2f} s  "
            f"{r['steps_per_s']:>9,.0f} steps/s  {r['peak_rss_mib']:7.0f} MiB",
            file=sys.stderr,
        )
    rows = [
        [
            r["scenario"],
            r["policy"],
            r["instances"],
            r["samples"],
            r["engine_steps"],
            r["wall_s"],
            round(r["steps_per_s"]),
            round(r["peak_rss_mib"]),
        ]
        for r in results
    ]
    text = table(
        ["scenario", "policy", "instances", "samples", "engine steps", "wall s", "steps/s (1 core)", "peak MiB"], rows
    )
    print(text)
    big = [r for r in results if r["scenario"] == "cluster-64x8192-16k"]
    checks = {
        "64x8192_stage_at_most_10s_all_policies": all(r["wall_s"] <= 10 for r in big),
        "64x8192_peak_under_1GiB": all(r["peak_rss_mib"] < 1024 for r in big),
        "at_least_50k_steps_per_s_all_policies": all(r["steps_per_s"] >= 50_000 for r in big),
    }
    print("\n" + "\n".join(f"{'PASS' if ok else 'FAIL'}  {k}" for k, ok in checks.items()))
    path = write_result(
        "sim_speed",
        {"results": results, "checks": checks},
        text + "\n\n" + "\n".join(f"{k}: {v}" for k, v in checks.items()),
    )
    print(f"results: {path}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
