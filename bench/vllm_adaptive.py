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
  scheduler (`executor/vllm/hook.py`), priced by the same measured step costs.

The arms run in turn, round after round (a slow spell of the shared machine hits every arm),
REPS rounds; each arm's rollout time is the median of its rounds, quoted as a ratio to off.
The hook's own cost is measured per step (choosing, learning, recording) beside the step.

`--models planted` runs the same arms at a real size, for a GPU (bench/gpu_vllm.sh): the
Qwen2.5-1.5B configuration as target and 4 layers of the Qwen2.5-0.5B one as drafter, random
weights built on the spot, written as HF folders vLLM loads. Acceptance is planted (see
`planted_pair`): both models echo their input token, and the drafter splits its probability
evenly between the token and m_t stand-ins the target never emits, m_t drawn per token from
0..3, so a request whose prompt ends in token t accepts each draft with probability
1 / (1 + m_t): per-request acceptance of 1, 1/2, 1/3 or 1/4. `--smoke` builds the planted pair
at the built-in pair's shapes, so the path runs on vLLM's CPU build.

Run: python bench/vllm_adaptive.py [--reps 5] [--prompts 8] [--group 16] [--median 64] [--max-batch 64]
     [--models builtin|planted] [--smoke]
Needs vLLM (`make test-vllm` sets up .venv-vllm). Results: bench/results/vllm_adaptive.{json,txt}
(`_planted`, `_planted_smoke` added to the name; in $OUT instead when OUT is set).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from _common import table, write_result  # noqa: E402
from realloc import workload  # noqa: E402


def planted_pair(folder: Path, smoke: bool, seed: int, prompt_vocab: int) -> tuple[Path, Path]:
    """Target and drafter folders with planted acceptance (the module docstring). Both are
    echo models (`gpu_drain.echo_target`: blocks that add nothing to the residual stream, read
    out with the embedding); the final norms are scaled so that the echoed token leads every
    other by about 40 logits at any width. The drafter's output rows of m_t stand-ins (ids
    above the prompts' vocabulary, never emitted) are set to token t's embedding, for each
    prompt token t below `prompt_vocab`."""
    import torch
    from gpu_drain import builtin_shapes, echo_target
    from gpu_engine import QWEN_0_5B, QWEN_1_5B

    from rlsched.executor.model.saving import save_model

    if smoke:  # (a vocabulary with room for the stand-ins)
        target_cfg, drafter_cfg = builtin_shapes()
        target_cfg = dict(target_cfg, vocab_size=1024)
    else:
        target_cfg, drafter_cfg = dict(QWEN_1_5B), dict(QWEN_0_5B, num_layers=4)
    target_cfg = dict(target_cfg, max_position_embeddings=4096 if not smoke else target_cfg["max_position_embeddings"])
    drafter_cfg = dict(
        drafter_cfg,
        tie_word_embeddings=False,
        vocab_size=target_cfg["vocab_size"],
        max_position_embeddings=target_cfg["max_position_embeddings"],
    )
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    out = []
    for name, cfg in (("target", target_cfg), ("drafter", drafter_cfg)):
        m = echo_target(cfg, "cpu", torch.float32 if smoke else torch.bfloat16)
        with torch.no_grad():
            m.norm.weight.fill_(40.0 / (cfg["hidden_size"] * 0.02))
            if name == "drafter":
                vocab = cfg["vocab_size"]
                spare = iter(rng.permutation(np.arange(prompt_vocab, vocab)).tolist())
                for t in range(prompt_vocab):
                    for _ in range(int(rng.integers(0, 4))):
                        m.lm_head.weight[next(spare)] = m.embed.weight[t]
        out.append(save_model(m, folder / name))
    return out[0], out[1]


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
    ap.add_argument(
        "--gpu-memory-utilization", type=float, default=0.08, help="each engine's GPU share (several run at once)"
    )
    ap.add_argument("--models", choices=("builtin", "planted"), default="builtin")
    ap.add_argument("--smoke", action="store_true", help="planted models at the built-in pair's shapes")
    args = ap.parse_args()

    from rlsched.executor.decode.sampling import SamplingParams
    from rlsched.executor.model.builtin import builtin_pair
    from rlsched.executor.model.loading import load_model
    from rlsched.executor.vllm.engine import VllmRolloutEngine
    from rlsched.policies.draft import PolicyContext
    from rlsched.policies.lookup import TwoStatePolicy

    pair = builtin_pair()
    tokenizer = load_model(pair.target).tokenizer
    requests = workload(tokenizer, args.prompts, args.group, args.seed, args.median, args.sigma, 4 * args.median)
    longest = max(len(r.prompt) + r.max_new_tokens for r in requests)
    typical = int(np.mean([len(r.prompt) + r.max_new_tokens / 2 for r in requests]))
    work = Path(tempfile.mkdtemp(prefix="vllm-adaptive-"))
    sampling = SamplingParams(1.0)
    target, drafter, result_name, dtype = pair.target, pair.drafter, "vllm_adaptive", "float32"
    if args.models == "planted":
        t = time.perf_counter()
        target, drafter = planted_pair(work / "models", args.smoke, args.seed, tokenizer.get_vocab_size())
        print(f"planted pair built in {time.perf_counter() - t:.1f} s: {target}, {drafter}", file=sys.stderr)
        result_name += "_planted" + ("_smoke" if args.smoke else "")
        dtype = "float32" if args.smoke else "bfloat16"

    def engine(policy: str, cost=None):
        return VllmRolloutEngine(
            target,
            "off" if policy == "off" else drafter,
            sampling,
            policy,
            max_batch=args.max_batch,
            k_max=args.k_max,
            max_len=longest + args.k_max + 1,
            trace_dir=work / policy.replace(":", "_"),
            seed=args.seed,
            threads=args.threads,
            cost=cost,
            typical_ctx=typical,
            dtype=dtype,
            gpu_memory_utilization=args.gpu_memory_utilization,
        )

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
    two = TwoStatePolicy.solve(
        PolicyContext(
            cost,
            ("model",),
            k_max=args.k_max,
            max_batch=args.max_batch,
            typical_ctx=typical,
            acceptance_prior={"model": accept},
        )
    )
    table_policy = f"twostate:{two.max_batch_on}:{two.k}"  # (max_batch_on 0: SD never pays, plain)
    arms[f"table ({table_policy})"] = engine(table_policy)
    if adaptive:
        arms[adaptive[0]] = first
    else:
        first.close()
    for p in adaptive[1:]:
        arms[p] = engine(p, cost)

    for eng in arms.values():  # an engine's first rollout sets up its own process's kernels: not measured
        eng.rl_step = -1
        eng.run(requests)
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
        out[name] = dict(
            seconds=sec,
            runs_s=[r["seconds"] for r in rs],
            speedup_vs_off=off / sec,
            steps=steps,
            step_ms=step_ms,
            hook_ms_per_step=hook_ms,
            acceptance=acc,
            tokens=int(np.median([r["tokens"] for r in rs])),
        )
        rows.append([name, sec, off / sec, steps, step_ms, hook_ms, acc])
    statics = {n: v for n, v in out.items() if n.startswith("static:")}
    best = min(statics, key=lambda n: statics[n]["seconds"]) if statics else None
    models = (
        "the built-in pair"
        if args.models == "builtin"
        else ("the planted pair" + (" (built-in shapes)" if args.smoke else " (Qwen2.5-1.5B, 4 layers of 0.5B)"))
    )
    text = (
        f"vLLM {arms and next(iter(arms.values())).vllm_version} on {models}: {len(requests)} samples "
        f"({args.prompts} prompts x {args.group}), long-tailed budgets (median {args.median}), "
        f"max_batch {args.max_batch}, k_max {args.k_max}; median of {args.reps} interleaved rounds\n"
        f"step costs measured through vLLM in {calibration_s:.1f} s at start-up; best static after the fact: "
        f"{best}\n\n" + table(["arm", "rollout s", "x off", "steps", "ms/step", "hook ms/step", "acceptance"], rows)
    )
    if best:
        text += "\n\nagainst the best static: " + ", ".join(
            f"{n} {statics[best]['seconds'] / v['seconds']:.3f}x"
            for n, v in out.items()
            if not n.startswith(("static:", "off"))
        )
    print(text)
    write_result(
        result_name,
        {
            "args": vars(args),
            "arms": out,
            "best_static": best,
            "table_policy": table_policy,
            "calibration_s": calibration_s,
        },
        text,
        folder=os.environ.get("OUT") or None,
    )  # a GPU machine's results go to $OUT


if __name__ == "__main__":
    main()
