"""End-to-end RL steps with adaptive speculative decoding against SD off, side by side.

The default `rlsched run` (GRPO on a fixed set of 64 built-in prompts, the built-in pair, 40
RL steps) is run with SD off (policy off and no drafter: nothing to keep fresh) and with the
default adaptive policy (goodput, priced by a profile taken at the run's start) over each
drafter asked for (the built-in model drafter, distilled when its staleness has cost what an
update costs (`pays`, the default) and, as `builtin/every`, every 4 steps; the n-gram drafter,
which indexes the newest rollouts of each prompt for free), on the same seeds, a seed's runs
in lockstep (one RL step of each in turn, in one process), so that all see the same machine
state (identical runs one after the other differ by several percent here). Reported:

- seconds per RL step by stage (generation, inference, training, drafter update), summed over
  the steps and averaged over seeds, and the adaptive/off ratios per seed (end to end and
  generation stage);
- on-policy safety: reward at the start (first 20% of steps) and end (last 20%) per seed and
  policy, and how far apart the two policies' reward curves lie against the spread between
  seeds (the sampler is lossless: they must agree within seed noise);
- a figure (bench/results/rl_e2e.png): reward per step for every run, and the stage split.

Run: python bench/rl_e2e.py [--seeds 3] [--steps 40]. Results: bench/results/rl_e2e.{json,txt,png}.
About 4 minutes per seed on 2 cores.
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
from _common import RESULTS, lockstep, table, write_result  # noqa: E402

from rlsched.executor.rl.config import build_run_config  # noqa: E402
from rlsched.executor.rl.trainer import Trainer  # noqa: E402
from rlsched.traces.reader import read_trace  # noqa: E402

STAGES = ("generation", "inference", "training", "drafter_update")


def seed_runs(labels: list[str], seed: int, steps: int, overrides: list[str], root: Path) -> dict:
    """label -> (rl_steps, setup seconds) of one seed's runs, stepped in lockstep."""
    trainers, setup = {}, {}
    for label in labels:
        policy, _, drafter = label.partition("+")
        drafter, _, schedule = drafter.partition("/")  # builtin/every: drafter updates on the fixed interval
        extra = [f"drafter_update.schedule={schedule}"] if schedule else []
        cfg = build_run_config(
            {},
            [f"policy={policy}", f"drafter={drafter or 'off'}", f"seed={seed}", f"steps={steps}", *overrides, *extra],
        )
        t = time.perf_counter()
        trainers[label] = Trainer(cfg, root / f"{label.replace(':', '-')}-seed{seed}")
        setup[label] = time.perf_counter() - t
    lockstep(list(trainers.values()), steps)
    return {
        label: (read_trace(t.out / "traces", "rl_steps").sort_values("rl_step").reset_index(drop=True), setup[label])
        for label, t in trainers.items()
    }


def start_end(rewards: np.ndarray) -> tuple[float, float]:
    n = max(1, len(rewards) // 5)
    return float(rewards[:n].mean()), float(rewards[-n:].mean())


def smooth(x: np.ndarray, w: int = 5) -> np.ndarray:
    return pd.Series(x).rolling(w, min_periods=1, center=True).mean().to_numpy()


def figure(runs: dict, path: Path) -> None:
    from rlsched.analysis.plots import Figure, save_figure

    fig = Figure(figsize=(11, 3.8))
    ax = fig.add_subplot(1, 2, 1)
    for (policy, seed), df in runs.items():
        colors = {lab: f"C{i}" for i, lab in enumerate(sorted({p for p, _ in runs}, key=lambda p: p != "off"))}
        ax.plot(
            df.rl_step,
            smooth(df.reward_mean.to_numpy()),
            color=colors[policy],
            alpha=0.8,
            label=f"{policy}" if seed == min(s for _, s in runs) else None,
            linestyle=["-", "--", ":", "-."][seed % 4],
        )
    ax.set(xlabel="RL step", ylabel="reward (5-step mean)", title="reward per seed: SD off and adaptive SD")
    ax.legend()
    ax = fig.add_subplot(1, 2, 2)
    policies = sorted({p for p, _ in runs}, key=lambda p: p != "off")
    bottom = np.zeros(len(policies))
    for stage in STAGES:
        v = np.array(
            [np.mean([df[f"{stage}_s"].mean() for (p, _), df in runs.items() if p == pol]) for pol in policies]
        )
        ax.bar(policies, v, bottom=bottom, label=stage)
        bottom += v
    ax.set(ylabel="seconds per RL step (mean over seeds)", title="stage split")
    ax.legend(fontsize="small")
    fig.tight_layout()
    save_figure(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--policy", default="goodput", help="the adaptive policy (default: goodput)")
    ap.add_argument(
        "--drafters",
        default="builtin,builtin/every,ngram",
        help="drafters of the adaptive runs, comma-separated; DRAFTER/SCHEDULE sets drafter_update.schedule",
    )
    ap.add_argument("--set", dest="sets", action="append", default=[], help="config override (repeatable)")
    ap.add_argument("--name", default="rl_e2e", help="results file name under bench/results/")
    args = ap.parse_args()

    labels = ["off"] + [f"{args.policy}+{d.strip()}" for d in args.drafters.split(",") if d.strip()]
    runs: dict[tuple[str, int], pd.DataFrame] = {}
    setup: dict[tuple[str, int], float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):
            print(f"seed {seed}: {', '.join(labels)} in lockstep ...", flush=True)
            for label, (df, setup_s) in seed_runs(labels, seed, args.steps, args.sets, Path(tmp)).items():
                runs[label, seed], setup[label, seed] = df, setup_s

    rows, per_seed = [], []
    for label in labels:
        dfs = [runs[label, s] for s in range(args.seeds)]
        stage = {k: float(np.mean([df[f"{k}_s"].sum() for df in dfs])) for k in STAGES}
        total = float(np.mean([df.total_s.sum() for df in dfs]))
        accept = float(np.mean([df.mean_accept_len.mean() for df in dfs]))
        speed_t = [runs["off", s].total_s.sum() / runs[label, s].total_s.sum() for s in range(args.seeds)]
        speed_g = [runs["off", s].generation_s.sum() / runs[label, s].generation_s.sum() for s in range(args.seeds)]
        r0, r1 = zip(*(start_end(df.reward_mean.to_numpy()) for df in dfs))
        rows.append(
            [
                label,
                total,
                *stage.values(),
                accept,
                float(np.mean([df.response_tokens.sum() / df.generation_s.sum() for df in dfs])),
                f"{np.mean(speed_t):.3f} ({min(speed_t):.2f}-{max(speed_t):.2f})",
                f"{np.mean(speed_g):.3f} ({min(speed_g):.2f}-{max(speed_g):.2f})",
                f"{np.mean(r0):.3f} -> {np.mean(r1):.3f}",
            ]
        )
        for s, df in enumerate(dfs):
            a, b = start_end(df.reward_mean.to_numpy())
            per_seed.append(
                dict(
                    label=label,
                    seed=s,
                    seconds=float(df.total_s.sum()),
                    generation_s=float(df.generation_s.sum()),
                    speedup_total=speed_t[s],
                    speedup_generation=speed_g[s],
                    reward_start=a,
                    reward_end=b,
                    setup_s=setup[label, s],
                )
            )
    # on-policy safety: each SD curve's gap to the off curve against the spread between seeds
    curves = {lab: np.stack([smooth(runs[lab, s].reward_mean.to_numpy()) for s in range(args.seeds)]) for lab in labels}
    spread = float(np.mean([c.std(0, ddof=1).mean() for c in curves.values()])) if args.seeds > 1 else float("nan")
    gaps = {lab: float(np.abs(curves["off"].mean(0) - curves[lab].mean(0)).mean()) for lab in labels[1:]}
    ends = {lab: [d["reward_end"] for d in per_seed if d["label"] == lab] for lab in labels}

    head = [
        "run",
        "s/run",
        "generation",
        "inference",
        "training",
        "drafter upd",
        "accepted len",
        "gen tok/s",
        "speedup total",
        "speedup gen",
        "reward start -> end",
    ]
    summary = "\n".join(
        [
            "reward at the end (last 20% of steps), mean +- std over seeds: "
            + ", ".join(f"{lab} {np.mean(v):.3f} +- {np.std(v):.3f}" for lab, v in ends.items()),
            f"reward curves (5-step means): mean std between seeds {spread:.3f}; mean gap to off: "
            + ", ".join(f"{lab} {g:.3f}" for lab, g in gaps.items()),
        ]
    )
    text = "\n\n".join(
        [
            f"{args.seeds} seeds x {args.steps} RL steps, default config"
            + (f" with {' '.join(args.sets)}" if args.sets else "")
            + "; seconds are sums over the run's steps, means over seeds; speedups per seed against "
            "off (mean, min-max)",
            table(head, rows),
            summary,
        ]
    )
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    figure(runs, RESULTS / f"{args.name}.png")
    write_result(
        args.name,
        dict(
            seeds=args.seeds,
            steps=args.steps,
            labels=labels,
            overrides=args.sets,
            rows=[dict(zip(head, r)) for r in rows],
            per_seed=per_seed,
            curve_gaps=gaps,
            seed_spread=spread,
            reward_curves={f"{lab}/seed{s}": df.reward_mean.round(4).tolist() for (lab, s), df in runs.items()},
        ),
        text,
    )


if __name__ == "__main__":
    main()
