"""`rlsched plan` on the seed-shaped presets: does the plan's winner beat the setup the preset
writes by hand, and which knob moves the most?

For each preset the plan searches its own GPU budget (the default space with a learned table
for the best chain setup, 3 seeds, as `rlsched plan` does) and compares
its winner with the preset's setup on the same seeds; the explanation moves each differing knob
alone from the preset's setup to the winner's. Reported per preset: the preset's setup and its
step time, the winner and its step time, the gain, the speedup over the best plain decoding,
and the knob that moved the most (its gain alone).

`--engine vllm` plans under the simulator's model of vLLM's engine (`engine.kind: vllm`), where
the plan also searches vLLM's token budget, chunked prefill and CUDA-graph capture sizes; each
row then names the winner's knobs.

Run: python bench/plan_presets.py [--presets respec-qwen2.5-3b,...] [--workers 2] [--engine vllm]
[--no-learn].
Results: bench/results/plan_presets.{json,txt}; with --engine vllm, plan_presets_vllm.{json,txt}.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import table, write_result  # noqa: E402

from rlsched.config import load_config  # noqa: E402
from rlsched.plan.planner import make_plan, summary  # noqa: E402
from rlsched.plan.space import Space  # noqa: E402

PRESETS = "respec-qwen2.5-3b,respec-qwen2.5-7b,respec-qwen2.5-14b,rlhfspec-llama3.1-8b-ppo"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default=PRESETS)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--engine", choices=("rlsched", "vllm"), default="rlsched", help="the simulated engine")
    ap.add_argument("--no-learn", action="store_true", help="no learned table (as `rlsched plan --no-learn`)")
    args = ap.parse_args()
    rows, out = [], []
    for name in args.presets.split(","):
        base = load_config(preset=name, overrides=["record_timeline=false", f"engine.kind={args.engine}"])
        gpus = base.cluster.instances * base.cluster.tp + (base.rl.train_gpus or 0)
        t = time.perf_counter()
        with tempfile.TemporaryDirectory() as work:  # as `rlsched plan` does: a table learned for the best chains
            learn = None if args.no_learn else Path(work)
            plan = make_plan(base, Space(gpus), seeds=args.seeds, workers=args.workers, learn_in=learn)
        s = summary(plan)
        w = plan.winner.candidate
        s.update(
            preset=name,
            wall_s=time.perf_counter() - t,
            knobs=plan.knobs,
            engine=args.engine,
            winner_engine=None if w.engine is None else w.engine.engine_update(),
            searched=len(plan.ranked),
            learn=not args.no_learn,
        )
        out.append(s)
        rows.append(
            [
                name,
                s.get("own_setup", "-"),
                s.get("own_step_s", "-"),
                s["winner"],
                s["winner_step_s"],
                f"{s['gain_over_own']:+.1%}" if "gain_over_own" in s else "-",
                f"{s['speedup_over_baseline']:.2f}x" if "speedup_over_baseline" in s else "-",
                s.get("knob", "-"),
            ]
        )
        print(f"{name}: {s['wall_s']:.0f} s", file=sys.stderr)
        _write(args, rows, out)  # after each preset: a stopped run keeps what it finished


def _write(args, rows: list, out: list) -> None:
    text = "\n".join(
        [
            f"the plan's winner against each preset's own setup ({args.seeds} seeds, the preset's GPUs, the "
            f"{args.engine} engine{', no learned table' if args.no_learn else ''}; gain: the own "
            "setup's step time over the winner's, minus 1; speedup: the best plain decoding's over the winner's)",
            "",
            table(
                ["preset", "preset's setup", "step s", "plan's winner", "step s", "gain", "over no SD", "knob (alone)"],
                rows,
            ),
        ]
    )
    print(text)
    write_result("plan_presets" + ("_vllm" if args.engine == "vllm" else ""), dict(presets=out), text)


if __name__ == "__main__":
    main()
