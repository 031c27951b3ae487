"""Bad input through the real entry point: exit code 2, exactly one line on stderr naming the
field, no traceback, and nothing written."""

from __future__ import annotations

import pytest
import yaml
from support import rlsched, snapshot

from rlsched.config import load_preset_data

SMALL = ["--set", "rl.steps=1", "--set", "workload.prompts=8"]


def valid_config_text() -> str:
    data = load_preset_data("jobs", "default")
    data["workload"]["prompts"] = 4
    data["rl"]["steps"] = 1
    return yaml.safe_dump(data, sort_keys=False)


# (id, files to write into tmp_path, CLI args, texts the one error line must contain)
CASES = [
    ("unknown-preset", {}, ["--preset", "no-such-preset"], ["preset", "no-such-preset"]),
    ("unknown-policy", {}, ["--policy", "bogus-policy"], ["policy", "bogus-policy"]),
    ("unknown-realloc", {}, ["--realloc", "bogus-realloc"], ["realloc", "bogus-realloc"]),
    ("max-batch-zero", {}, ["--set", "cluster.max_batch=0"], ["cluster.max_batch"]),
    ("max-batch-negative", {}, ["--set", "cluster.max_batch=-4"], ["cluster.max_batch", "-4"]),
    ("acceptance-above-one", {}, ["--set", "drafters.0.acceptance.mean=1.5"], ["drafters.0.acceptance.mean", "1.5"]),
    ("acceptance-negative", {}, ["--set", "drafters.0.acceptance.mean=-0.1"], ["drafters.0.acceptance.mean", "-0.1"]),
    (
        "malformed-yaml",
        {"bad.yaml": "name: x\nworkload: [1, 2\n  prompts: : :\n"},
        ["--config", "bad.yaml"],
        ["bad.yaml"],
    ),
    (
        "malformed-toml",
        {"bad.toml": 'name = "x"\nworkload = [1, 2\n[[[cluster\n'},
        ["--config", "bad.toml"],
        ["bad.toml"],
    ),
    ("missing-config", {}, ["--config", "does-not-exist.yaml"], ["does-not-exist.yaml"]),
    ("unknown-field", {}, ["--set", "cluster.nosuchfield=1"], ["cluster.nosuchfield"]),
    ("unknown-section", {}, ["--set", "nosuchsection.x=1"], ["nosuchsection"]),
    ("value-not-section", {}, ["--set", "cluster.max_batch.x=1"], ["cluster.max_batch"]),
    ("set-without-equals", {}, ["--set", "cluster.max_batch"], ["--set", "cluster.max_batch"]),
    (
        "preset-and-config",
        {"some.yaml": valid_config_text()},
        ["--preset", "default", "--config", "some.yaml"],
        ["--preset", "--config"],
    ),
    ("negative-seed", {}, ["--seed", "-3"], ["--seed"]),
]


@pytest.mark.parametrize("files,args,names", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(tmp_path, files, args, names):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    before = snapshot(tmp_path)
    out = tmp_path / "out"

    proc = rlsched("simulate", "--json", "--out", str(out), *args, *SMALL, cwd=tmp_path)

    detail = f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.returncode == 2, detail
    assert "Traceback" not in proc.stdout and "Traceback" not in proc.stderr, detail
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, detail
    line = lines[0]
    assert line.strip(), detail
    for name in names:
        assert name in line, f"{name!r} not in error line: {line!r}"
    assert proc.stdout == "", detail
    assert not out.exists()
    assert snapshot(tmp_path) == before


def test_bad_input_without_out_writes_nothing(tmp_path):
    """Without --out the default folder (runs/simulate/...) must not appear either."""
    proc = rlsched("simulate", "--set", "cluster.max_batch=0", *SMALL, cwd=tmp_path)
    assert proc.returncode == 2
    assert len(proc.stderr.splitlines()) == 1
    assert "cluster.max_batch" in proc.stderr
    assert snapshot(tmp_path) == set()


def test_presets_unknown_show_and_kind(tmp_path):
    for args, name in (
        (["presets", "--show", "no-such-job"], "no-such-job"),
        (["presets", "--kind", "gadgets"], "--kind"),
        (["presets", "--kind", "models", "--show", "no-such-model"], "no-such-model"),
    ):
        proc = rlsched(*args, cwd=tmp_path)
        detail = f"{args}: exit {proc.returncode}\nstderr:\n{proc.stderr}"
        assert proc.returncode == 2, detail
        assert "Traceback" not in proc.stderr + proc.stdout, detail
        assert len(proc.stderr.splitlines()) == 1, detail
        assert name in proc.stderr, detail
    assert snapshot(tmp_path) == set()
