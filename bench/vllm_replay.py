"""Replay of vLLM rollouts: the simulator's model of vLLM's engine against vLLM's CPU build.

Two identical engines (`vllm.LLM`, multiprocess, the built-in pair with its draft model,
rlsched's scheduler recording an engine-core trace with the given policy) run the same
rollouts in turn, window after window (`reset_prefix_cache` starts a window, as a weight update
does): PROMPTS prompts x G samples with long-tailed token budgets (lognormal, no eos), new
prompts every window, more requests than `max_num_seqs` so that rows join as others finish
(vLLM's chunked prefill mixes their prompts into decode steps). Each engine first runs one
rollout whose records it drops (`warm_up`: vLLM's CPU build compiles nothing at start-up, so
its first forwards are slow). Each trace folder is then replayed (`rlsched replay`: step costs
fitted from its own records, vLLM's scheduling arguments from its engine file) and the
predicted generation time of every window set beside the measured one. The noise floor: the
two engines' measured windows against each other (same requests, same seed).

The RL run's replay is `bench/fidelity.py --set rollout.backend=vllm`.

Run: .venv-vllm/bin/python bench/vllm_replay.py [--windows 8] [--prompts 8] [--group 16]
[--median 40] [--k 3] [--policy static:3]. Results: bench/results/vllm_replay.{json,txt}.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import table, write_result  # noqa: E402
from vllm_engine_core import engine, rollout, workload  # noqa: E402


def warm_up(llm, requests) -> None:
    """One rollout with the engine's step records kept aside and dropped."""
    from rlsched.executor.vllm.engine_hook import ask

    ask(llm, "capture", True)
    try:
        rollout(llm, requests)
    finally:
        ask(llm, "capture", False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=16)
    ap.add_argument("--median", type=int, default=40)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--policy", default="static:3")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", type=Path, default=None, help="keep the trace folders here")
    args = ap.parse_args()
    from rlsched.analysis.engine_replay import replay_engine
    from rlsched.executor.model.builtin import builtin_pair
    from rlsched.executor.vllm.shims import ENGINE_ENV

    for key, v in ENGINE_ENV.items():
        os.environ.setdefault(key, v)
    pair = builtin_pair()
    work = args.work or Path(tempfile.mkdtemp(prefix="vllm-replay-"))
    work.mkdir(parents=True, exist_ok=True)
    folders = {name: work / name for name in ("a", "b")}
    t0 = time.perf_counter()
    engines = {}
    for name, folder in folders.items():
        block = {"rlsched": {"policy": args.policy, "trace_dir": str(folder), "seed": args.seed}}
        engines[name] = engine(pair, args.k, block, args.seed)
    for llm in engines.values():
        warm_up(llm, workload(args.prompts, args.group, args.median, args.seed + 1000))
    wall: dict[str, list[float]] = {name: [] for name in engines}
    for w in range(args.windows):
        requests = workload(args.prompts, args.group, args.median, args.seed + w)
        for name, llm in engines.items():
            llm.reset_prefix_cache()
            wall[name].append(rollout(llm, requests))
        print(f"window {w}: " + ", ".join(f"{n} {t[-1]:.2f}s" for n, t in wall.items()), file=sys.stderr)
    for llm in engines.values():
        llm.llm_engine.engine_core.shutdown()
    run_s = time.perf_counter() - t0

    results = {name: replay_engine(f) for name, f in folders.items()}
    rows, payload = [], {"args": {k: str(v) for k, v in vars(args).items()}, "run_s": run_s, "engines": {}}
    for name, r in results.items():
        s = r.steps
        total = float(s["predicted_s"].sum() / s["measured_s"].sum() - 1) * 100
        step, err = r.worst
        rows.append([name, len(s), float(s["measured_s"].sum()), float(s["predicted_s"].sum()), total, r.mape])
        rows[-1].append(f"{step} ({err:+.1f}%)")
        payload["engines"][name] = dict(
            summary=r.summary(), windows=s.round(5).to_dict("list"), wall_s=wall[name], folder=str(folders[name])
        )
    a, b = (results[n].steps.set_index("rl_step")["measured_s"] for n in ("a", "b"))
    floor = dict(mape_pct=float(np.mean(np.abs(b - a) / a) * 100), total_diff_pct=float((b.sum() / a.sum() - 1) * 100))
    payload["noise_floor"] = floor
    t = table(
        ["engine", "windows", "measured gen s", "predicted gen s", "total error %", "per-window MAPE %", "worst"], rows
    )
    f = results["a"].summary()
    text = (
        f"vLLM {args.policy} (draft model, k {args.k}), {args.windows} windows of {args.prompts} prompts x "
        f"{args.group} samples (budgets lognormal, median {args.median}), two identical engines in turn; "
        f"each trace replayed with costs fitted from its own records\n\n{t}\n\n"
        f"noise floor: engine b's measured windows against engine a's: {floor['mape_pct']:.1f}% per window "
        f"(MAPE), {floor['total_diff_pct']:+.1f}% in total\n"
        f"fit of engine a: {format_ops(f['cost'])}\nnotes: {'; '.join(f['notes'])}\n"
        f"runs: {run_s:.0f} s"
    )
    print(text)
    write_result("vllm_replay", payload, text)


def format_ops(cost: dict) -> str:
    ops = cost.get("ops", {})
    return ", ".join(f"{op} MAPE {100 * q['mape']:.1f}%" for op, q in ops.items() if isinstance(q.get("mape"), float))


if __name__ == "__main__":
    main()
