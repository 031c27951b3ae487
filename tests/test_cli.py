"""End-to-end tests of the `rlsched` command line, run through the real entry point
(`python -m rlsched`) in a subprocess with a temporary working directory."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pandas as pd
import pytest
import yaml
from support import ok, rlsched

from rlsched import __version__
from rlsched.config import load_preset_data
from rlsched.traces import read_trace

SMALL = ["--set", "rl.steps=1", "--set", "workload.prompts=8"]
RUN_FILES = {"timeline.parquet", "samples.parquet", "rl_steps.parquet", "summary.json", "config.yaml", "meta.json"}


def small_config_data() -> dict:
    """The default job preset, shrunk so that a run takes a second or two."""
    data = load_preset_data("jobs", "default")
    data["workload"]["prompts"] = 4
    data["workload"]["samples_per_prompt"] = 4
    data["rl"]["steps"] = 1
    data["name"] = "small-from-file"
    return data


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a valid TOML basic string
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {v!r} as TOML")


def dump_toml(data: dict) -> str:
    """A minimal TOML writer (no tomli_w here): every top-level key on one line, nested values inline."""
    return "".join(f"{k} = {_toml_value(v)}\n" for k, v in data.items() if v is not None)


# ----------------------------------------------------------------------------- help, version, presets


def test_version(tmp_path):
    proc = ok(rlsched("--version", cwd=tmp_path))
    assert proc.stdout.strip() == f"rlsched {__version__}"


@pytest.mark.parametrize("args", [["--help"], ["simulate", "--help"], ["presets", "--help"]])
def test_help_exits_zero(tmp_path, args):
    proc = ok(rlsched(*args, cwd=tmp_path))
    assert "Usage" in proc.stdout
    assert list(tmp_path.iterdir()) == []


def test_help_lists_commands_and_options(tmp_path):
    app_help = ok(rlsched("--help", cwd=tmp_path)).stdout
    assert "simulate" in app_help and "presets" in app_help
    sim_help = ok(rlsched("simulate", "--help", cwd=tmp_path)).stdout
    for opt in ("--preset", "--config", "--set", "--policy", "--realloc", "--out", "--seed", "--json"):
        assert opt in sim_help


def test_presets_lists_job_presets(tmp_path):
    out = ok(rlsched("presets", cwd=tmp_path)).stdout
    assert "default" in out
    assert "longtail-grpo" in out


def test_presets_show_default_prints_yaml(tmp_path):
    out = ok(rlsched("presets", "--show", "default", cwd=tmp_path)).stdout
    data = yaml.safe_load(out)
    assert isinstance(data, dict)
    assert "hardware" in data
    assert data["hardware"]["name"] == "h100-sxm"  # resolved, not just the preset name
    assert data["name"] == "default"


# ----------------------------------------------------------------------------- simulate


@pytest.fixture(scope="module")
def json_run(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("json_run")
    proc = ok(rlsched("simulate", "--json", "--out", "out", *SMALL, cwd=cwd))
    return proc, cwd / "out"


def test_simulate_json_stdout_is_only_json(json_run):
    proc, _ = json_run
    summary = json.loads(proc.stdout)  # fails if anything else is printed on stdout
    assert isinstance(summary, dict)
    for key in ("generation_s", "tokens_per_s", "speedup_vs_off", "mean_accept_len", "idle_fraction", "time_split"):
        assert key in summary, key
    assert summary["generation_s"] > 0
    assert summary["tokens_per_s"] > 0
    assert summary["speedup_vs_off"] > 0
    assert summary["rl_steps"] == 1
    assert isinstance(summary["idle_fraction"], list)
    assert all(0.0 <= f <= 1.0 for f in summary["idle_fraction"])
    assert isinstance(summary["time_split"], dict)
    assert sum(summary["time_split"].values()) == pytest.approx(1.0, abs=1e-6)


def test_simulate_writes_the_run_folder(json_run):
    proc, out = json_run
    assert out.is_dir()
    assert {p.name for p in out.iterdir()} >= RUN_FILES
    on_disk = json.loads((out / "summary.json").read_text())
    printed = json.loads(proc.stdout)
    assert on_disk == printed
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    assert cfg["workload"]["prompts"] == 8 and cfg["rl"]["steps"] == 1
    meta = json.loads((out / "meta.json").read_text())
    assert meta["rlsched"] == __version__
    # no temporary siblings left behind
    assert [p.name for p in out.parent.iterdir()] == ["out"]


def test_timeline_tokens_match_samples(json_run):
    _, out = json_run
    steps = read_trace(out / "timeline.parquet", "steps")
    samples = read_trace(out / "samples.parquet", "samples")
    assert len(steps) > 0
    assert (steps["kind"] == "decode").any()
    decoded = int(steps.loc[steps["kind"] == "decode", "emitted"].sum())
    assert decoded > 0
    assert decoded == int(samples["response_len"].sum())
    summary = json.loads((out / "summary.json").read_text())
    assert len(samples) == summary["samples_per_step"] * summary["rl_steps"]


def test_rl_steps_trace_reads(json_run):
    _, out = json_run
    rl = read_trace(out / "rl_steps.parquet", "rl_steps")
    assert len(rl) == 1
    assert rl["generation_s"].iloc[0] > 0


def _summary_without_out(path: Path) -> dict:
    s = json.loads(path.read_text())
    s.pop("out", None)
    return s


def test_same_seed_same_summary_different_seed_differs(tmp_path):
    for name, seed in (("a", "5"), ("b", "5"), ("c", "6")):
        ok(rlsched("simulate", "--json", "--seed", seed, "--out", name, *SMALL, cwd=tmp_path))
    a = _summary_without_out(tmp_path / "a" / "summary.json")
    b = _summary_without_out(tmp_path / "b" / "summary.json")
    c = _summary_without_out(tmp_path / "c" / "summary.json")
    assert a["seed"] == 5 and c["seed"] == 6
    assert a == b
    assert a != c
    assert {k: v for k, v in a.items() if k != "seed"} != {k: v for k, v in c.items() if k != "seed"}


def test_samples_identical_for_same_seed(tmp_path):
    for name in ("a", "b"):
        ok(rlsched("simulate", "--json", "--seed", "3", "--no-baseline", "--out", name, *SMALL, cwd=tmp_path))
    sa = pd.read_parquet(tmp_path / "a" / "samples.parquet")
    sb = pd.read_parquet(tmp_path / "b" / "samples.parquet")
    pd.testing.assert_frame_equal(sa, sb)


@pytest.mark.parametrize("fmt", ["yaml", "toml"])
def test_config_file_runs(tmp_path, fmt):
    data = small_config_data()
    path = tmp_path / f"job.{fmt}"
    if fmt == "yaml":
        path.write_text(yaml.safe_dump(data, sort_keys=False))
    else:
        path.write_text(dump_toml(data))
        assert tomllib.loads(path.read_text()) == data  # the test's TOML writer round-trips
    proc = ok(rlsched("simulate", "--json", "--config", path.name, "--out", "out", cwd=tmp_path))
    summary = json.loads(proc.stdout)
    assert summary["name"] == "small-from-file"
    assert summary["samples_per_step"] == 16
    assert summary["rl_steps"] == 1
    assert {p.name for p in (tmp_path / "out").iterdir()} >= RUN_FILES


def test_config_file_with_overrides(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(small_config_data(), sort_keys=False))
    proc = ok(
        rlsched(
            "simulate",
            "--json",
            "--config",
            str(path),
            "--set",
            "workload.prompts=2",
            "--policy",
            "off",
            "--out",
            "out",
            cwd=tmp_path,
        )
    )
    summary = json.loads(proc.stdout)
    assert summary["samples_per_step"] == 8
    assert summary["policy"] == "off"
    assert summary["speedup_vs_off"] == 1.0
