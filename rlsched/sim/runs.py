"""Simulations run side by side: each (policy, realloc, seed) job is one independent,
deterministic simulation, run here, in worker processes or on a Ray cluster, and returned as a
small dict (its summary and, if asked, one instance's batch/k trace). `compare`, the planner's
search and `learn` run their simulations through `run_jobs`.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from rlsched import __version__
from rlsched.config import SimConfig
from rlsched.distributed import check_cluster_address, import_ray
from rlsched.errors import UserError
from rlsched.policies.registry import PolicySpec
from rlsched.sim.sizes import check_fits, estimate, prices_grid


def default_workers() -> int:
    return os.cpu_count() or 1


# ----------------------------------------------------------------------------- one run (in a worker)


def run_one(
    cfg: SimConfig, policy: PolicySpec | str, realloc: str, seed: int, trace_instance: int | None = None
) -> dict:
    """Simulate one (policy, realloc, seed); return only small, picklable data: the summary and,
    if asked, the batch/k step trace of one instance in the first RL step (change points only)."""
    from rlsched.sim.simulate import simulate

    result = simulate(cfg.model_copy(update={"seed": seed}), policy, realloc)
    out = {
        "policy": result.policy,
        "realloc": realloc,
        "seed": seed,
        "version": __version__,
        "summary": result.summary(),
        "trace": None,
    }
    if trace_instance is not None and result.timeline.enabled and len(result.timeline):
        out["trace"] = _instance_trace(result.timeline.arrays(), trace_instance)
    return out


def _instance_trace(c: dict, instance: int) -> dict | None:
    import numpy as np

    from rlsched.sim.timeline import KIND_DECODE

    first_step = int(c["rl_step"].min())
    m = (c["instance"] == instance) & (c["rl_step"] == first_step) & (c["kind"] == KIND_DECODE)
    if not m.any():
        return None
    order = np.argsort(c["t_start"][m], kind="stable")
    t, b, k = c["t_start"][m][order], c["batch"][m][order], c["k"][m][order]
    end = float(t[-1] + c["draft_s"][m][order][-1] + c["verify_s"][m][order][-1])
    keep = np.ones(len(t), dtype=bool)
    keep[1:] = (b[1:] != b[:-1]) | (k[1:] != k[:-1])
    return {
        "instance": instance,
        "rl_step": first_step,
        "time_s": t[keep].tolist(),
        "batch": b[keep].astype(int).tolist(),
        "k": k[keep].astype(int).tolist(),
        "end_s": end,
    }


# ----------------------------------------------------------------------------- runners

Job = tuple["PolicySpec | str", str, int, "int | None"]  # (policy, realloc, seed, trace instance or None)


def run_jobs(
    cfg: SimConfig | list[SimConfig],
    jobs: list[Job],
    workers: int = 1,
    ray_address: str | None = None,
    on_done: Callable[[dict], None] | None = None,
) -> list[dict]:
    """Run every job on `cfg` (or on its own config: a list, one a job); results come back in
    the order of `jobs` whatever the order of completion. Runs this machine's memory cannot
    hold side by side are refused before any starts (`sim/sizes.py`; on Ray, each node checks
    its own)."""
    on_done = on_done or (lambda r: None)
    cfgs = cfg if isinstance(cfg, list) else [cfg] * len(jobs)
    if ray_address is None and jobs:
        check_jobs_fit(cfgs, jobs, 1 if workers <= 1 else min(workers, len(jobs)))
    if ray_address is not None:
        results = _run_ray(cfgs, jobs, ray_address, on_done)
    elif workers <= 1 or len(jobs) <= 1:
        results = []
        for c, job in zip(cfgs, jobs):
            results.append(run_one(c, *job))
            on_done(results[-1])
    else:
        results = _run_processes(cfgs, jobs, min(workers, len(jobs)), on_done)
    for r in results:
        if r["version"] != __version__:
            raise UserError(
                f"--ray: a worker runs rlsched {r['version']}, this machine {__version__}; "
                "install the same version on every node"
            )
    return results


def check_jobs_fit(cfgs: list[SimConfig], jobs: list[Job], workers: int) -> None:
    """Refuse jobs whose largest simulation, `workers` at a time (each in a worker process when
    more than one), does not fit in this machine's memory."""
    largest: dict[tuple[int, bool], tuple[float, SimConfig, PolicySpec | str]] = {}
    for c, (policy, *_) in zip(cfgs, jobs):
        key = (id(c), prices_grid(policy))
        if key not in largest:
            largest[key] = (estimate(c, policy).memory, c, policy)
    _, c, policy = max(largest.values(), key=lambda x: x[0])
    check_fits(c, policy=policy, workers=workers, processes=workers > 1)


def _run_processes(cfgs: list[SimConfig], jobs: list[Job], workers: int, on_done) -> list[dict]:
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, as_completed

    # forkserver: workers fork from a clean single-threaded server, never from this process
    # (which may hold threads: the progress bar, BLAS); fork would risk deadlocks.
    methods = mp.get_all_start_methods()
    ctx = mp.get_context("forkserver" if "forkserver" in methods else "spawn")
    if ctx.get_start_method() == "forkserver":
        ctx.set_forkserver_preload(["rlsched.sim.runs", "rlsched.sim.simulate"])
    results: list[dict | None] = [None] * len(jobs)
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_ignore_sigint)
    try:
        futures = {pool.submit(run_one, cfgs[i], *job): i for i, job in enumerate(jobs)}
        for fut in as_completed(futures):
            results[futures[fut]] = fut.result()
            on_done(results[futures[fut]])
    except BaseException:
        # Ctrl-C or a failed run: drop the queue and stop the workers now rather than finish their runs
        procs = list((getattr(pool, "_processes", None) or {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        for p in procs:
            p.terminate()
        raise
    pool.shutdown(wait=True)
    return results  # type: ignore[return-value]


def _ignore_sigint() -> None:
    """Workers leave Ctrl-C to the parent, which stops them (no traceback from each worker)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _run_ray(cfgs: list[SimConfig], jobs: list[Job], address: str, on_done) -> list[dict]:
    ray = import_ray("--ray")
    started = not ray.is_initialized()
    if started:
        check_cluster_address(address, "--ray")  # a dead address: one line now, not minutes of retries
        try:
            # 'local' starts a private Ray on this machine; anything else joins an existing cluster
            ray.init(
                address=None if address == "local" else address,
                ignore_reinit_error=True,
                log_to_driver=False,
                include_dashboard=False,
            )
        except Exception as e:  # noqa: BLE001 - Ray raises several types for a bad address
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise UserError(f"--ray {address}: cannot connect to a Ray cluster: {first}") from None
    try:
        remote = ray.remote(num_cpus=1)(run_one)
        put: dict[int, object] = {}  # one object a distinct config
        refs = []
        for c, job in zip(cfgs, jobs):
            if id(c) not in put:
                put[id(c)] = ray.put(c)
            refs.append(remote.remote(put[id(c)], *job))
        index = {ref: i for i, ref in enumerate(refs)}
        results: list[dict | None] = [None] * len(jobs)
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            for ref in done:
                results[index[ref]] = ray.get(ref)
                on_done(results[index[ref]])
        return results  # type: ignore[return-value]
    finally:
        if started:
            ray.shutdown()
