"""DESIGN rule: the simulator, policies, traces, analysis and the CLI's import never load
torch (the simulator installs and runs without it; only rlsched.executor uses torch)."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import importlib, pkgutil, sys
import rlsched.cli
for name in ("rlsched.sim", "rlsched.policies", "rlsched.traces", "rlsched.analysis"):
    pkg = importlib.import_module(name)
    for mod in pkgutil.walk_packages(pkg.__path__, name + "."):
        importlib.import_module(mod.name)
loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
assert not loaded, f"torch imported: {loaded[:3]}"
print("ok")
"""


def test_sim_policies_traces_analysis_cli_do_not_import_torch():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
