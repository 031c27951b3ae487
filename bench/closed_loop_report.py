"""The table of bench/closed_loop.sh: predicted (simulator) against measured (real runs)
generation-stage gains per policy. Usage: closed_loop_report.py WORK POLICIES SECONDS [NAME].

Each measured run trains its own actor on its own samples, so the runs' workloads drift apart
(one run may generate a tenth more tokens than another): the measured gains
are given both by generation time (what a run pays) and by throughput (tokens per second of
the generation stage, which divides out how much each run generated), beside the simulator's,
which prices every policy on one workload."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import table, write_result  # noqa: E402

from rlsched.traces.reader import read_trace  # noqa: E402


def main() -> None:
    work, policies, seconds = Path(sys.argv[1]), sys.argv[2].split(","), int(sys.argv[3])
    result_name = sys.argv[4] if len(sys.argv) > 4 else "closed_loop"
    pred = {a["policy"]: a for a in json.loads((work / "predicted.json").read_text())["aggregate"]}
    measured = {}
    for p in policies:
        run = work / ("run-" + ("table" if p.startswith("table:") else p.replace(":", "-"))) / "traces"
        rl = read_trace(run, "rl_steps")
        gen, tokens = float(rl.generation_s.sum()), int(read_trace(run, "samples").response_len.sum())
        measured[p] = dict(
            gen=gen,
            total=float(rl.total_s.sum()),
            tokens=tokens,
            tok_s=tokens / gen,
            accept=float(rl.mean_accept_len.mean()),
        )
    static = [p for p in policies if p.startswith("static:")]
    best_pred = min(static, key=lambda p: pred[p]["generation_s"]["mean"])
    best_meas = min(static, key=lambda p: measured[p]["gen"])
    best_tput = max(static, key=lambda p: measured[p]["tok_s"])
    rows, out = [], []
    for p in policies:
        label = "table (learned)" if p.startswith("table:") else p
        ps = pred[p]["speedup_vs_off"]["mean"]
        ms = measured["off"]["gen"] / measured[p]["gen"]
        mt = measured[p]["tok_s"] / measured["off"]["tok_s"]
        pb = pred[best_pred]["generation_s"]["mean"] / pred[p]["generation_s"]["mean"]
        mb = measured[best_meas]["gen"] / measured[p]["gen"]
        rows.append([label, ps, ms, mt, pb, mb, measured[p]["gen"], measured[p]["tokens"], measured[p]["accept"]])
        out.append(
            dict(
                policy=label,
                predicted_speedup=ps,
                measured_speedup=ms,
                measured_throughput_speedup=mt,
                predicted_vs_best_static=pb,
                measured_vs_best_static=mb,
                measured_generation_s=measured[p]["gen"],
                measured_tokens=measured[p]["tokens"],
                measured_total_s=measured[p]["total"],
            )
        )
    head = [
        "policy",
        "predicted x off",
        "measured x off (time)",
        "measured x off (tokens/s)",
        "predicted x best static",
        "measured x best static (time)",
        "measured gen s",
        "tokens",
        "accepted len",
    ]
    text = (
        f"closed loop on CPU in {seconds} s: profile -> fit -> learn -> run ({work}); generation stage; "
        f"best static: predicted {best_pred}, measured {best_meas} by time, {best_tput} by tokens/s\n\n"
        + table(head, rows)
    )
    print(text)
    write_result(
        result_name,
        dict(
            seconds=seconds,
            policies=policies,
            best_static_predicted=best_pred,
            best_static_measured=best_meas,
            best_static_measured_throughput=best_tput,
            rows=out,
        ),
        text,
    )


if __name__ == "__main__":
    main()
