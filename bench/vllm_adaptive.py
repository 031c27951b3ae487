"""rlsched's draft policies inside vLLM against vLLM's own ways, on the same rollouts.

Workload: the built-in pair, PROMPTS prompts x G samples of the built-in tasks, each prompt
with a long-tailed token budget (lognormal; its samples vary around it; no eos, so a sample
runs to its budget): a rollout whose batch drains. One vLLM engine (vLLM's offline engine,
in this process, `rollout.backend vllm`) per arm:

- off: plain vLLM, no speculative_config;
- static:K for K in --static: vLLM's num_speculative_tokens = K; "best static" is the fastest
  of them, chosen after the fact;
- table: vLLM's own num_speculative_tokens_per_batch_size, the two-state table (one k at or
  below a batch size, off above) solved over the step costs measured through vLLM, at the
  acceptance the static runs measured;
- goodput, seqgoodput, bandit: rlsched's policies choosing k every step inside vLLM's
  scheduler (`executor/vllm_hook.py`), priced by the same measured step costs.

The arms run in turn, round after round (a slow spell of the shared machine hits every arm),
REPS rounds; each arm's rollout time is the median of its rounds, quoted as a ratio to off.
The hook's own cost is measured per step (choosing, learning, recording) beside the step.

Run: python bench/vllm_adaptive.py [--reps 5] [--prompts 8] [--group 16] [--median 64] [--max-batch 64]
Needs vLLM (`make test-vllm` sets up .venv-vllm). Results: bench/results/vllm_adaptive.{json,txt}.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from _common import table, write_result  # noqa: E402
from realloc import workload  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=16)
    ap.add_argument("--median", type=int, default=64, help="median token budget of a prompt's samples")
    ap.add_argument("--sigma", type=float, default=0.8)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--k-max", type=int, default=6)
    ap.add_argument("--static", default="1,2,3,4")
    ap.add_argument("--adaptive", default="goodput,seqgoodput,bandit")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()

    from rlsched.executor.builtin import builtin_pair
    from rlsched.executor.loading import load_model
    from rlsched.executor.sampling import SamplingParams
    from rlsched.executor.vllm_backend import VllmRolloutEngine
    from rlsched.policies.draft import PolicyContext
    from rlsched.policies.lookup import TwoStatePolicy

    pair = builtin_pair()
    requests = workload(load_model(pair.target).tokenizer, args.prompts, args.group, args.seed, args.median,
                        args.sigma, 4 * args.median)
    longest = max(len(r.prompt) + r.max_new_tokens for r in requests)
    typical = int(np.mean([len(r.prompt) + r.max_new_tokens / 2 for r in requests]))
    work = Path(tempfile.mkdtemp(prefix="vllm-adaptive-"))
    sampling = SamplingParams(1.0)

    def engine(policy: str, cost=None):
        return VllmRolloutEngine(pair.target, "off" if policy == "off" else pair.drafter, sampling, policy,
                                 max_batch=args.max_batch, k_max=args.k_max, max_len=longest + args.k_max + 1,
                                 trace_dir=work / policy.replace(":", "_"), seed=args.seed, threads=args.threads,
                                 cost=cost, typical_ctx=typical)

    arms: dict[str, VllmRolloutEngine] = {"off": engine("off")}
    for k in args.static.split(","):
        arms[f"static:{k}"] = engine(f"static:{k}")
    adaptive = [p for p in args.adaptive.split(",") if p]
    first = engine(adaptive[0] if adaptive else "static:1")
    t = time.perf_counter()
    cost = first.cost or first.calibrate(typical)  # (a priced policy measured them as it started)
    calibration_s = first.calibration_s or time.perf_counter() - t
    warm = arms["static:" + args.static.split(",")[-1]].run(requests)  # the acceptance the table is solved at
    accept = warm.stats["accepted"] / max(1, warm.stats["drafted"])
    two = TwoStatePolicy.solve(PolicyContext(cost, ("model",), k_max=args.k_max, max_batch=args.max_batch,
                                             typical_ctx=typical, acceptance_prior={"model": accept}))
    table_policy = f"twostate:{two.max_batch_on}:{two.k}"  # (max_batch_on 0: SD never pays, plain)
    arms[f"table ({table_policy})"] = engine(table_policy)
    if adaptive:
        arms[adaptive[0]] = first
    else:
        first.close()
    for p in adaptive[1:]:
        arms[p] = engine(p, cost)

    runs: dict[str, list[dict]] = {name: [] for name in arms}
    for rep in range(args.reps):
        for name, eng in arms.items():
            eng.rl_step = rep
            res = eng.run(requests)
            runs[name].append(dict(res.stats))
            print(f"round {rep}: {name:>22} {res.stats['seconds']:.2f} s", file=sys.stderr)
    for eng in arms.values():
        eng.close()

    off = float(np.median([r["seconds"] for r in runs["off"]]))
    rows, out = [], {}
    for name, rs in runs.items():
        sec = float(np.median([r["seconds"] for r in rs]))
        steps = float(np.median([r["steps"] for r in rs]))
        hook_ms = float(np.median([1e3 * r["hook_s"] / max(1, r["steps"]) for r in rs]))
        step_ms = 1e3 * sec / max(1.0, steps)
        acc = sum(r["accepted"] for r in rs) / max(1, sum(r["drafted"] for r in rs))
        out[name] = dict(seconds=sec, runs_s=[r["seconds"] for r in rs], speedup_vs_off=off / sec, steps=steps,
                         step_ms=step_ms, hook_ms_per_step=hook_ms, acceptance=acc,
                         tokens=int(np.median([r["tokens"] for r in rs])))
        rows.append([name, sec, off / sec, steps, step_ms, hook_ms, acc])
    statics = {n: v for n, v in out.items() if n.startswith("static:")}
    best = min(statics, key=lambda n: statics[n]["seconds"]) if statics else None
    text = (f"vLLM {arms and next(iter(arms.values())).vllm_version} on the built-in pair: {len(requests)} samples "
            f"({args.prompts} prompts x {args.group}), long-tailed budgets (median {args.median}), "
            f"max_batch {args.max_batch}, k_max {args.k_max}; median of {args.reps} interleaved rounds\n"
            f"step costs measured through vLLM in {calibration_s:.1f} s at start-up; best static after the fact: "
            f"{best}\n\n"
            + table(["arm", "rollout s", "x off", "steps", "ms/step", "hook ms/step", "acceptance"], rows))
    if best:
        text += "\n\nagainst the best static: " + ", ".join(
            f"{n} {statics[best]['seconds'] / v['seconds']:.3f}x" for n, v in out.items()
            if not n.startswith(("static:", "off")))
    print(text)
    write_result("vllm_adaptive", {"args": vars(args), "arms": out, "best_static": best,
                                   "table_policy": table_policy, "calibration_s": calibration_s}, text)


if __name__ == "__main__":
    main()
