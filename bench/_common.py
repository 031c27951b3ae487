"""Shared by the benchmark scripts: machine facts, result files, a plain-text table."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import subprocess
from datetime import UTC, datetime
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def machine() -> dict:
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor()
    try:
        here = Path(__file__).parent
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=here
        ).stdout.strip()
        # code changed since that commit (results excluded): the figures are not that commit's
        changed = (
            subprocess.run(
                ["git", "diff", "--quiet", "HEAD", "--", "rlsched", "bench", ":(exclude)bench/results"], cwd=here.parent
            ).returncode
            == 1
        )
        commit += "+uncommitted" if commit and changed else ""
    except OSError:
        commit = ""
    return {
        "host": platform.node(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": commit,
    }


def table(headers: list[str], rows: list[list]) -> str:
    cells = [[str(h) for h in headers]] + [[f"{c:.3f}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_result(name: str, payload: dict, text: str, folder: Path | None = None) -> Path:
    """bench/results/NAME.json (machine, date, numbers) and NAME.txt (the printed table), or
    in `folder`."""
    folder = RESULTS if folder is None else Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    payload = {"machine": machine(), **payload}
    (folder / f"{name}.json").write_text(json.dumps(payload, indent=2))
    (folder / f"{name}.txt").write_text(f"{payload['machine']}\n\n{text}\n")
    return folder / f"{name}.json"


def lockstep(trainers: list, steps: int) -> None:
    """The runs one RL step each in turn: a slow spell of this shared machine then hits every
    run, not the one it fell on (identical runs minutes apart differ by several percent)."""
    with contextlib.ExitStack() as stack:
        for t in trainers:
            stack.enter_context(t)
        for s in range(steps):
            for t in trainers:
                t.step(s)
    for t in trainers:
        t.finish()
