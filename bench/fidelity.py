"""Simulator fidelity against real runs: replay default `rlsched run`s and compare.

For each seed, the default run (GRPO, built-in pair, adaptive SD: goodput with the model
drafter) and the same run with SD off (no drafter) are run one after the other; each is then
replayed in the simulator (`rlsched replay`: rollouts rebuilt from its traces, step costs
fitted from its own step records). Reported: per-step MAPE and the worst step of each
replay, and the predicted SD speedup of the generation stage (the SD run replayed with its
policy and with `off`) beside the measured one (off run over SD run, same seed).

Run: python bench/fidelity.py [--seeds 2] [--steps 40] [--work DIR]. Results: bench/results/fidelity.{json,txt,png}.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from _common import RESULTS, table, write_result  # noqa: E402

from rlsched.analysis.replay import replay_figure, replay_run  # noqa: E402
from rlsched.executor.rl.config import build_run_config  # noqa: E402
from rlsched.executor.rl.trainer import Trainer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--set", dest="sets", action="append", default=[])
    ap.add_argument("--name", default="fidelity")
    ap.add_argument("--work", type=Path, default=None, help="keep the runs here; finished runs found there are "
                    "replayed again, not re-run")
    args = ap.parse_args()
    rows, out = [], []
    with tempfile.TemporaryDirectory() as tmp:
        root = args.work or Path(tmp)
        for seed in range(args.seeds):
            dirs = {}
            for label, over in (("sd", []), ("off", ["policy=off", "drafter=off"])):
                dirs[label] = root / f"{label}-{seed}"
                if (dirs[label] / "summary.json").is_file():
                    continue
                print(f"seed {seed}: {label} run ...", flush=True)
                cfg = build_run_config({}, [f"seed={seed}", f"steps={args.steps}", *over, *args.sets])
                Trainer(cfg, dirs[label]).run()
            sd, off = replay_run(dirs["sd"]), replay_run(dirs["off"])
            measured = off.steps["measured_s"].sum() / sd.steps["measured_s"].sum()
            predicted = sd.predicted_speedup
            for label, r in (("sd", sd), ("off", off)):
                step, err = r.worst
                rows.append([seed, label, r.policy, float(r.steps["measured_s"].sum()),
                             float(r.steps["predicted_s"].sum()), r.mape, f"{step} ({err:+.1f}%)", r.overhead_ms])
            out.append(dict(seed=seed, measured_speedup=float(measured), predicted_speedup=float(predicted),
                            speedup_error_pct=float((predicted / measured - 1) * 100),
                            mape_sd=sd.mape, mape_off=off.mape,
                            steps_sd=sd.steps.round(5).to_dict("list"), steps_off=off.steps.round(5).to_dict("list")))
            if seed == 0:
                RESULTS.mkdir(parents=True, exist_ok=True)
                from rlsched.analysis.plots import save_figure

                save_figure(replay_figure(sd), RESULTS / f"{args.name}.png")
    t1 = table(["seed", "run", "policy", "measured gen s", "predicted gen s", "per-step MAPE %", "worst step",
                "between-step ms"], rows)
    t2 = table(["seed", "measured SD speedup", "predicted", "error %"],
               [[d["seed"], d["measured_speedup"], d["predicted_speedup"], d["speedup_error_pct"]] for d in out])
    mapes = [r[5] for r in rows]
    text = (f"{args.seeds} seeds x {args.steps} RL steps, default run; each run replayed with costs fitted from its "
            f"own step records\n\n{t1}\n\n{t2}\n\nper-step MAPE: mean {np.mean(mapes):.1f}% (max {max(mapes):.1f}%); "
            f"speedup error: mean |{np.mean([abs(d['speedup_error_pct']) for d in out]):.1f}|%")
    print(text)
    write_result(args.name, dict(seeds=args.seeds, steps=args.steps, overrides=args.sets, rows=out), text)


if __name__ == "__main__":
    main()
