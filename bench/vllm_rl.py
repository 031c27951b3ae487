"""GRPO on vLLM against GRPO on rlsched's engine, side by side: rewards rise alike.

The default `rlsched run` config (GRPO on the built-in tasks and the built-in pair, `goodput`
with the built-in drafter, distilled when staleness has cost what an update costs), once with
`rollout.backend: local` and once with `rollout.backend: vllm` (rlsched's policy inside
vLLM's scheduler, weights loaded into vLLM after every update), per seed, stepped in lockstep
(one RL step of each in turn: a slow spell of the shared machine hits both). Reported per
backend: the reward at the start and at the end (first and last 20% of the steps, means over
seeds), the stage seconds, and from the vLLM run's step records the draft length the policy
chose by batch size (the batch drains within each rollout). Then seed 0's runs go through
`rlsched fit` (held-out MAPE per op, costs fitted from the run's own step records) and
`rlsched replay` (per-RL-step MAPE of the generation stage, predicted against measured):
a vLLM run's traces read like a local run's.

Run: .venv-vllm/bin/python bench/vllm_rl.py [--seeds 2] [--steps 40] [--work DIR]
(with --work, runs already finished there are read again, not re-run)
Results: bench/results/vllm_rl.{json,txt}.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).parent))
from _common import lockstep, table, write_result  # noqa: E402
from rl_e2e import STAGES, start_end  # noqa: E402

BATCHES = [(1, 4), (5, 16), (17, 64)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--policy", default="goodput")
    ap.add_argument("--work", type=Path, default=None)
    args = ap.parse_args()

    from rlsched.analysis.replay import replay_run
    from rlsched.costs.fit import fit_path
    from rlsched.executor.rl.config import build_run_config
    from rlsched.executor.rl.trainer import Trainer
    from rlsched.traces.reader import read_trace

    backends = ("local", "vllm")
    runs: dict[tuple[str, int], pd.DataFrame] = {}
    ks: list[pd.DataFrame] = []
    t0 = time.perf_counter()
    fidelity = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = args.work or Path(tmp)
        for seed in range(args.seeds):
            dirs = {b: root / f"{b}-seed{seed}" for b in backends}
            todo = [b for b in backends if not (dirs[b] / "summary.json").is_file()]
            if todo:
                lockstep(
                    [
                        Trainer(
                            build_run_config(
                                {},
                                [
                                    f"policy={args.policy}",
                                    "drafter=builtin",
                                    f"seed={seed}",
                                    f"steps={args.steps}",
                                    f"rollout.backend={b}",
                                ],
                            ),
                            dirs[b],
                        )
                        for b in todo
                    ],
                    args.steps,
                )
            for b, d in dirs.items():
                runs[b, seed] = read_trace(d / "traces", "rl_steps").sort_values("rl_step").reset_index(drop=True)
            steps = read_trace(dirs["vllm"] / "traces", "steps")
            ks.append(steps[steps.kind == "decode"][["batch", "k", "drafted"]])
            print(f"seed {seed} done at {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
            if seed == 0:
                for b, d in dirs.items():
                    fit = fit_path(d)
                    r = replay_run(d).summary()
                    held_out = {op: f.quality.get("mape_heldout") for op, f in fit.ops.items()}
                    fidelity[b] = dict(
                        fit_mape_heldout=held_out,
                        replay_mape_pct=r["mape_pct"],
                        measured_generation_s=r["measured_generation_s"],
                        predicted_generation_s=r["predicted_generation_s"],
                        overhead_ms_per_step=r["overhead_ms_per_step"],
                    )

    rows, out = [], {}
    for b in backends:
        mine = [runs[b, s] for s in range(args.seeds)]
        se = [start_end(df.reward_mean.to_numpy()) for df in mine]
        stage = {st: float(np.mean([df[f"{st}_s"].sum() for df in mine])) for st in STAGES}
        acc = float(np.mean([df.mean_accept_len.mean() for df in mine]))
        out[b] = dict(
            reward_start=float(np.mean([a for a, _ in se])),
            reward_end=float(np.mean([e for _, e in se])),
            reward_start_end_per_seed=se,
            stage_s=stage,
            mean_accept_len=acc,
        )
        rows.append([b, out[b]["reward_start"], out[b]["reward_end"], *(stage[st] for st in STAGES), acc])
    decode = pd.concat(ks)
    by_batch = []
    for lo, hi in BATCHES:
        d = decode[(decode.batch >= lo) & (decode.batch <= hi)]
        by_batch.append(
            dict(
                batch=f"{lo}-{hi}",
                steps=int(len(d)),
                mean_k=float(d.k.mean()) if len(d) else None,
                share_drafting=float((d.drafted > 0).mean()) if len(d) else None,
            )
        )
    text = (
        f"{args.seeds} seeds x {args.steps} RL steps, default config, policy {args.policy} with the built-in "
        "drafter; rewards are means over seeds of the first and last 20% of steps, seconds sums over the run\n\n"
        + table(["backend", "reward start", "reward end", *(f"{s} s" for s in STAGES), "accepted len"], rows)
        + "\n\nvLLM: the draft length the policy chose by batch size (decode steps)\n\n"
        + table(
            ["batch", "steps", "mean k", "share of steps drafting"],
            [[r["batch"], r["steps"], r["mean_k"], r["share_drafting"]] for r in by_batch],
        )
    )
    ops = sorted({op for f in fidelity.values() for op in f["fit_mape_heldout"]})
    text += (
        "\n\nseed 0's runs: `rlsched fit` held-out MAPE per op (%), `rlsched replay` per-RL-step MAPE of the "
        "generation stage and its sum, predicted against measured\n\n"
        + table(
            ["backend", *(f"fit {op}" for op in ops), "replay MAPE %", "measured gen s", "predicted gen s"],
            [
                [
                    b,
                    *(_pct(f["fit_mape_heldout"].get(op)) for op in ops),
                    f["replay_mape_pct"],
                    f["measured_generation_s"],
                    f["predicted_generation_s"],
                ]
                for b, f in fidelity.items()
            ],
        )
    )
    print(text)
    curves = {f"{b}-seed{s}": df.reward_mean.tolist() for (b, s), df in runs.items()}
    write_result(
        "vllm_rl",
        dict(
            args={k: str(v) for k, v in vars(args).items()},
            backends=out,
            k_by_batch=by_batch,
            fidelity=fidelity,
            reward_curves=curves,
        ),
        text,
    )


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


if __name__ == "__main__":
    main()
