"""Simulator fidelity against real runs: replay default `rlsched run`s and compare.

For each seed, the default run (GRPO, built-in pair, adaptive SD: goodput with the model
drafter) and the same run with SD off (no drafter) run in lockstep, one RL step each in turn
in one process; each is then replayed in the simulator (`rlsched replay`: rollouts rebuilt
from its traces, step costs fitted from its own step records). Reported: per-step MAPE and
the worst step of each replay, and the predicted SD speedup of the generation stage beside
the measured one (off run over SD run, same seed), predicted two ways: the SD run's workload
replayed with `off` and with its policy (the counterfactual `rlsched replay` prints), and
each run replayed as it ran, off run over SD run (the measured ratio's own terms: the two RL
runs sample different responses, so their workloads differ by a few percent).

The noise floor: seed 0's off run runs twice (`--repeat`, in the same lockstep); with the
same seed its workload is identical token for token, so the per-step MAPE between the two
measured series is what this machine alone does to a step's time.

Threads: on a 2-vCPU machine a run with torch's two threads waits at every op for the
slower thread, and a neighbour's burst stalls the pair; with one thread (`--set threads=1
--name fidelity_1thread`) the machine's speed per RL step is steadier and the replays'
per-step error smaller.

Run: python bench/fidelity.py [--seeds 2] [--steps 40] [--work DIR] [--repeat 1] [--set KEY=VALUE]
[--name NAME]. Results: bench/results/NAME.{json,txt,png} (default fidelity).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from _common import RESULTS, lockstep, table, write_result  # noqa: E402

from rlsched.analysis.replay import read_run, replay_figure, replay_run  # noqa: E402
from rlsched.executor.rl.config import build_run_config  # noqa: E402
from rlsched.executor.rl.trainer import Trainer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--set", dest="sets", action="append", default=[])
    ap.add_argument("--name", default="fidelity")
    ap.add_argument(
        "--work",
        type=Path,
        default=None,
        help="keep the runs here; finished runs found there are replayed again, not re-run",
    )
    ap.add_argument("--repeat", type=int, default=1, help="runs of seed 0's off run again, for the noise floor")
    args = ap.parse_args()
    rows, out = [], []
    off_sets = ["policy=off", "drafter=off"]
    with tempfile.TemporaryDirectory() as tmp:
        root = args.work or Path(tmp)
        for seed in range(args.seeds):
            dirs = {}
            repeats = [(f"off-repeat{i + 1}", off_sets) for i in range(args.repeat if seed == 0 else 0)]
            todo = []
            for label, over in (("sd", []), ("off", off_sets), *repeats):
                dirs[label] = root / f"{label}-{seed}"
                if not (dirs[label] / "summary.json").is_file():
                    todo.append(
                        (label, build_run_config({}, [f"seed={seed}", f"steps={args.steps}", *over, *args.sets]))
                    )
            if todo:
                print(f"seed {seed}: {', '.join(label for label, _ in todo)} runs, in lockstep ...", flush=True)
                lockstep([Trainer(cfg, dirs[label]) for label, cfg in todo], args.steps)
            sd, off = replay_run(dirs["sd"]), replay_run(dirs["off"])
            measured = off.steps["measured_s"].sum() / sd.steps["measured_s"].sum()
            predicted = sd.predicted_speedup
            both = off.steps["predicted_s"].sum() / sd.steps["predicted_s"].sum()
            floors = [noise_floor(dirs["off"], dirs[label]) for label, _ in repeats]
            speed = {label: machine_speed(dirs[label]) for label in ("sd", "off")}
            for label, r in (("sd", sd), ("off", off)):
                step, err = r.worst
                q1, q3 = np.percentile(speed[label], [25, 75])
                rows.append(
                    [
                        seed,
                        label,
                        r.policy,
                        float(r.steps["measured_s"].sum()),
                        float(r.steps["predicted_s"].sum()),
                        r.mape,
                        f"{step} ({err:+.1f}%)",
                        r.overhead_ms,
                        f"{q1:.2f}-{q3:.2f}",
                    ]
                )
            out.append(
                dict(
                    seed=seed,
                    measured_speedup=float(measured),
                    predicted_speedup=float(predicted),
                    speedup_error_pct=float((predicted / measured - 1) * 100),
                    predicted_speedup_runs=float(both),
                    speedup_error_runs_pct=float((both / measured - 1) * 100),
                    tokens_sd=tokens(dirs["sd"]),
                    tokens_off=tokens(dirs["off"]),
                    noise_floor=floors,
                    mape_sd=sd.mape,
                    mape_off=off.mape,
                    machine_speed=speed,
                    steps_sd=sd.steps.round(5).to_dict("list"),
                    steps_off=off.steps.round(5).to_dict("list"),
                )
            )
            if seed == 0:
                RESULTS.mkdir(parents=True, exist_ok=True)
                from rlsched.analysis.plots import save_figure

                save_figure(replay_figure(sd), RESULTS / f"{args.name}.png")
    t1 = table(
        [
            "seed",
            "run",
            "policy",
            "measured gen s",
            "predicted gen s",
            "per-step MAPE %",
            "worst step",
            "between-step ms",
            "machine speed p25-p75",
        ],
        rows,
    )
    t2 = table(
        [
            "seed",
            "tokens sd / off",
            "measured SD speedup",
            "predicted: SD workload off/policy",
            "error %",
            "predicted: runs replayed",
            "error %",
        ],
        [
            [
                d["seed"],
                f"{d['tokens_sd']:,} / {d['tokens_off']:,}",
                d["measured_speedup"],
                d["predicted_speedup"],
                d["speedup_error_pct"],
                d["predicted_speedup_runs"],
                d["speedup_error_runs_pct"],
            ]
            for d in out
        ],
    )
    mapes = [r[5] for r in rows]
    floors = [f for d in out for f in d["noise_floor"]]
    floor_text = "".join(
        f"\nnoise floor: seed 0's off run twice, same workload ({f['same_workload']:.0%} of samples the same "
        f"length): the two measured series differ by {f['mape_pct']:.1f}% per step (MAPE), "
        f"{f['total_diff_pct']:+.1f}% in total"
        for f in floors
    )
    runs = "default run" + (f" with {', '.join(args.sets)}" if args.sets else "")
    text = (
        f"{args.seeds} seeds x {args.steps} RL steps, {runs}; each run replayed with costs fitted from its "
        f"own step records\n\n{t1}\n\n{t2}\n\nper-step MAPE: mean {np.mean(mapes):.1f}% (max {max(mapes):.1f}%); "
        f"speedup error: mean |{np.mean([abs(d['speedup_error_pct']) for d in out]):.1f}|% (SD workload), "
        f"|{np.mean([abs(d['speedup_error_runs_pct']) for d in out]):.1f}|% (runs replayed){floor_text}\n"
        "machine speed: per RL step, the median of measured / fitted verify time over its engine steps "
        "(`machine_speed`); a wide p25-p75 means the machine ran in spells, which no replay predicts"
    )
    print(text)
    write_result(args.name, dict(seeds=args.seeds, steps=args.steps, overrides=args.sets, rows=out), text)


def tokens(rundir: Path) -> int:
    return int(read_run(rundir)[2]["response_len"].sum())


def machine_speed(rundir: Path) -> list[float]:
    """Per RL step, the median over its decode steps of measured / fitted verify time: how fast
    the machine ran that step's engine steps against the run's own average (1 = as fitted).
    Runs interleaved step by step share its swings; a steady machine keeps it near 1."""
    from rlsched.costs.fit import fit_path
    from rlsched.traces.reader import read_trace

    f = fit_path(rundir).ops["verify"]
    st = read_trace(rundir / "traces", "steps")
    dec = st[(st["kind"] == "decode") & (st["drafted"] == st["batch"] * st["k"])]
    pred = np.asarray(
        f.predict_ms(
            dec["batch"].to_numpy(float),
            (dec["k"] + 1).to_numpy(float),
            (dec["ctx_tokens"] / dec["batch"]).to_numpy(float),
        ),
        dtype=float,
    )
    ratio = dec["verify_ms"].to_numpy(float) / pred
    return dec.assign(ratio=ratio).groupby("rl_step")["ratio"].median().round(4).tolist()


def noise_floor(first: Path, again: Path) -> dict:
    """Per-step MAPE of a rerun's measured generation times against the first run's."""
    _, rl_a, s_a, _ = read_run(first)
    _, rl_b, s_b, _ = read_run(again)
    key = ["rl_step", "sample_id"]
    lens = s_a.sort_values(key)["response_len"].to_numpy(), s_b.sort_values(key)["response_len"].to_numpy()
    same = float(np.mean(lens[0] == lens[1])) if len(lens[0]) == len(lens[1]) else 0.0
    a = rl_a.sort_values("rl_step")["generation_s"].to_numpy(float)
    b = rl_b.sort_values("rl_step")["generation_s"].to_numpy(float)
    n = min(len(a), len(b))
    return dict(
        same_workload=same,
        mape_pct=float(np.mean(np.abs(b[:n] - a[:n]) / a[:n]) * 100),
        total_diff_pct=float((b[:n].sum() / a[:n].sum() - 1) * 100),
    )


if __name__ == "__main__":
    main()
