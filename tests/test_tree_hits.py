"""bench/tree_hits.py: its fit recovers the tree model's (a, gain), and the script runs."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("scipy")

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "tree_hits.py"


def _bench():
    spec = importlib.util.spec_from_file_location("tree_hits_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("a, gain", [(0.78, 0.25), (0.5, 0.1), (0.9, 0.6), (0.3, 0.3)])
def test_fit_recovers_the_model(a, gain):
    bench = _bench()
    r = np.arange(1, 9)
    h = 1 - (1 - a) * (1 - gain) ** (r - 1)  # closed form
    assert bench.tree_hits(a, gain, 8) == pytest.approx(h)
    fit = bench.fit_tree(h)
    assert fit["a"] == pytest.approx(a, abs=1e-5) and fit["gain"] == pytest.approx(gain, abs=1e-5)
    assert fit["rmse"] < 1e-6
    assert bench.fit_tree(h, a=a)["gain"] == pytest.approx(gain, abs=1e-5)


def test_hit_rates_count_ranks():
    bench = _bench()
    h = bench.hit_rates(np.array([1, 1, 2, 5, 20]))
    assert len(h) == bench.R_MAX
    assert list(h[:5]) == pytest.approx([0.4, 0.6, 0.6, 0.6, 0.8]) and h[-1] == pytest.approx(0.8)


def test_smoke_runs(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke"],
        env=dict(os.environ, OUT=str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=1800,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((tmp_path / "tree_hits.json").read_text())
    h = result["h_measured"]
    assert len(h) == 16 and all(x <= y for x, y in zip(h, h[1:])) and 0 < result["chain_acceptance"] <= 1
    assert "measured h_r" in (tmp_path / "tree_hits.txt").read_text()
