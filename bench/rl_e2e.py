"""End-to-end RL steps with adaptive speculative decoding against SD off, side by side.

The default `rlsched run` (GRPO on a fixed set of 64 built-in prompts, the built-in pair, 40
RL steps) is run with `--policy off` and with the default adaptive policy (goodput, priced by
a profile taken at the run's start), on the same seeds, one after the other per seed (off
first, then adaptive, then the next seed), so both see the same machine state. Reported:

- seconds per RL step by stage (generation, inference, training, drafter update), summed over
  the steps and averaged over seeds, and the adaptive/off ratios per seed (end to end and
  generation stage);
- on-policy safety: reward at the start (first 20% of steps) and end (last 20%) per seed and
  policy, and how far apart the two policies' reward curves lie against the spread between
  seeds (the sampler is lossless: they must agree within seed noise);
- a figure (bench/results/rl_e2e.png): reward per step for every run, and the stage split.

Run: python bench/rl_e2e.py [--seeds 3] [--steps 40]. Results: bench/results/rl_e2e.{json,txt,png}.
About 3 minutes per seed on 2 cores.
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
from _common import RESULTS, table, write_result  # noqa: E402

from rlsched.executor.rl.config import build_run_config  # noqa: E402
from rlsched.executor.rl.trainer import Trainer  # noqa: E402
from rlsched.traces.reader import read_trace  # noqa: E402

STAGES = ("generation", "inference", "training", "drafter_update")


def one_run(policy: str, seed: int, steps: int, overrides: list[str], root: Path) -> tuple[pd.DataFrame, float]:
    cfg = build_run_config({}, [f"policy={policy}", f"seed={seed}", f"steps={steps}", *overrides])
    out = root / f"{policy.replace(':', '-')}-seed{seed}"
    t = time.perf_counter()
    trainer = Trainer(cfg, out)
    setup_s = time.perf_counter() - t
    trainer.run()
    return read_trace(out / "traces", "rl_steps").sort_values("rl_step").reset_index(drop=True), setup_s


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
        ax.plot(df.rl_step, smooth(df.reward_mean.to_numpy()), color="C0" if policy == "off" else "C1",
                alpha=0.8, label=f"{policy}" if seed == min(s for _, s in runs) else None,
                linestyle=["-", "--", ":", "-."][seed % 4])
    ax.set(xlabel="RL step", ylabel="reward (5-step mean)", title="reward per seed: SD off vs adaptive SD")
    ax.legend()
    ax = fig.add_subplot(1, 2, 2)
    policies = sorted({p for p, _ in runs}, key=lambda p: p != "off")
    bottom = np.zeros(len(policies))
    for stage in STAGES:
        v = np.array([np.mean([df[f"{stage}_s"].mean() for (p, _), df in runs.items() if p == pol])
                      for pol in policies])
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
    ap.add_argument("--set", dest="sets", action="append", default=[], help="config override (repeatable)")
    ap.add_argument("--name", default="rl_e2e", help="results file name under bench/results/")
    args = ap.parse_args()

    runs: dict[tuple[str, int], pd.DataFrame] = {}
    setup: dict[tuple[str, int], float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):
            for policy in ("off", args.policy):
                print(f"seed {seed}: {policy} ...", flush=True)
                runs[policy, seed], setup[policy, seed] = one_run(policy, seed, args.steps, args.sets, Path(tmp))

    rows, per_seed = [], []
    for policy in ("off", args.policy):
        dfs = [runs[policy, s] for s in range(args.seeds)]
        stage = {k: float(np.mean([df[f"{k}_s"].sum() for df in dfs])) for k in STAGES}
        total = float(np.mean([df.total_s.sum() for df in dfs]))
        accept = float(np.mean([df.mean_accept_len.mean() for df in dfs]))
        rows.append([policy, total, *stage.values(), accept,
                     float(np.mean([df.response_tokens.sum() / df.generation_s.sum() for df in dfs]))])
    for s in range(args.seeds):
        off, ad = runs["off", s], runs[args.policy, s]
        r0o, r1o = start_end(off.reward_mean.to_numpy())
        r0a, r1a = start_end(ad.reward_mean.to_numpy())
        per_seed.append(dict(seed=s, speedup_total=off.total_s.sum() / ad.total_s.sum(),
                             speedup_generation=off.generation_s.sum() / ad.generation_s.sum(),
                             reward_start_off=r0o, reward_end_off=r1o, reward_start_adaptive=r0a,
                             reward_end_adaptive=r1a, setup_s_off=setup["off", s], setup_s_adaptive=setup[args.policy, s]))
    # on-policy safety: the curves' gap against the seeds' spread
    curves = {p: np.stack([smooth(runs[p, s].reward_mean.to_numpy()) for s in range(args.seeds)])
              for p in ("off", args.policy)}
    gap = float(np.abs(curves["off"].mean(0) - curves[args.policy].mean(0)).mean())
    spread = float(np.mean([curves[p].std(0, ddof=1).mean() for p in curves])) if args.seeds > 1 else float("nan")
    end_off = [d["reward_end_off"] for d in per_seed]
    end_ad = [d["reward_end_adaptive"] for d in per_seed]

    t1 = table(["policy", "s/run", "generation", "inference", "training", "drafter upd", "accepted len",
                "gen tok/s"], rows)
    t2 = table(["seed", "speedup total", "speedup gen", "reward off start->end", "reward SD start->end"],
               [[d["seed"], d["speedup_total"], d["speedup_generation"],
                 f"{d['reward_start_off']:.3f} -> {d['reward_end_off']:.3f}",
                 f"{d['reward_start_adaptive']:.3f} -> {d['reward_end_adaptive']:.3f}"] for d in per_seed])
    sp_t = [d["speedup_total"] for d in per_seed]
    sp_g = [d["speedup_generation"] for d in per_seed]
    summary = (f"end-to-end RL-step speedup ({args.policy} vs off): mean {np.mean(sp_t):.3f}x "
               f"(per seed {', '.join(f'{x:.3f}' for x in sp_t)}); generation stage {np.mean(sp_g):.3f}x\n"
               f"reward at the end: off {np.mean(end_off):.3f} +- {np.std(end_off):.3f}, "
               f"{args.policy} {np.mean(end_ad):.3f} +- {np.std(end_ad):.3f} (mean +- std over seeds)\n"
               f"reward curves (5-step means): mean gap between the policies {gap:.3f}, "
               f"mean std between seeds {spread:.3f}")
    text = "\n\n".join([f"{args.seeds} seeds x {args.steps} RL steps, default config"
                        + (f" with {' '.join(args.sets)}" if args.sets else ""), t1, t2, summary])
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    figure(runs, RESULTS / f"{args.name}.png")
    write_result(args.name, dict(
        seeds=args.seeds, steps=args.steps, policy=args.policy, overrides=args.sets,
        stages=[dict(zip(["policy", "seconds", *STAGES, "accept_len", "gen_tokens_per_s"], r)) for r in rows],
        per_seed=per_seed, curve_gap=gap, seed_spread=spread,
        reward_curves={f"{p}/seed{s}": df.reward_mean.round(4).tolist() for (p, s), df in runs.items()}), text)


if __name__ == "__main__":
    main()
