"""Cost-model fit accuracy on this machine: `rlsched profile` at its defaults (the built-in
pair, batch 1-64 x k 0-6 x contexts 64/192, 12 repeats over 6 passes), then `rlsched fit`,
whose held-out points are every other inner batch size (2, 8, 32), fitted without them and
predicted. Repeated `--runs` times, since one profile on a shared machine is one sample.
`--alt "OPTIONS"` alternates runs with and without further profile options (an A/B in one
hour, e.g. `--alt="--threads 1"`).

Run: python bench/fit_accuracy.py [--runs 2] [--alt OPTIONS] [--name NAME] [-- extra profile
options]. Results: bench/results/NAME.{json,txt} (default fit_accuracy).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import table, write_result  # noqa: E402

RLSCHED = [sys.executable, "-m", "rlsched"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--alt", default="", help="profile options every other run takes (an A/B)")
    ap.add_argument("--name", default="fit_accuracy")
    ap.add_argument("profile_args", nargs="*", help="extra `rlsched profile` options (after --)")
    args = ap.parse_args()
    rows, out = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            prof, cost = Path(tmp) / f"profile-{i}", Path(tmp) / f"cost-{i}.json"
            t = time.perf_counter()
            alt = args.alt.split() if args.alt and i % 2 else []
            label = " ".join(alt)
            subprocess.run(
                [*RLSCHED, "profile", "--out", str(prof), *args.profile_args, *alt], check=True, capture_output=True
            )
            seconds = time.perf_counter() - t
            fit = json.loads(
                subprocess.run(
                    [*RLSCHED, "fit", str(prof), "--out", str(cost), "--json"],
                    check=True,
                    capture_output=True,
                    text=True,
                ).stdout
            )
            ops = fit["ops"]
            row = {k: ops[k]["mape_heldout"] * 100 for k in ops}
            rows.append(
                [
                    i,
                    label or "-",
                    f"{seconds:.0f}",
                    *(f"{row[k]:.1f}" for k in sorted(row)),
                    *(ops[k]["used"] for k in sorted(ops)),
                ]
            )
            out.append(
                dict(
                    run=i,
                    alt=label,
                    profile_s=seconds,
                    heldout_mape_pct=row,
                    used={k: ops[k]["used"] for k in ops},
                    heldout=ops["verify"].get("heldout"),
                )
            )
            print(f"run {i}: {row}", flush=True)
    keys = sorted(out[0]["heldout_mape_pct"])
    text = (
        "`rlsched profile` defaults"
        + (f" + {' '.join(args.profile_args)}" if args.profile_args else "")
        + f", then `rlsched fit`; held-out MAPE % ({out[0]['heldout']})\n\n"
        + table(["run", "options", "profile s", *[f"{k} %" for k in keys], *[f"{k} form" for k in keys]], rows)
    )
    print(text)
    write_result(args.name, dict(runs=out, profile_args=args.profile_args, alt=args.alt), text)


if __name__ == "__main__":
    main()
