"""How big a simulation is before it runs, from its config alone, and whether this machine holds it.

A simulation's memory grows with its samples (`workload.prompts` x `workload.samples_per_prompt`,
kept for every one of `rl.steps` RL steps for the tables), with its timeline (one row per engine
step, when `record_timeline` is on), with the batch sizes a policy prices up front (the solved
two-state rule and the learner price every batch up to `cluster.max_batch`) and with its
instances. The folder `simulate` writes grows with the same samples and timeline rows.

`check_fits` compares the estimate, times the simulations running side by side, with the memory
this machine has available (and the free space where the folder goes) and refuses with one line
before any work when it does not fit. The per-unit costs below are peak resident memory of
`rlsched simulate` (the `ru_maxrss` of the command), fitted between runs that differ in one size
only; `bench/sizes.py` measures them and checks each constant against its measurement.
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
import shutil
from dataclasses import dataclass
from pathlib import Path

from rlsched.config import EmpiricalLength, FixedLength, LengthDist, SimConfig
from rlsched.errors import UserError
from rlsched.policies.registry import PolicySpec, as_spec

# --- memory (bytes) ---------------------------------------------------------------------------------
# Each is the peak resident memory of `rlsched simulate` a unit adds, fitted between two runs that
# differ in that size only, rounded up to an upper bound; measured by bench/sizes.py
# (docs/benchmarks.md, Simulation sizes).
# Per sample of a rollout (SAMPLE_BYTES) and per sample and RL step (SAMPLE_STEP_BYTES): its rollout
# and generation-stage arrays, kept for the tables, the samples table and its Arrow copy.
SAMPLE_BYTES = 100
SAMPLE_STEP_BYTES = 340
# Per further drafter, sample and RL step: its acceptance, taken-in context and log-acceptance
# columns and its column of the samples table.
DRAFTER_SAMPLE_STEP_BYTES = 96
# Per timeline row (engine step): packed columns, their joined arrays, the timeline frame and its
# Arrow table.
TIMELINE_ROW_BYTES = 360
# Per row of the largest batch priced up front (the largest power of two <= cluster.max_batch)
# and per draft length 0..k_max: the expected-tokens table of that batch.
GRID_ROW_K_BYTES = 9
# Per instance and RL step: the instance, its policy, random stream and queues.
INSTANCE_BYTES = 8 * 1024
# A worker process of `run_jobs` before it simulates: the interpreter with numpy, pandas and SimPy
# (bounded by the whole peak of a `simulate` of a few prompts).
WORKER_BYTES = 160 * 1024**2

# --- disk (bytes written by `simulate`) -----------------------------------------------------------
# The folder's bytes a unit adds, fitted and rounded up as above (bench/sizes.py).
# samples.parquet per sample and RL step, plus a column a drafter
SAMPLE_DISK_BYTES = 32
DRAFTER_DISK_BYTES = 16
# timeline.parquet per row
TIMELINE_DISK_BYTES = 32


@dataclass(frozen=True)
class SizeEstimate:
    """One simulation's size: its samples a step, timeline rows, peak memory and what it writes."""

    samples: int  # a rollout's samples (one RL step)
    timeline_rows: int  # 0 without a timeline
    memory: float  # bytes, peak, of one simulation
    timeline_memory: float  # bytes of `memory` that the timeline takes
    grid_memory: float  # bytes of `memory` that pricing batches up to cluster.max_batch takes
    disk: float  # bytes of the folder `simulate` writes


def length_stats(d: LengthDist) -> tuple[float, int]:
    """(mean, longest) of a length distribution; a lognormal's mean uncut (an upper bound)."""
    if isinstance(d, FixedLength):
        return float(d.value), d.value
    if isinstance(d, EmpiricalLength):
        values = [min(v, d.max) for v in d.values] if d.max else d.values
        return sum(values) / len(values), max(values)
    mean = d.median * math.exp(min((d.sigma**2 + d.group_sigma**2) / 2, 700.0))
    return min(mean, float(d.max)), d.max


def timeline_rows(cfg: SimConfig, prompts: int | None = None) -> int:
    """Engine steps the timeline records (0 when it is off), an upper bound: each busy instance
    decodes its rows' tokens at its batch limit (one token a row a step, no drafts), then the
    longest response alone, or its rows one at a time where that is fewer steps; at most one
    prefill a row and a decode step."""
    if not cfg.record_timeline:
        return 0
    w, c = cfg.workload, cfg.cluster
    p = w.prompts if prompts is None else prompts
    if c.assignment == "round_robin":
        rows, busy = math.ceil(p * w.samples_per_prompt / c.instances), min(c.instances, p * w.samples_per_prompt)
    else:
        rows, busy = math.ceil(p / c.instances) * w.samples_per_prompt, min(c.instances, p)
    mean, longest = length_stats(w.response_len)
    decode = min(rows * mean / min(c.max_batch, rows) + longest, rows * mean)
    return int((decode + min(rows, decode)) * busy * cfg.rl.steps)


def prices_grid(policy: PolicySpec | str) -> bool:
    """Whether building the policy prices every batch up to cluster.max_batch (the solved
    two-state rule)."""
    spec = as_spec(policy)
    return spec.family == "twostate" and spec.max_batch is None and spec.file is None


def estimate(
    cfg: SimConfig, policy: PolicySpec | str | None = None, grid: bool | None = None, prompts: int | None = None
) -> SizeEstimate:
    """The size of simulating `cfg` under `policy` (default: the config's); `grid` whether
    batches up to cluster.max_batch are priced up front (default: as the policy does);
    `prompts` in place of the config's."""
    w, steps = cfg.workload, cfg.rl.steps
    p = w.prompts if prompts is None else prompts
    samples = p * w.samples_per_prompt
    drafters = len(cfg.drafters)
    rows = timeline_rows(cfg, p)
    if grid is None:
        grid = prices_grid(policy if policy is not None else cfg.speculation.policy)
    grid_batch = 2 ** (cfg.cluster.max_batch.bit_length() - 1)
    grid_mem = float(grid_batch * (cfg.speculation.k_max + 1) * GRID_ROW_K_BYTES) if grid else 0.0
    timeline_mem = float(rows * TIMELINE_ROW_BYTES)
    per_sample = SAMPLE_BYTES + steps * (SAMPLE_STEP_BYTES + max(0, drafters - 1) * DRAFTER_SAMPLE_STEP_BYTES)
    instances_mem = float(cfg.cluster.instances * steps) * INSTANCE_BYTES
    memory = float(samples) * per_sample + timeline_mem + grid_mem + instances_mem
    disk = float(samples) * steps * (SAMPLE_DISK_BYTES + drafters * DRAFTER_DISK_BYTES) + rows * TIMELINE_DISK_BYTES
    return SizeEstimate(samples, rows, memory, timeline_mem, grid_mem, disk)


# ----------------------------------------------------------------------------- this machine


def available_memory() -> int | None:
    """Bytes this process may still allocate: the least of the kernel's MemAvailable, the
    cgroup's limit less its use, and the address-space limit (ulimit -v) less what this process
    maps; None where none of them can be read."""
    found: list[int] = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    except OSError:
        with contextlib.suppress(ValueError, OSError, AttributeError):
            found.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            found.append(int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text()))
    except (OSError, ValueError):
        pass
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        found.append(soft - _mapped_bytes())
    return max(0, min(found)) if found else None


def _mapped_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def free_disk(path: Path) -> int | None:
    """Free bytes on the file system `path` will be written to (its nearest existing ancestor's)."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def human(n: float) -> str:
    """Bytes as B, KiB, ... EiB (1 decimal); beyond, in EiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:,.1f} EiB"


# ----------------------------------------------------------------------------- the check


def check_fits(
    cfg: SimConfig,
    *,
    policy: PolicySpec | str | None = None,
    grid: bool | None = None,
    workers: int = 1,
    processes: bool = False,
    out: Path | None = None,
    available: int | None = None,
    disk_free: int | None = None,
) -> SizeEstimate:
    """Refuse (one UserError line: the estimate, what this machine has, how to run it anyway)
    a simulation of `cfg` that does not fit, before any work: `workers` of them side by side (in
    worker processes of their own when `processes`) in the memory available (`available`,
    default: this machine's), and, with `out`, its folder in the free space there (`disk_free`,
    default: that file system's). Returns the estimate of one simulation."""
    est = estimate(cfg, policy, grid)
    have = available_memory() if available is None else available
    base = WORKER_BYTES if processes else 0.0
    need = workers * (est.memory + base)
    if have is not None and need > have:
        raise UserError(_memory_message(cfg, est, workers, base, have))
    if out is not None:
        free = free_disk(out) if disk_free is None else disk_free
        if free is not None and est.disk > free:
            timeline = human(est.timeline_rows * TIMELINE_DISK_BYTES)
            raise UserError(
                f"{_sizes(cfg)} the run writes about {human(est.disk)} to '{out}'"
                + (f" ({timeline} of it the timeline)" if est.timeline_rows else "")
                + f" and its file system has {human(free)} free; "
                + (_fixes(cfg, est, lambda e: e.disk, free) or "write it to a larger file system (--out)")
            )
    return est


def _sizes(cfg: SimConfig) -> str:
    w = cfg.workload
    return (
        f"workload.prompts {w.prompts:,} x workload.samples_per_prompt {w.samples_per_prompt:,} "
        f"x rl.steps {cfg.rl.steps:,}:"
    )


def _memory_message(cfg: SimConfig, est: SizeEstimate, workers: int, base: float, have: int) -> str:
    parts = []
    if est.timeline_memory:
        parts.append(f"{human(est.timeline_memory)} of it the timeline of about {est.timeline_rows:.2g} engine steps")
    if est.grid_memory:
        parts.append(
            f"{human(est.grid_memory)} of it pricing every batch up to cluster.max_batch {cfg.cluster.max_batch:,}"
        )
    of_it = f" ({'; '.join(parts)})" if parts else ""
    side = f" each, {workers} side by side," if workers > 1 else ""
    fixes = []
    if workers > 1:
        fit = int(have // (est.memory + base))
        if fit >= 1:
            fixes.append(f"run {fit} at a time (--workers {fit})")
    if est.grid_memory and workers * (est.memory - est.grid_memory + base) <= have:
        fixes.append("lower cluster.max_batch (or give the policy its threshold, as in twostate:32:4)")
    fixes.append(_fixes(cfg, est, lambda e: workers * (e.memory + base), have))
    fixes = [f for f in fixes if f] or ["lower workload.prompts, workload.samples_per_prompt or rl.steps"]
    return (
        f"{_sizes(cfg)} simulating it needs about {human(est.memory)} of memory{of_it}{side} and this machine "
        f"has {human(have)} available; {', or '.join(fixes)}"
    )


def _fixes(cfg: SimConfig, est: SizeEstimate, need, have: float) -> str:
    """How to make it fit: without the timeline where that is enough, and the prompts that fit
    (with the timeline and without)."""
    grid = est.grid_memory > 0
    most = _prompts_that_fit(cfg, grid, need, have)
    if not est.timeline_rows:
        return f"lower workload.prompts (about {most:,} fit)" if most else ""
    lean_cfg = cfg.model_copy(update={"record_timeline": False})
    if need(estimate(lean_cfg, grid=grid)) <= have:
        return "add --set record_timeline=false" + (f", or lower workload.prompts (about {most:,} fit)" if most else "")
    lean = _prompts_that_fit(lean_cfg, grid, need, have)
    if not lean:
        return ""
    fit = f"about {most:,} fit; " if most else ""
    return f"lower workload.prompts ({fit}about {lean:,} with --set record_timeline=false)"


def _prompts_that_fit(cfg: SimConfig, grid: bool, need, have: float) -> int:
    """The most prompts whose estimate fits, 0 for none (sizes grow with prompts: bisected)."""
    if need(estimate(cfg, grid=grid, prompts=1)) > have:
        return 0
    lo, hi = 1, cfg.workload.prompts
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if need(estimate(cfg, grid=grid, prompts=mid)) <= have:
            lo = mid
        else:
            hi = mid
    return lo
