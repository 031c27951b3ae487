"""What a simulation's samples, drafters, timeline rows, priced batches and instances cost in
memory and on disk, against the per-unit constants of rlsched/sim/sizes.py.

Every point is one `rlsched simulate --no-baseline` in a process of its own: its peak resident
memory (the ru_maxrss that wait4 reports for that child) and the bytes of the folder it writes.
Each cost is fitted between two points that differ in one size only (difference of the
measurements over difference of the units); the constant must be at least the measured cost,
as the estimate is an upper bound. Peak RSS moves by tens of MiB with where the allocator
happens to place a run's arrays, so each pair is far enough apart for the units to outweigh
that. A second table checks every point against its whole estimate: peak RSS within
WORKER_BYTES + the estimate (what check_fits reserves for a simulation in a worker process),
the folder within the disk estimate.

- samples: 1 drafter, 8 samples a prompt (one a prompt makes the simulation of a huge rollout
  slow, not bigger), 32-token responses, no timeline; samples A vs B at 1 and at 3 RL steps
  (SAMPLE_BYTES + steps x SAMPLE_STEP_BYTES, and the disk per sample-step);
- drafters: the same at 1 RL step, 1 vs 3 drafters (DRAFTER_SAMPLE_STEP_BYTES, DRAFTER_DISK_BYTES);
- timeline: one instance, max_batch 1, fixed responses short vs long (TIMELINE_ROW_BYTES,
  TIMELINE_DISK_BYTES; and sizes.timeline_rows against the rows written);
- grid: `--policy twostate` with cluster.max_batch 2^a vs 2^b (GRID_ROW_K_BYTES);
- instances: 64 one-sample prompts on N vs M instances (INSTANCE_BYTES);
- worker: the peak of a whole 8-prompt `simulate` (WORKER_BYTES).

Usage: python bench/sizes.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from _common import table, write_result

from rlsched.config import load_config
from rlsched.sim import sizes

SPP = 8  # samples a prompt in the sample and drafter points
SAMPLE_SET = [
    f"workload.samples_per_prompt={SPP}",
    "workload.response_len={dist: fixed, value: 32}",
    "record_timeline=false",
]
DRAFTER = "{name: %s, kind: model, model: qwen2.5-0.5b, acceptance: {mean: 0.7}}"
TIMELINE_SET = ["workload.samples_per_prompt=1", "cluster.instances=1", "cluster.max_batch=1", "rl.steps=1"]

# (full, quick) sizes of each pair of points
SIZES = {
    "samples": ((100_000, 1_000_000), (100_000, 400_000)),
    "drafter_samples": (1_000_000, 400_000),
    "timeline": ((1000, 3000, 30_000), (100, 3000, 30_000)),  # prompts, short and long response
    "grid_log2": ((20, 22), (18, 20)),
    "instances": ((1000, 10_000), (1000, 5000)),
}


class Point:
    """One `rlsched simulate` in its own process: peak RSS (bytes), folder bytes, timeline rows,
    and what rlsched.sim.sizes estimates of it."""

    def __init__(self, work: Path, name: str, overrides: list[str], policy: str | None = None):
        self.name, self.overrides = name, overrides
        out = work / name
        cmd = [sys.executable, "-m", "rlsched", "simulate", "--no-baseline", "--json", "--out", str(out)]
        cmd += ["--policy", policy] if policy else []
        for o in overrides:
            cmd += ["--set", o]
        t0 = time.perf_counter()
        with open(work / f"{name}.err", "w+") as err:
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
            if proc.returncode != 0:
                err.seek(0)
                sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}): {err.read().strip()[-2000:]}")
        self.seconds = time.perf_counter() - t0
        self.rss = usage.ru_maxrss * 1024  # KiB on Linux
        self.disk = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
        timeline = out / "timeline.parquet"
        self.rows = pq.ParquetFile(timeline).metadata.num_rows if timeline.exists() else 0
        self.estimate = sizes.estimate(load_config(overrides=overrides), policy)
        shutil.rmtree(out, ignore_errors=True)

    def data(self) -> dict:
        return {
            "overrides": self.overrides,
            "peak_rss": self.rss,
            "disk": self.disk,
            "timeline_rows": self.rows,
            "s": self.seconds,
            "estimate_memory": self.estimate.memory,
            "estimate_disk": self.estimate.disk,
            "estimate_timeline_rows": self.estimate.timeline_rows,
        }


class Bench:
    """The points simulated so far and the checks of the constants against them."""

    def __init__(self, work: Path):
        self.work = work
        self.points: dict[str, Point] = {}
        self.checks: list[dict] = []

    def point(self, name: str, overrides: list[str], policy: str | None = None) -> Point:
        p = self.points[name] = Point(self.work, name, overrides, policy)
        print(f"  {name}: {p.rss / 2**20:,.0f} MiB peak, {p.disk / 2**20:,.1f} MiB written ({p.seconds:.1f} s)")
        return p

    def check(self, name: str, constant: float, measured: float, unit: str, *points: Point) -> None:
        self.checks.append(
            {
                "constant": name,
                "value": constant,
                "measured": measured,
                "unit": unit,
                "points": [p.name for p in points],
                "ok": constant >= measured,
            }
        )

    def fit(self, name: str, constant: float, unit: str, a: Point, b: Point, units: tuple[float, float], what: str):
        """Check `constant` against (b - a) / (units_b - units_a) of the peak RSS or the disk."""
        measured = (getattr(b, what) - getattr(a, what)) / (units[1] - units[0])
        self.check(name, constant, measured, unit, a, b)


def samples_and_drafters(bench: Bench, quick: bool) -> None:
    lo, hi = SIZES["samples"][quick]
    for steps in (1, 3):
        a, b = (
            bench.point(f"samples-{n}-steps{steps}", [f"workload.prompts={n // SPP}", f"rl.steps={steps}", *SAMPLE_SET])
            for n in (lo, hi)
        )
        per_sample = sizes.SAMPLE_BYTES + steps * sizes.SAMPLE_STEP_BYTES
        bench.fit(f"SAMPLE_BYTES + {steps} x SAMPLE_STEP_BYTES", per_sample, "B a sample", a, b, (lo, hi), "rss")
        disk = sizes.SAMPLE_DISK_BYTES + sizes.DRAFTER_DISK_BYTES
        unit = f"B a sample-step, {steps} RL step{'s' if steps > 1 else ''}"
        bench.fit("SAMPLE_DISK_BYTES + DRAFTER_DISK_BYTES", disk, unit, a, b, (lo * steps, hi * steps), "disk")
    n = SIZES["drafter_samples"][quick]
    over = [f"workload.prompts={n // SPP}", "rl.steps=1", *SAMPLE_SET]
    a = bench.point("drafters-1", [*over, f"drafters=[{DRAFTER % 'a'}]"])
    b = bench.point("drafters-3", [*over, f"drafters=[{', '.join(DRAFTER % d for d in 'abc')}]"])
    units = (n, 3 * n)
    bench.fit("DRAFTER_SAMPLE_STEP_BYTES", sizes.DRAFTER_SAMPLE_STEP_BYTES, "B a drafter-sample", a, b, units, "rss")
    bench.fit("DRAFTER_DISK_BYTES", sizes.DRAFTER_DISK_BYTES, "B a drafter-sample-step", a, b, units, "disk")


def timeline_grid_instances(bench: Bench, quick: bool) -> None:
    prompts, short, long = SIZES["timeline"][quick]
    a, b = (
        bench.point(
            f"timeline-{prompts}x{n}",
            [f"workload.prompts={prompts}", f"workload.response_len={{dist: fixed, value: {n}}}", *TIMELINE_SET],
        )
        for n in (short, long)
    )
    bench.fit("TIMELINE_ROW_BYTES", sizes.TIMELINE_ROW_BYTES, "B a row", a, b, (a.rows, b.rows), "rss")
    bench.fit("TIMELINE_DISK_BYTES", sizes.TIMELINE_DISK_BYTES, "B a row", a, b, (a.rows, b.rows), "disk")
    for p in (a, b):
        bench.check("timeline_rows()", p.estimate.timeline_rows, p.rows, "rows", p)
    lo, hi = SIZES["grid_log2"][quick]
    k = load_config().speculation.k_max + 1
    a, b = (bench.point(f"grid-2^{e}", [f"cluster.max_batch={2**e}", "rl.steps=1"], "twostate") for e in (lo, hi))
    units = (2**lo * k, 2**hi * k)
    bench.fit("GRID_ROW_K_BYTES", sizes.GRID_ROW_K_BYTES, "B a batch row and k", a, b, units, "rss")
    lo, hi = SIZES["instances"][quick]
    over = ["workload.prompts=64", "workload.samples_per_prompt=1", "rl.steps=1"]
    a, b = (bench.point(f"instances-{n}", [*over, f"cluster.instances={n}"]) for n in (lo, hi))
    bench.fit("INSTANCE_BYTES", sizes.INSTANCE_BYTES, "B an instance-step", a, b, (lo, hi), "rss")
    w = bench.point("worker", ["workload.prompts=8", "rl.steps=1"])
    bench.check("WORKER_BYTES", sizes.WORKER_BYTES, w.rss, "B a process", w)


def bounds(bench: Bench) -> list[list]:
    """Every point against the whole estimate: peak RSS <= WORKER_BYTES + estimate (what
    check_fits reserves for a simulation in a worker process of its own), folder <= estimate."""
    rows = []
    for p in bench.points.values():
        memory = sizes.WORKER_BYTES + p.estimate.memory
        ok = p.rss <= memory and p.disk <= p.estimate.disk
        rows.append(
            [p.name, p.rss / 2**20, memory / 2**20, p.disk / 2**20, p.estimate.disk / 2**20, "PASS" if ok else "FAIL"]
        )
    return rows


def software() -> dict:
    """What the per-unit costs depend on besides the code: the interpreter, its array libraries
    and the memory of this machine."""
    try:
        with open("/proc/meminfo") as f:
            memory = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    except (OSError, StopIteration):
        memory = None
    return {
        "platform": platform.platform(),
        "memory_bytes": memory,
        "numpy": np.__version__,
        "pandas": pd.__version__,
        "pyarrow": pa.__version__,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run; writes no results)")
    args = ap.parse_args()
    t0 = time.time()
    bench = Bench(Path(tempfile.mkdtemp(prefix="rlsched-sizes-")))
    try:
        samples_and_drafters(bench, args.quick)
        timeline_grid_instances(bench, args.quick)
    finally:
        shutil.rmtree(bench.work, ignore_errors=True)
    rows = [
        [
            c["constant"],
            f"{c['value']:,.0f}",
            f"{c['measured']:,.1f}",
            c["unit"],
            " vs ".join(c["points"]),
            "PASS" if c["ok"] else "FAIL",
        ]
        for c in bench.checks
    ]
    t1 = table(["constant", "in sizes.py", "measured", "unit", "points", ""], rows)
    print("\nPer-unit peak memory (RSS) and disk of `rlsched simulate` against rlsched/sim/sizes.py\n" + t1)
    whole = bounds(bench)
    t2 = table(["point", "peak MiB", "WORKER_BYTES + estimate MiB", "written MiB", "estimate MiB", ""], whole)
    print("\nEach point against its whole estimate\n" + t2)
    print(f"\n({time.time() - t0:.1f} s)")
    ok = all(c["ok"] for c in bench.checks) and all(r[-1] == "PASS" for r in whole)
    if not args.quick:
        payload = {
            "software": software(),
            "checks": bench.checks,
            "points": {name: p.data() for name, p in bench.points.items()},
            "all_pass": ok,
        }
        path = write_result("sizes", payload, t1 + "\n\n" + t2)
        print(f"results: {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
