"""Live sample reallocation on two real rollout instances (Ray actors), beside the simulator.

Workload: the built-in pair, PROMPTS prompts x G samples of the built-in tasks, each prompt
with a long-tailed token budget (lognormal; its samples vary around it; no eos, so a sample
runs to its budget): the long-tail rollout RL sees. Prompts are assigned round-robin to two
instances (a prompt's samples stay together), so the loads are uneven. Each instance: its own
Ray worker process, 1 thread, max_batch rows, static:K speculative decoding with the model
drafter.

Measured side by side: `none` and `rebalance` alternate on the same pool (the same two
processes), REPS times each; the generation-stage time is the wall time of the rollout. The
same rollouts run on rlsched's engines (`local`: a moved sample ships its KV rows or is
re-prefilled, whichever is priced cheaper) and on vLLM's (`vllm`: a moved sample is aborted
and resubmitted with prompt + partial response; needs vLLM, e.g. .venv-vllm/bin/python).
Predicted: the simulator runs the same rollout (every sample's prompt and response length and
its own measured acceptance) on two instances with each policy, its step costs fitted from
the `none` runs' own step records (as `rlsched replay` does, with the per-step overhead), KV
transfers priced by the link the pool measured.

Run: python bench/realloc.py [--reps 7] [--median 64] [--prompts 8] [--group 16] [--max-batch 16] [--seed 0]
     [--backends local,vllm] (default: local, and vllm where it is importable)
Results: bench/results/realloc.{json,txt}.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).parent))
from _common import table, write_result  # noqa: E402


def workload(tokenizer, prompts: int, group: int, seed: int, median: int, sigma: float, cap: int):
    from rlsched.executor.engine.rows import Request
    from rlsched.tasks.synthetic import make_examples

    rng = np.random.default_rng(seed)
    out = []
    for p, e in enumerate(make_examples(prompts, seed=seed)):
        ids = tokenizer.encode(e.prompt, add_special_tokens=False).ids
        base = float(np.exp(rng.normal(np.log(median), sigma)))
        for _ in range(group):
            budget = int(np.clip(round(base * rng.uniform(0.7, 1.3)), 4, cap))
            out.append(Request(ids, p, len(out), budget, None))
    return out


def simulate(
    samples: pd.DataFrame, steps: pd.DataFrame, work: Path, args, link, share_prompts: bool
) -> dict[str, float]:
    """Predicted generation-stage seconds of this rollout on two instances, per realloc policy:
    `rlsched replay`'s simulation (costs fitted from the traces' own steps, calibrated, plus
    the per-step overhead), with the KV link the pool measured and the pool's prefill sharing
    (a prompt's samples prefilled once, as the pool's engines do)."""
    from rlsched.analysis.replay import _AsRun, _costs, _rollout, _simulate, step_overhead_s

    cost, _, policy_cost, factors = _costs(work, None, "model")
    sim_cost = _AsRun(cost, step_overhead_s(steps), factors)
    sim_cost.kv_transfer_time = link.kv_transfer_time  # instances on one host
    rollout = _rollout(samples, "model")
    out = {}
    for name in ("none", "rebalance"):
        run_cfg = {
            "rollout": dict(
                max_batch=args.max_batch,
                k_max=args.k,
                max_tokens=args.cap,
                instances=2,
                realloc=name,
                realloc_threshold=args.threshold,
                share_prompts=share_prompts,
            )
        }
        out[name] = _simulate([rollout], f"static:{args.k}", "model", sim_cost, policy_cost, run_cfg, args.seed)[0]
    return out


def measure(pool, requests, reps: int, label: str) -> tuple[dict, dict]:
    """`none` and `rebalance` alternating on one pool after a warm-up rollout (rl_step 0):
    per policy the rollouts' seconds and stats."""
    from rlsched.policies.realloc import make_realloc_policy

    measured: dict[str, list[float]] = {"none": [], "rebalance": []}
    stats: dict[str, list[dict]] = {"none": [], "rebalance": []}
    pool.rl_step = 0
    pool.realloc = make_realloc_policy("none")
    pool.run(requests)  # warm-up (traces kept: rl_step 0)
    for rep in range(reps):
        for j, name in enumerate(("none", "rebalance") if rep % 2 == 0 else ("rebalance", "none")):
            pool.rl_step = 1 + 2 * rep + j
            pool.realloc = make_realloc_policy(name)
            res = pool.run(requests)
            measured[name].append(res.stats["seconds"])
            stats[name].append({**res.stats, "rl_step": pool.rl_step})
            print(
                f"{label} rep {rep} {name:9s} {res.stats['seconds']:.2f} s, migrated {res.stats['migrated']} "
                f"(kv {res.stats['migrated_kv']}), finish {res.stats['instance_finish_s']}",
                flush=True,
            )
    return measured, stats


def main() -> None:
    import importlib.util

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=16)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--median", type=int, default=64, help="median token budget of a prompt")
    ap.add_argument("--sigma", type=float, default=1.0, help="lognormal spread of the prompts' budgets")
    ap.add_argument("--cap", type=int, default=200, help="longest budget (the built-in pair holds 256 positions)")
    ap.add_argument("--k", type=int, default=3, help="static draft length")
    ap.add_argument("--threshold", type=int, default=8, help="realloc threshold (load below it: drained)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backends", default="local,vllm" if importlib.util.find_spec("vllm") else "local")
    ap.add_argument("--work", type=Path, default=None)
    args = ap.parse_args()

    from rlsched.costs.measured import MeasuredCostModel
    from rlsched.executor.decode.sampling import SamplingParams
    from rlsched.executor.model.builtin import builtin_pair
    from rlsched.executor.model.loading import load_model
    from rlsched.executor.pool.instances import InstancePool, InstanceSpec
    from rlsched.executor.profiler import policy_profile
    from rlsched.traces.reader import read_trace

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    pair = builtin_pair()
    target = load_model(pair.target)
    sampling = SamplingParams(temperature=1.0)
    requests = workload(target.tokenizer, args.prompts, args.group, args.seed, args.median, args.sigma, args.cap)
    longest = max(len(r.prompt) for r in requests) + args.cap
    base = MeasuredCostModel(
        policy_profile(
            target.model, None, policy="off", max_batch=args.max_batch, k_max=args.k, typical_ctx=40, sampling=sampling
        )
    )
    measured, stats, predicted, link = {}, {}, {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for backend in backends:
            work = (args.work or Path(tmp)) / backend
            spec = InstanceSpec(
                str(pair.target),
                "model",
                str(pair.drafter),
                sampling,
                f"static:{args.k}",
                args.max_batch * longest,
                args.max_batch,
                args.k,
                longest + 2 * args.k + 8,
                trace_dir=str(work / "traces"),
                threads=1,
                backend=backend,
                max_len=longest + args.k + 1,
                seed=args.seed,
            )
            # vLLM's pool prices moves by step costs its first instance measures
            pool = InstancePool(
                2,
                spec,
                realloc="rebalance",
                threshold=args.threshold,
                cost=base if backend == "local" else None,
                seed=args.seed,
            )
            try:
                measured[backend], stats[backend] = measure(pool, requests, args.reps, backend)
            finally:
                pool.close()
            link[backend] = dict(latency_s=pool.cost.latency_s, bytes_per_s=pool.cost.bytes_per_s)
            if backend == "local":  # the simulator replays rlsched's engine (vLLM's moves ship no KV)
                steps, samples = read_trace(work / "traces", "steps"), read_trace(work / "traces", "samples")
                none_steps = [s["rl_step"] for s in stats[backend]["none"]]
                first = samples[samples["rl_step"] == none_steps[0]]
                predicted[backend] = simulate(
                    first, steps[steps["rl_step"].isin(none_steps)], work, args, pool.cost, spec.share_prompts
                )

    rows, cuts, lines = [], {}, []
    for backend in backends:
        m = measured[backend]
        med = {k: float(np.median(v)) for k, v in m.items()}
        best = {k: float(np.min(v)) for k, v in m.items()}
        paired = 1 - np.array(m["rebalance"]) / np.array(m["none"])  # rep by rep, run back to back
        pred = predicted.get(backend)
        cuts[backend] = dict(
            measured_median=med,
            cut_measured=1 - med["rebalance"] / med["none"],
            cut_min=1 - best["rebalance"] / best["none"],
            cut_paired=paired.tolist(),
            cut_paired_mean=float(paired.mean()),
            cut_predicted=None if pred is None else 1 - pred["rebalance"] / pred["none"],
        )
        for name in ("none", "rebalance"):
            rows.append(
                [
                    backend,
                    name,
                    med[name],
                    best[name],
                    "-" if pred is None else pred[name],
                    float(np.mean([s["migrated"] for s in stats[backend][name]])),
                ]
            )
        c = cuts[backend]
        sim = "" if pred is None else f"; the simulator predicts {c['cut_predicted']:.1%}"
        lines.append(
            f"{backend}: rebalance cuts the generation stage by {c['cut_measured']:.1%} measured (median "
            f"of {args.reps}), {c['cut_min']:.1%} (min), {paired.mean():.1%} as the mean of the reps' "
            f"back-to-back pairs ({paired.min():.1%} to {paired.max():.1%}){sim}"
        )
    text = table(["backend", "realloc", "measured median s", "measured min s", "simulated s", "migrated"], rows)
    text += "\n\n" + "\n".join(lines)
    print(text)
    write_result(
        "realloc",
        dict(
            args={k: str(v) for k, v in vars(args).items()},
            measured=measured,
            predicted=predicted,
            cuts=cuts,
            samples=len(requests),
            stats=stats,
            link=link,
        ),
        text,
    )


if __name__ == "__main__":
    main()
