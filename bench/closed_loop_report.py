"""The table of bench/closed_loop.sh: predicted (simulator) against measured (real runs)
generation-stage gains per policy. Usage: closed_loop_report.py WORK POLICIES SECONDS."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import table, write_result  # noqa: E402

from rlsched.traces.reader import read_trace  # noqa: E402


def main() -> None:
    work, policies, seconds = Path(sys.argv[1]), sys.argv[2].split(","), int(sys.argv[3])
    pred = {a["policy"]: a for a in json.loads((work / "predicted.json").read_text())["aggregate"]}
    measured = {}
    for p in policies:
        name = "table" if p.startswith("table:") else p.replace(":", "-")
        rl = read_trace(work / f"run-{name}" / "traces", "rl_steps")
        measured[p] = dict(gen=float(rl.generation_s.sum()), total=float(rl.total_s.sum()),
                           accept=float(rl.mean_accept_len.mean()))
    static = [p for p in policies if p.startswith("static:")]
    best_pred = min(static, key=lambda p: pred[p]["generation_s"]["mean"])
    best_meas = min(static, key=lambda p: measured[p]["gen"])
    rows, out = [], []
    for p in policies:
        label = "table (learned)" if p.startswith("table:") else p
        ps = pred[p]["speedup_vs_off"]["mean"]
        ms = measured["off"]["gen"] / measured[p]["gen"]
        pb = pred[best_pred]["generation_s"]["mean"] / pred[p]["generation_s"]["mean"]
        mb = measured[best_meas]["gen"] / measured[p]["gen"]
        rows.append([label, ps, ms, pb, mb, measured[p]["gen"], measured[p]["accept"]])
        out.append(dict(policy=label, predicted_speedup=ps, measured_speedup=ms, predicted_vs_best_static=pb,
                        measured_vs_best_static=mb, measured_generation_s=measured[p]["gen"],
                        measured_total_s=measured[p]["total"]))
    head = ["policy", "predicted x off", "measured x off", "predicted x best static", "measured x best static",
            "measured gen s", "accepted len"]
    text = (f"closed loop on CPU in {seconds} s: profile -> fit -> learn -> run ({work}); generation stage; "
            f"best static: predicted {best_pred}, measured {best_meas}\n\n" + table(head, rows))
    print(text)
    write_result("closed_loop", dict(seconds=seconds, policies=policies, best_static_predicted=best_pred,
                                     best_static_measured=best_meas, rows=out), text)


if __name__ == "__main__":
    main()
