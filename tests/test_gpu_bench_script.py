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


@pytest.mark.parametrize("args, message", [
    (["--device", "cuda", "--sections", "plain,drain"], "plain time CPU peers; on --device cuda choose from drain"),
    (["--sections", "drian"], "--sections: unknown drian"),
])
def test_engine_bench_refuses_sections_it_cannot_run(args, message):
    """bench/engine.py --device cuda runs the drains only (the other sections time CPU peers)."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "engine.py"), *args],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-1000:]


def test_gpu_drain_script_asks_for_the_carried_pair(tmp_path):
    """Without the copied pair the drain stops at once with the way to make it (not a
    ten-minute build on the lent machine's clock)."""
    import shutil

    if shutil.which("bash") is None:
        pytest.skip("no bash")
    work = tmp_path / "checkout"
    (work / "bench").mkdir(parents=True)
    shutil.copy(ROOT / "bench" / "gpu_engine.sh", work / "bench")
    stub = tmp_path / "bin"  # a python3 that says it sees a GPU, and no nvidia-smi
    stub.mkdir()
    (stub / "python3").write_text("#!/bin/sh\necho 'torch (stub) GPU'\n")
    (stub / "python3").chmod(0o755)
    proc = subprocess.run(["bash", str(work / "bench" / "gpu_engine.sh"), "drain"], capture_output=True, text=True,
                          env=dict(os.environ, PATH=f"{stub}:/usr/bin:/bin"), timeout=60)
    assert proc.returncode == 2 and "make .rlsched-cache" in proc.stderr, proc.stderr
