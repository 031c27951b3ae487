"""The cost of rlsched's scheduler hook inside vLLM's engine core, beside the step it runs in.

vLLM's multiprocess engine (`vllm.LLM` with its default engine-core process), the built-in
pair, PROMPTS prompts x G samples with long-tailed token budgets (lognormal, no eos). Arms, each
its own engine, kept up together and run in turn, round after round (a slow spell of the shared
machine hits every arm):

- vllm static:K: vLLM's own scheduler and num_speculative_tokens = K, no rlsched;
- rlsched static:K: the same through rlsched's scheduler (`--scheduler-cls
  rlsched.vllm.PolicyScheduler`), which watches, records and chooses K every step;
- goodput, bandit: rlsched's policies choosing k every step (goodput priced by a cost file,
  `--cost`: by default a fit of tests/data/engine_core_trace, a trace vLLM's CPU build wrote).

Per arm: the rollout's wall time (median of the rounds, and its ratio to vllm static:K), and
from the engine core's step records the median step time, the median of `hook_ms` (the host time
the hook took in a step: choosing, learning, recording) and the hook's share of all step time.
Async scheduling is recorded as the engines ran it: vLLM's CPU platform turns it off; on a GPU
with an EAGLE or draft-model drafter vLLM turns it on and the arms run on its AsyncScheduler.

Run: python bench/vllm_engine_core.py [--reps 3] [--prompts 8] [--group 16] [--median 40] [--k 3]
Needs vLLM (.venv-vllm). Results: bench/results/vllm_engine_core.{json,txt} (in $OUT when set).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import table, write_result  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def workload(prompts: int, group: int, median: int, seed: int) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(prompts):
        prompt = rng.integers(3, 60, size=int(rng.integers(8, 24))).tolist()  # the pair's vocabulary: 64
        budget = float(np.exp(rng.normal(np.log(median), 0.8)))
        out += [(prompt, int(np.clip(budget * rng.uniform(0.7, 1.3), 4, 200))) for _ in range(group)]
    return out


def engine(pair, k: int, block: dict | None, seed: int):
    from vllm import LLM

    spec = {"method": "draft_model", "model": str(pair.drafter), "num_speculative_tokens": k}
    extra = {} if block is None else {"scheduler_cls": "rlsched.vllm.PolicyScheduler", "additional_config": block}
    return LLM(
        model=str(pair.target),
        dtype="float32",
        enforce_eager=True,
        max_num_seqs=64,
        max_model_len=256,
        skip_tokenizer_init=True,
        seed=seed,
        speculative_config=dict(spec, draft_sample_method="probabilistic"),
        **extra,
    )


def rollout(llm, requests) -> float:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in requests]
    params = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True, detokenize=False) for _, n in requests]
    t = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=16)
    ap.add_argument("--median", type=int, default=40)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cost", type=Path, default=None, help="a `rlsched fit` file for goodput")
    args = ap.parse_args()
    from rlsched.executor.model.builtin import builtin_pair
    from rlsched.executor.vllm.shims import ENGINE_ENV

    for k, v in ENGINE_ENV.items():
        os.environ.setdefault(k, v)
    from rlsched.traces.reader import read_trace

    pair = builtin_pair()
    work = Path(tempfile.mkdtemp(prefix="vllm-engine-core-"))
    cost = args.cost
    if cost is None:
        cost = work / "cost.json"
        fixture = ROOT / "tests" / "data" / "engine_core_trace"
        cmd = [sys.executable, "-m", "rlsched", "fit", str(fixture), "--out", str(cost)]
        subprocess.run(cmd, check=True, capture_output=True)
    k = args.k

    def block(policy: str, name: str) -> dict:
        return {"rlsched": {"policy": policy, "cost_model": str(cost), "trace_dir": str(work / name)}}

    arms = {
        f"vllm static:{k}": None,
        f"rlsched static:{k}": block(f"static:{k}", "static"),
        "goodput": block("goodput", "goodput"),
        "bandit": block("bandit", "bandit"),
    }
    engines = {name: engine(pair, k, b, args.seed) for name, b in arms.items()}
    requests = workload(args.prompts, args.group, args.median, args.seed)
    times: dict[str, list[float]] = {name: [] for name in arms}
    for r in range(args.reps):
        for name, llm in engines.items():
            times[name].append(rollout(llm, requests))
        print(f"round {r + 1}: " + ", ".join(f"{n} {t[-1]:.2f}s" for n, t in times.items()), file=sys.stderr)
    for llm in engines.values():
        llm.llm_engine.engine_core.shutdown()
    base = statistics.median(times[f"vllm static:{k}"])
    rows, payload = [], {"args": {**vars(args), "cost": str(cost)}, "arms": {}}
    for name, b in arms.items():
        t = statistics.median(times[name])
        entry = {"rollout_s": times[name], "median_s": t, "vs_vllm": t / base}
        if b is not None:
            folder = Path(b["rlsched"]["trace_dir"])
            steps = read_trace(folder, "steps")
            engine_file = json.loads(next(folder.glob("engine-*.json")).read_text())
            entry.update(
                steps=len(steps),
                step_ms=float(steps.step_ms.median()),
                hook_ms=float(steps.hook_ms.median()),
                hook_share=float(steps.hook_ms.sum() / steps.step_ms.sum()),
                async_scheduling=engine_file["async_scheduling"],
            )
        payload["arms"][name] = entry
        rows.append(
            [
                name,
                round(t, 2),
                round(t / base, 3),
                entry.get("steps", "-"),
                round(entry["step_ms"], 2) if "step_ms" in entry else "-",
                round(entry["hook_ms"], 3) if "hook_ms" in entry else "-",
                f"{100 * entry['hook_share']:.1f}%" if "hook_share" in entry else "-",
                entry.get("async_scheduling", "-"),
            ]
        )
    text = table(
        ["arm", "rollout s", "vs vllm", "steps", "step ms (median)", "hook ms (median)", "hook share", "async"], rows
    )
    print(text)
    folder = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    print(write_result("vllm_engine_core", payload, text, folder), file=sys.stderr)


if __name__ == "__main__":
    main()
