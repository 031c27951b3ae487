"""Drafter updates on a fixed interval against the ski-rental schedule (`pays`), in the simulator.

The GPU jobs of the presets (`default`: H100, Qwen2.5-7B + 0.5B drafter; `eagle-h200-14b`),
20 RL steps each, at no drift, the preset's drift and twice it, with the update overlapped
with the next rollout (TLT) or on the critical path: RL time of `pays` against `every` (the
preset's interval), the updates each made, the drafter's mean acceptance over the steps.
The CPU side of the same question (real runs) is `bench/rl_e2e.py`'s `builtin` against
`builtin/every`.

Usage: python bench/drafter_schedule.py [--steps 20]. Results: bench/results/drafter_schedule.{json,txt}.
"""

from __future__ import annotations

import argparse
import sys
import time

from _common import table, write_result

from rlsched.config import load_config
from rlsched.sim.simulate import simulate

PRESETS = ("default", "eagle-h200-14b")


def run(preset: str, steps: int, drift: float, overlap: bool, schedule: str) -> dict:
    cfg = load_config(
        preset,
        overrides=[
            f"rl.steps={steps}",
            f"rl.acceptance_drift_per_step={drift}",
            f"rl.overlap_drafter_update={str(overlap).lower()}",
            f"rl.drafter_update_schedule={schedule}",
        ],
    )
    st = simulate(cfg).steps_frame()
    accept = [c for c in st.columns if c.startswith("accept_mean_")]
    return dict(
        total_s=float(st.total_s.sum()),
        generation_s=float(st.generation_s.sum()),
        exposed_update_s=float(st.drafter_update_s.sum()),
        accept_mean=float(st[accept[0]].mean()) if accept else float("nan"),
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    t0 = time.time()
    rows, data = [], []
    for preset in PRESETS:
        base = load_config(preset).rl
        for drift in (0.0, base.acceptance_drift_per_step, 2 * base.acceptance_drift_per_step):
            for overlap in (True, False):
                every, pays = (run(preset, args.steps, drift, overlap, s) for s in ("every", "pays"))
                data.append(
                    dict(
                        preset=preset,
                        interval=base.drafter_update_interval,
                        drift=drift,
                        overlap=overlap,
                        every=every,
                        pays=pays,
                        pays_vs_every=every["total_s"] / pays["total_s"],
                    )
                )
                rows.append(
                    [
                        preset,
                        base.drafter_update_interval,
                        f"{drift:.3f}",
                        "yes" if overlap else "no",
                        f"{every['total_s']:.0f}",
                        f"{pays['total_s']:.0f}",
                        f"{every['total_s'] / pays['total_s']:.3f}x",
                        f"{every['exposed_update_s']:.0f} / {pays['exposed_update_s']:.0f}",
                        f"{every['accept_mean']:.3f} / {pays['accept_mean']:.3f}",
                    ]
                )
    text = table(
        [
            "preset",
            "every",
            "drift/step",
            "overlap",
            "every RL s",
            "pays RL s",
            "pays speedup",
            "exposed update s every / pays",
            "mean acceptance every / pays",
        ],
        rows,
    )
    text = f"{args.steps} RL steps per run; RL time summed over steps (simulated)\n" + text
    print(text + f"\n\n({time.time() - t0:.0f} s)")
    path = write_result("drafter_schedule", {"steps": args.steps, "rows": data}, text)
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
