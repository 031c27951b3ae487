"""Drafter staleness and recovery during RL, side by side on the same seed.

The default run (GRPO, built-in pair) with a fixed draft length (static:K, so acceptance is
comparable from step to step), three ways, beside the same run without speculation (`off`,
whose rewards the others' should match: speculative sampling is lossless):
- stale: the drafter is never updated (drafter_update.every = 0);
- plain: distilled from the actor every I steps (schedule every), KL(p_actor || q_drafter) unweighted;
- reward: the same, each sample weighted by its normalised, clipped reward (ReSpec).
Reported per variant: acceptance rate (accepted / drafted) and accepted length per SD step
over the first and last fifth of the steps, the drafter-update time, and a figure of both
per RL step (bench/results/drafter_fresh.png). The same seed gives every variant the same
prompts at every step.

Run: python bench/drafter_fresh.py [--steps 60] [--k 4] [--set algorithm.lr=2e-4]; the EAGLE-3
head instead of the draft model: --set drafter=eagle --name drafter_fresh_eagle.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).parent))
from _common import RESULTS, table, write_result  # noqa: E402

from rlsched.executor.rl.config import build_run_config  # noqa: E402
from rlsched.executor.rl.trainer import Trainer  # noqa: E402
from rlsched.traces.reader import read_trace  # noqa: E402

VARIANTS = {
    "off": ["policy=off", "drafter_update.every=0"],  # the rewards without speculation
    "stale": ["drafter_update.every=0"],
    "plain": ["drafter_update.weighting=plain"],
    "reward": ["drafter_update.weighting=reward"],
}


def run(variant: str, args, root: Path) -> pd.DataFrame:
    cfg = build_run_config(
        {},
        [
            f"policy=static:{args.k}",
            f"steps={args.steps}",
            f"seed={args.seed}",
            f"drafter_update.every={args.every}",
            "drafter_update.schedule=every",
            *VARIANTS[variant],
            *args.sets,
        ],
    )
    out = root / variant
    Trainer(cfg, out).run()
    return read_trace(out / "traces", "rl_steps").sort_values("rl_step").reset_index(drop=True)


def fifth(x: pd.Series, last: bool) -> float:
    n = max(1, len(x) // 5)
    return float((x.tail(n) if last else x.head(n)).mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", dest="sets", action="append", default=[])
    ap.add_argument("--name", default="drafter_fresh")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = {}
        for v in VARIANTS:
            print(f"{v} ...", flush=True)
            runs[v] = run(v, args, Path(tmp))
    rows = []
    for v, df in runs.items():
        rows.append(
            [
                v,
                fifth(df.accept_rate, False),
                fifth(df.accept_rate, True),
                fifth(df.mean_accept_len, False),
                fifth(df.mean_accept_len, True),
                fifth(df.reward_mean, False),
                fifth(df.reward_mean, True),
                float(df.drafter_update_s.sum()),
                float(df.generation_s.sum()),
            ]
        )
    head = [
        "variant",
        "accept rate first",
        "accept rate last",
        "acc len first",
        "acc len last",
        "reward first",
        "reward last",
        "drafter upd s",
        "generation s",
    ]
    text = (
        f"static:{args.k}, {args.steps} RL steps, seed {args.seed}, update every {args.every} steps"
        + (f", {' '.join(args.sets)}" if args.sets else "")
        + " (first/last = mean over the first/last fifth "
        "of the steps)\n\n" + table(head, rows)
    )
    print(text)
    from rlsched.analysis.plots import Figure, save_figure

    fig = Figure(figsize=(11, 3.8))
    for i, (col, label) in enumerate((("accept_rate", "acceptance rate"), ("mean_accept_len", "tokens per SD step"))):
        ax = fig.add_subplot(1, 2, i + 1)
        for v, df in runs.items():
            ax.plot(df.rl_step, df[col].rolling(3, min_periods=1, center=True).mean(), label=v)
        ax.set(xlabel="RL step", ylabel=label, title=f"{label} (3-step mean), static:{args.k}")
        ax.legend()
    fig.tight_layout()
    RESULTS.mkdir(parents=True, exist_ok=True)
    save_figure(fig, RESULTS / f"{args.name}.png")
    write_result(
        args.name,
        dict(
            steps=args.steps,
            k=args.k,
            every=args.every,
            seed=args.seed,
            overrides=args.sets,
            rows=[dict(zip(head, r)) for r in rows],
            curves={
                v: dict(accept_rate=df.accept_rate.round(4).tolist(), accept_len=df.mean_accept_len.round(4).tolist())
                for v, df in runs.items()
            },
        ),
        text,
    )


if __name__ == "__main__":
    main()
