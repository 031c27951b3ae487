"""DESIGN rule: the simulator, policies, traces, analysis and the CLI's import never load
torch (the simulator installs and runs without it; only rlsched.executor uses torch)."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import importlib, pkgutil, sys
import rlsched.cli
for name in ("rlsched.sim", "rlsched.policies", "rlsched.traces", "rlsched.analysis", "rlsched.tasks", "rlsched.plan"):
    pkg = importlib.import_module(name)
    for mod in pkgutil.walk_packages(pkg.__path__, name + "."):
        importlib.import_module(mod.name)
loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
assert not loaded, f"torch imported: {loaded[:3]}"
print("ok")
"""


def test_sim_policies_traces_analysis_cli_do_not_import_torch():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


NO_TORCH = """
import sys
sys.modules["torch"] = None  # as if the executor extra were not installed: import torch fails
import importlib.util
real = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a: None if name == "torch" else real(name, *a)
sys.argv = ["rlsched", "generate", "--out", OUT]
from rlsched.cli import main
main()
"""


def test_executor_commands_without_torch_say_what_to_install(tmp_path):
    code = NO_TORCH.replace("OUT", repr(str(tmp_path / "out")))
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=1800,
        env={"COLUMNS": "300", "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert "needs the executor extra (torch is missing): pip install 'rlsched[executor]'" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


FIT_NO_TORCH = """
import sys
sys.modules["torch"] = None  # import torch fails: fitting and --cost must not need it
sys.argv = ["rlsched", "fit", PROF, "--out", OUT, "--plot", PLOT]
from rlsched.cli import main
try:
    main()
except SystemExit as e:
    assert not e.code, e.code
from rlsched.config import load_config
from rlsched.sim.simulate import simulate
cfg = load_config("default", overrides=["rl.steps=1", "workload.prompts=4", "cost_file=" + OUT])
assert simulate(cfg, "goodput").cost.kind == "fitted"
"""


def test_fit_and_simulate_on_its_file_without_torch(tmp_path):
    from test_fit import profile_records, write_steps

    prof = write_steps(tmp_path / "prof", profile_records())
    code = (
        FIT_NO_TORCH.replace("PROF", repr(str(prof)))
        .replace("OUT", repr(str(tmp_path / "cm.json")))
        .replace("PLOT", repr(str(tmp_path / "fit.png")))
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "cm.json").is_file() and (tmp_path / "fit.png").is_file()


PLOT_NO_TORCH = """
import sys
sys.modules["torch"] = None  # import torch fails: plots (and reports: the same figures) must not need it
sys.argv = ["rlsched", "plot", PROF, "--out", OUT]
from rlsched.cli import main
try:
    main()
except SystemExit as e:
    assert not e.code, e.code
"""


def test_plot_of_a_profile_without_torch(tmp_path):
    from test_fit import profile_records, write_steps

    records = profile_records()
    records = records[(records.ctx_tokens == records.batch * 64) & (records.k <= 3)]  # small: quick to fit and draw
    prof = write_steps(tmp_path / "prof", records)
    code = PLOT_NO_TORCH.replace("PROF", repr(str(prof))).replace("OUT", repr(str(tmp_path / "figs")))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "figs").iterdir()) == ["fit.pdf", "fit.png", "speedup.pdf", "speedup.png"]
