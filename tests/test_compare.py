"""`rlsched compare` end to end, through the real entry point (`python -m rlsched`) in a
subprocess: JSON report and ratios, worker-count invariance, plot, output folder, Ray path
(with a stand-in `ray` module) and bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pandas as pd
import pytest
from support import ok, rlsched, snapshot

SMALL = ["--preset", "default", "--set", "workload.prompts=8", "--set", "rl.steps=1", "--seeds", "2"]
POLICIES = ["--policies", "off,static:2,static:4,goodput"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

FAKE_RAY = '''
"""A stand-in for Ray that runs tasks inline and logs its calls (tests only)."""
import os

_up = False


def _log(line):
    with open(os.environ["FAKE_RAY_LOG"], "a") as f:
        f.write(line + "\\n")


def is_initialized():
    return _up


def init(address=None, **kwargs):
    global _up
    _log(f"init {address}")
    _up = True


def shutdown():
    global _up
    _log("shutdown")
    _up = False


class _Ref:
    def __init__(self, value):
        self.value = value


def put(value):
    return _Ref(value)


def remote(**options):
    def wrap(fn):
        class Remote:
            def remote(self, *args):
                _log("task")
                return _Ref(fn(*[a.value if isinstance(a, _Ref) else a for a in args]))
        return Remote()
    return wrap


def wait(refs, num_returns=1):
    return refs[:num_returns], refs[num_returns:]


def get(ref):
    return ref.value
'''


def agg(report: dict, policy: str, realloc: str = "none") -> dict:
    return next(a for a in report["aggregate"] if a["policy"] == policy and a["realloc"] == realloc)


@pytest.fixture(scope="module")
def serial(tmp_path_factory):
    """One compare run, serial, with --json, --plot and --out."""
    cwd = tmp_path_factory.mktemp("serial")
    proc = ok(
        rlsched("compare", *SMALL, *POLICIES, "--workers", "1", "--json", "--plot", "fig.png", "--out", "cmp", cwd=cwd)
    )
    return cwd, proc, json.loads(proc.stdout)


def test_json_report_holds_per_policy_ratios(serial):
    cwd, proc, report = serial
    assert report["policies"] == ["off", "static:2", "static:4", "goodput"]
    assert report["seeds"] == [0, 1] and report["realloc"] == ["none"]
    assert not report["baseline_added"]
    assert report["static_policies"] == ["static:2", "static:4"]
    assert len(report["runs"]) == 4 * 2
    for p in report["policies"]:
        a = agg(report, p)
        assert a["seeds"] == 2
        for key in (
            "generation_s",
            "tokens_per_s",
            "speedup_vs_off",
            "ratio_vs_best_static",
            "mean_accept_len",
            "sd_step_fraction",
            "migrations",
        ):
            assert a[key] is not None and set(a[key]) >= {"mean", "std", "min", "max"}, (p, key)
        assert a["speedup_vs_off"]["min"] <= a["speedup_vs_off"]["mean"] <= a["speedup_vs_off"]["max"]
    # the baseline against itself: exactly 1, per seed and on average
    assert agg(report, "off")["speedup_vs_off"]["mean"] == 1.0
    assert agg(report, "off")["speedup_vs_off"]["per_seed"] == [1.0, 1.0]
    # speculation helps on this small job, and each ratio is off's time / the policy's on the same seed
    assert agg(report, "goodput")["speedup_vs_off"]["mean"] > 1.0
    runs = {(r["policy"], r["seed"]): r for r in report["runs"]}
    for (_, s), r in runs.items():
        off = runs[("off", s)]["summary"]["generation_s"]
        assert r["speedup_vs_off"] == pytest.approx(off / r["summary"]["generation_s"], rel=1e-12)
    # the table went to stderr, the JSON alone to stdout
    assert "x best static" in proc.stderr and "rlsched compare" in proc.stderr


def test_best_static_is_chosen_per_seed(serial):
    _, _, report = serial
    runs = {(r["policy"], r["seed"]): r for r in report["runs"]}
    for best in report["best_static_per_seed"]:
        s = best["seed"]
        times = {p: runs[(p, s)]["summary"]["generation_s"] for p in report["static_policies"]}
        assert best["policy"] == min(times, key=times.get)
        assert runs[(best["policy"], s)]["ratio_vs_best_static"] == 1.0
        for p in report["policies"]:
            assert runs[(p, s)]["best_static"] == best["policy"]
            expect = times[best["policy"]] / runs[(p, s)]["summary"]["generation_s"]
            assert runs[(p, s)]["ratio_vs_best_static"] == pytest.approx(expect, rel=1e-12)
        for p in report["static_policies"]:
            assert runs[(p, s)]["ratio_vs_best_static"] <= 1.0


def test_workers_do_not_change_the_numbers(serial, tmp_path):
    _, _, report = serial
    parallel = json.loads(ok(rlsched("compare", *SMALL, *POLICIES, "--workers", "2", "--json", cwd=tmp_path)).stdout)
    assert parallel["runs"] == report["runs"]
    assert parallel["aggregate"] == report["aggregate"]


def test_plot_and_output_folder(serial):
    cwd, _, report = serial
    png = (cwd / "fig.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 10_000
    assert {p.name for p in (cwd / "cmp").iterdir()} == {"compare.json", "compare.parquet"}
    assert json.loads((cwd / "cmp" / "compare.json").read_text())["runs"] == report["runs"]
    df = pd.read_parquet(cwd / "cmp" / "compare.parquet")
    assert len(df) == len(report["runs"])
    assert (df.loc[df["policy"] == "off", "speedup_vs_off"] == 1.0).all()
    assert set(df.columns) >= {
        "policy",
        "realloc",
        "seed",
        "generation_s",
        "tokens_per_s",
        "speedup_vs_off",
        "ratio_vs_best_static",
        "mean_accept_len",
        "sd_step_fraction",
        "migrations",
    }
    assert not [p for p in cwd.iterdir() if p.name.startswith(".")], "temporary files left behind"


def test_plot_as_pdf(serial, tmp_path):
    from rlsched.analysis.plots import plot_compare

    _, _, report = serial
    trace = {
        "label": "goodput",
        "seed": 0,
        "instance": 0,
        "rl_step": 0,
        "time_s": [0.0, 1.0, 2.5],
        "batch": [32, 20, 4],
        "k": [2, 4, 6],
        "end_s": 3.0,
    }
    plot_compare(report, [trace], tmp_path / "f.pdf")
    assert (tmp_path / "f.pdf").read_bytes().startswith(b"%PDF")


def test_baseline_added_and_no_static(tmp_path):
    proc = ok(
        rlsched("compare", *SMALL[:-1], "1", "--policies", "goodput:1", "--realloc", "none,rebalance", cwd=tmp_path)
    )
    out = proc.stdout
    assert "added as the baseline" in out and "no static:K policy" in out
    for name in ("off", "goodput:1", "rebalance"):
        assert name in out
    assert snapshot(tmp_path) == set(), "nothing is written without --out/--plot"


def test_ray_runs_the_same_numbers(serial, tmp_path):
    _, _, report = serial
    (tmp_path / "fake" / "ray").mkdir(parents=True)
    (tmp_path / "fake" / "ray" / "__init__.py").write_text(FAKE_RAY)
    log = tmp_path / "ray.log"
    env = {
        "PYTHONPATH": os.pathsep.join([str(tmp_path / "fake"), os.environ.get("PYTHONPATH", "")]),
        "FAKE_RAY_LOG": str(log),
    }
    proc = ok(rlsched("compare", *SMALL, *POLICIES, "--ray", "auto", "--json", cwd=tmp_path, env_extra=env))
    assert json.loads(proc.stdout)["runs"] == report["runs"]
    calls = log.read_text().splitlines()
    assert calls[0] == "init auto" and calls[-1] == "shutdown" and calls.count("task") == len(report["runs"])


BAD = [
    ("unknown-policy", ["--policies", "off,bogus-policy"], [], ["--policies", "bogus-policy"]),
    ("bad-static-k", ["--policies", "static:x"], [], ["--policies", "static:x"]),
    ("empty-policy-name", ["--policies", "off,,goodput"], [], ["--policies"]),
    ("unknown-realloc", ["--realloc", "none,bogus-realloc"], [], ["--realloc", "bogus-realloc"]),
    ("zero-seeds", ["--seeds", "0"], [], ["--seeds"]),
    ("zero-workers", ["--workers", "0"], [], ["--workers"]),
    ("negative-first-seed", ["--first-seed", "-1"], [], ["--first-seed"]),
    ("plot-suffix", ["--plot", "fig.jpg"], [], ["--plot", "fig.jpg"]),
    ("bad-config-field", ["--set", "cluster.max_batch=0"], [], ["cluster.max_batch"]),
    ("ray-missing", ["--ray", "auto"], ["ray"], ["--ray", "pip install 'rlsched[distributed]'"]),
    # nothing listens on port 1: one line at once, not ray.init's minutes of retries
    ("ray-unreachable", ["--ray", "127.0.0.1:1"], [], ["--ray", "127.0.0.1:1", "ray start --head"]),
    ("ray-not-an-address", ["--ray", "my-cluster"], [], ["--ray", "host:port"]),
]


@pytest.mark.parametrize("args,broken,names", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_input(tmp_path, args, broken, names):
    env = {}
    if broken:  # modules that fail to import, whether or not they are installed
        fake = tmp_path / "fake"
        fake.mkdir()
        for mod in broken:
            (fake / f"{mod}.py").write_text(f"raise ImportError('no {mod} here')\n")
        env["PYTHONPATH"] = os.pathsep.join([str(fake), os.environ.get("PYTHONPATH", "")])
    before = snapshot(tmp_path)
    base = ["--preset", "default", "--set", "workload.prompts=8", "--set", "rl.steps=1", "--seeds", "1"]
    proc = rlsched(
        "compare",
        *base,
        "--policies",
        "off,static:2",
        "--out",
        "out",
        "--plot",
        "fig.png",
        *args,
        "--json",
        cwd=tmp_path,
        env_extra=env,
    )
    detail = f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.returncode == 2, detail
    assert proc.stdout == "", detail
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, detail
    for name in names:
        assert name in lines[0], detail
    assert snapshot(tmp_path) == before, "nothing may be written"


def test_real_ray_gives_the_serial_numbers(tmp_path):
    pytest.importorskip("ray")
    args = [
        "compare",
        "--set",
        "workload.prompts=8",
        "--set",
        "rl.steps=1",
        "--seeds",
        "2",
        "--policies",
        "off,static:2,goodput",
        "--json",
    ]
    ray_run = subprocess.run(
        [sys.executable, "-m", "rlsched", *args, "--ray", "local"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=1800,
    )
    serial = subprocess.run(
        [sys.executable, "-m", "rlsched", *args, "--workers", "1"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=1800,
    )
    assert ray_run.returncode == 0, ray_run.stderr
    a, b = json.loads(ray_run.stdout), json.loads(serial.stdout)
    assert [r["summary"] for r in a["runs"]] == [r["summary"] for r in b["runs"]]
