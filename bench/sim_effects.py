"""The published effects of speculative decoding, reproduced by the simulator.

1. ReSpec's gap 1: on H100 with Qwen2.5-7B and a Qwen2.5-0.5B drafter at acceptance 0.7,
   the speedup of static k over plain decoding by batch size: large at small batch, shrinking,
   then below 1.0 at large batch (preset sd-batch-sweep).
2. RLHFSpec's rule: on a long-tail GRPO rollout (preset longtail-grpo: 512 prompts x 16
   samples, 8 instances, lognormal lengths up to 8k, up to 1024 sequences per instance),
   `goodput` against `off` and every static k, on several seeds.

Usage: python bench/sim_effects.py [--seeds N] [--quick] [--engine vllm] [--set KEY=VALUE ...]
(`--engine vllm` runs both under the model of vLLM V1's scheduler, `engine.kind=vllm`, and writes
sim_effects_vllm; other `--set` overrides need `--name` for their result file.)
"""

from __future__ import annotations

import argparse
import sys
import time

from _common import table, write_result

from rlsched.config import load_config
from rlsched.sim.simulate import simulate

BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
KS = [1, 2, 4, 6, 8]


def batch_sweep(extra: list[str]) -> tuple[list[list], dict]:
    rows, data = [], {}
    for b in BATCHES:
        cfg = load_config("sd-batch-sweep", overrides=[f"workload.prompts={b}", f"cluster.max_batch={b}", *extra])
        off = simulate(cfg, "off").summary()["generation_s"]
        speedups = {k: off / simulate(cfg, f"static:{k}").summary()["generation_s"] for k in KS}
        good = off / simulate(cfg, "goodput").summary()["generation_s"]
        rows.append([b, *speedups.values(), good])
        data[b] = {"off_s": off, **{f"static:{k}": v for k, v in speedups.items()}, "goodput": good}
    return rows, data


def long_tail(seeds: int, prompts: int | None, extra: list[str]) -> tuple[list[list], dict]:
    policies = ["off", *[f"static:{k}" for k in KS], "goodput"]
    rows, data = [], {}
    for seed in range(seeds):
        over = [f"seed={seed}"] + ([f"workload.prompts={prompts}"] if prompts else []) + extra
        cfg = load_config("longtail-grpo", overrides=over)
        times = {p: simulate(cfg, p).summary()["generation_s"] for p in policies}
        best_static = min((times[p], p) for p in policies if p.startswith("static"))
        rows.append(
            [
                seed,
                times["off"],
                best_static[1],
                best_static[0],
                times["goodput"],
                times["off"] / times["goodput"],
                best_static[0] / times["goodput"],
            ]
        )
        data[seed] = {
            "generation_s": times,
            "best_static": best_static[1],
            "goodput_vs_off": times["off"] / times["goodput"],
            "goodput_vs_best_static": best_static[0] / times["goodput"],
        }
    return rows, data


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="a quarter of the long-tail prompts (smoke run)")
    ap.add_argument("--engine", choices=("rlsched", "vllm"), default="rlsched", help="engine.kind")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override, repeatable")
    ap.add_argument("--name", help="the result file's name (default sim_effects, sim_effects_vllm)")
    args = ap.parse_args()
    if args.set and not args.name:
        ap.error("--set needs --name, so that the default results are kept")
    extra = [*args.set, f"engine.kind={args.engine}"]
    name = args.name or ("sim_effects" if args.engine == "rlsched" else f"sim_effects_{args.engine}")
    t0 = time.time()
    rows, sweep = batch_sweep(extra)
    t1 = table(["batch", *[f"k={k}" for k in KS], "goodput"], rows)
    print("Speedup over plain decoding (off), H100, Qwen2.5-7B + Qwen2.5-0.5B drafter, acceptance 0.7\n" + t1)
    rows, tail = long_tail(args.seeds, 128 if args.quick else None, extra)
    t2 = table(["seed", "off s", "best static", "its s", "goodput s", "vs off", "vs best static"], rows)
    print("\nLong-tail GRPO rollout (longtail-grpo): generation-stage time\n" + t2)
    checks = {
        "best_static_above_1.3x_at_batch_1_to_8": all(
            max(sweep[b][f"static:{k}"] for k in KS) > 1.3 for b in (1, 2, 4, 8)
        ),
        "k4_falls_with_batch": all(sweep[a]["static:4"] >= sweep[b]["static:4"] for a, b in zip(BATCHES, BATCHES[1:])),
        "k4_below_1x_at_batch_256_up": all(sweep[b]["static:4"] < 1.0 for b in BATCHES if b >= 256),
        "k8_below_1x_at_batch_128_up": all(sweep[b]["static:8"] < 1.0 for b in BATCHES if b >= 128),
        "goodput_beats_off_every_seed": all(d["goodput_vs_off"] > 1.0 for d in tail.values()),
        "goodput_within_2pct_of_best_static_every_seed": all(d["goodput_vs_best_static"] > 0.98 for d in tail.values()),
    }
    print("\n" + "\n".join(f"{'PASS' if ok else 'FAIL'}  {name}" for name, ok in checks.items()))
    print(f"\n({time.time() - t0:.1f} s)")
    if not args.quick:
        path = write_result(
            name,
            {"overrides": extra, "batch_sweep": sweep, "long_tail": tail, "checks": checks},
            t1 + "\n\n" + t2 + "\n\n" + "\n".join(f"{k}: {v}" for k, v in checks.items()),
        )
        print(f"results: {path}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
