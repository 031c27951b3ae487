"""bench/gpu_engine.py is run on a lent GPU only; its --smoke mode runs the same code on the
CPU with tiny shapes, so that the prepared script is known to work before device time is spent."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent


# The lent machine's image has torch, numpy, pandas, scipy, safetensors and tokenizers, but not
# pydantic, simpy, typer or yaml (/work/.library/device/KINDS.md): the script runs here with
# those unimportable. (rlsched.errors imported pydantic at the top, for a type: the script
# would have stopped at its first import there.)
ABSENT_ON_DEVICE = ("pydantic", "pydantic_core", "simpy", "typer", "yaml")
RUN_WITHOUT = """
import runpy, sys
absent = set(sys.argv[1].split(","))
class Absent:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in absent:
            raise ImportError(f"{name} is not installed on the device machine")
sys.meta_path.insert(0, Absent())
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_gpu_engine_script_smoke_runs_on_cpu(tmp_path):
    proc = subprocess.run([sys.executable, "-c", RUN_WITHOUT, ",".join(ABSENT_ON_DEVICE),
                           str(ROOT / "bench" / "gpu_engine.py"), "--device", "cpu", "--smoke",
                           "--batch-sizes", "1,4", "--k-max", "2", "--context", "16", "--tokens", "4"],
                          env=dict(os.environ, OUT=str(tmp_path)), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((tmp_path / "gpu_engine.json").read_text())
    kinds = {r["kind"] for r in result["profile"]}
    assert kinds == {"prefill", "feed", "verify", "draft"}
    assert [p["batch"] for p in result["plain"]] == [1, 4] and all(p["tok_s"] > 0 for p in result["plain"])
    assert "verify ms by batch" in (tmp_path / "gpu_engine.txt").read_text()
    assert result["compiled_b1"].get("tok_s", 0) > 0, result["compiled_b1"]  # on the CPU it must work
    assert [r["batch"] for r in result["compiled_plain"]] == [1, 4] and all(r["tok_s"] > 0 for r in result["compiled_plain"])
