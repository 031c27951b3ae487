"""A policy's text is parsed once per command, where it enters (a CLI option or a config field),
and the parsed spec travels down: a spy on `parse_policy` counts the parses of `simulate`,
`generate` and `run` (rlsched's engine here; vLLM's in .venv-vllm), each run in-process and small.
Policy files read from disk are not parses of policy text."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import yaml
from typer.testing import CliRunner

import rlsched.cli  # noqa: F401  (imported before the spy: the configs' defaults are parsed at import)
import rlsched.executor.rl.config  # noqa: F401
from rlsched.policies import registry

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.fixture
def parses(monkeypatch):
    """The texts `parse_policy` is called with, wherever it was imported from."""
    calls: list[str] = []
    real = registry.parse_policy

    def counting(text, engine="simulator"):
        calls.append(str(text))
        return real(text, engine)

    for name, module in list(sys.modules.items()):  # rlsched's own (others' lazy modules import on getattr)
        if name.partition(".")[0] == "rlsched" and getattr(module, "parse_policy", None) is real:
            monkeypatch.setattr(module, "parse_policy", counting)
    return calls


def _invoke(*args: str) -> dict:
    from rlsched.cli import app

    result = CliRunner().invoke(app, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


SIM = ["--preset", "default", "--set", "rl.steps=1", "--set", "workload.prompts=4", "--no-baseline", "--json"]


def test_simulate_parses_the_configs_policy_once(parses, tmp_path):
    summary = _invoke("simulate", *SIM, "--set", "speculation.policy=static:3", "--out", str(tmp_path / "s"))
    assert summary["policy"] == "static:3"
    assert parses == ["static:3"]


def test_simulate_parses_its_policy_option_once(parses, tmp_path):
    summary = _invoke("simulate", *SIM, "--policy", "twostate:16:2", "--out", str(tmp_path / "s"))
    assert summary["policy"] == "twostate:16:2"
    # the config's own policy is read with the config (once), --policy once: each text once
    assert parses == ["goodput", "twostate:16:2"]


def test_yaml_off_is_the_policy_off(parses, tmp_path):
    from rlsched.config import load_config
    from rlsched.executor.rl.config import load_run_config

    assert load_config("default", overrides=["speculation.policy=off"]).speculation.policy.family == "off"
    path = tmp_path / "c.yaml"
    path.write_text(
        yaml.safe_dump({**load_config("default").model_dump(mode="json"), "name": "x"}).replace(
            "policy: goodput", "policy: off"
        )
    )
    cfg = load_config(config=path)
    assert cfg.speculation.policy.family == "off" and cfg.model_dump(mode="json")["speculation"]["policy"] == "off"
    run = tmp_path / "run.yaml"
    run.write_text("policy: off\n")
    assert load_run_config(run).policy.family == "off"
    assert load_run_config(None, ["policy=off"]).model_dump()["policy"] == "off"


def test_generate_parses_its_policy_once(parses, pair, tmp_path):
    pytest.importorskip("torch")
    summary = _invoke(
        "generate",
        *("--policy", "static:2", "--n", "1", "--max-tokens", "4", "--max-batch", "4", "--k-max", "3"),
        *("--out", str(tmp_path / "g"), "--json"),
    )
    assert summary["policy"] == "static:2"
    assert parses == ["static:2"]


RUN = """
steps: 1
policy: {policy}
checkpoint_every: 1
data: builtin:count,repeat
rollout: {{prompts_per_step: 2, group_size: 2, max_tokens: 8, max_batch: 8, k_max: 3, backend: {backend}}}
algorithm: {{minibatches: 1}}
"""


def test_run_parses_its_policy_once(parses, pair, tmp_path):
    pytest.importorskip("torch")
    config = tmp_path / "run.yaml"
    config.write_text(RUN.format(policy="static:2", backend="local"))
    summary = _invoke("run", "--config", str(config), "--out", str(tmp_path / "r"), "--json")
    assert summary["policy"] == "static:2" and summary["steps"] == 1
    assert parses == ["static:2"]


@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not importable here (make test-vllm sets up .venv-vllm)")
def test_run_on_vllm_parses_its_policy_once(parses, pair, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(RUN.format(policy="twostate:4:2", backend="vllm"))
    summary = _invoke("run", "--config", str(config), "--set", "threads=1", "--out", str(tmp_path / "r"), "--json")
    assert summary["policy"] == "twostate:4:2" and summary["steps"] == 1
    assert parses == ["twostate:4:2"]
