"""Unit tests of rlsched.config: presets, model arithmetic, overrides, validation."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rlsched.config import (
    DrafterSpec,
    HardwareSpec,
    ModelSpec,
    SimConfig,
    apply_override,
    build_config,
    load_config,
    load_preset_data,
    preset_names,
    read_config_file,
)
from rlsched.errors import UserError


def model(name: str) -> ModelSpec:
    return ModelSpec.model_validate(load_preset_data("models", name))


# ----------------------------------------------------------------------------- presets


def test_preset_names_are_known():
    assert {"default", "longtail-grpo"} <= set(preset_names("jobs"))
    assert {"h100-sxm", "h200", "a100-80gb"} <= set(preset_names("hardware"))
    assert {"qwen2.5-7b", "qwen2.5-0.5b", "llama-3.1-70b"} <= set(preset_names("models"))


@pytest.mark.parametrize("name", preset_names("jobs"))
def test_job_presets_validate(name):
    cfg = load_config(preset=name)
    assert isinstance(cfg, SimConfig)
    assert cfg.name == name
    assert isinstance(cfg.hardware, HardwareSpec)
    assert isinstance(cfg.model, ModelSpec)


@pytest.mark.parametrize("name", preset_names("hardware"))
def test_hardware_presets_validate(name):
    hw = HardwareSpec.model_validate(load_preset_data("hardware", name))
    assert hw.name == name
    assert hw.peak_tflops > 0 and hw.mem_bw_gbs > 0 and hw.memory_gib > 0


@pytest.mark.parametrize("name", preset_names("models"))
def test_model_presets_validate(name):
    m = model(name)
    assert m.name == name
    assert m.params > 0
    assert m.kv_bytes_per_token > 0
    assert m.weight_bytes == m.params * m.dtype_bytes


def test_unknown_preset_is_refused():
    with pytest.raises(ValueError, match="no-such"):
        load_preset_data("models", "no-such")
    with pytest.raises(UserError, match="no-such-job"):
        load_config(preset="no-such-job")


# ----------------------------------------------------------------------------- model arithmetic


def test_qwen_7b_params():
    assert model("qwen2.5-7b").params == pytest.approx(7.62e9, rel=0.01)


def test_llama_70b_params():
    assert model("llama-3.1-70b").params == pytest.approx(70.6e9, rel=0.01)


def test_qwen_7b_kv_bytes_per_token():
    # 2 (K and V) x 28 layers x 4 KV heads x 128 head dim x 2 bytes
    assert model("qwen2.5-7b").kv_bytes_per_token == 57344


def test_larger_models_have_more_params():
    assert model("qwen2.5-0.5b").params < model("qwen2.5-7b").params < model("qwen2.5-32b").params


# ----------------------------------------------------------------------------- apply_override


@pytest.mark.parametrize(
    "raw,expected",
    [
        ("3", 3),
        ("-4", -4),
        ("0.25", 0.25),
        ("2.5e-3", 0.0025),
        ("true", True),
        ("false", False),
        ("[1, 2, 3]", [1, 2, 3]),
        ("[a, b]", ["a", "b"]),
        ("hello", "hello"),
    ],
)
def test_apply_override_parses_values(raw, expected):
    data = {"section": {"field": None}}
    apply_override(data, f"section.field={raw}")
    value = data["section"]["field"]
    assert value == expected
    assert type(value) is type(expected)


def test_apply_override_creates_sections_and_indexes_lists():
    data = {"drafters": [{"acceptance": {"mean": 0.5}}]}
    apply_override(data, "drafters.0.acceptance.mean=0.9")
    apply_override(data, "cluster.max_batch=64")
    assert data["drafters"][0]["acceptance"]["mean"] == 0.9
    assert data["cluster"] == {"max_batch": 64}


def test_apply_override_value_may_contain_equals():
    data = {}
    apply_override(data, "name=a=b")
    assert data["name"] == "a=b"


@pytest.mark.parametrize(
    "assignment,needle",
    [
        ("noequals", "noequals"),
        ("a..b=1", "a..b"),
        ("drafters.5.name=x", "drafters.5"),
        ("cluster.max_batch.x=1", "cluster.max_batch"),
    ],
)
def test_apply_override_refuses_bad_paths(assignment, needle):
    data = {"drafters": [{"name": "d"}], "cluster": {"max_batch": 4}}
    with pytest.raises(UserError, match=needle.replace(".", r"\.")):
        apply_override(data, assignment)


def test_override_inside_hardware_preset_reference():
    data = load_preset_data("jobs", "default")
    assert data["hardware"] == "h100-sxm"
    cfg = build_config(data, ["hardware.memory_gib=141"])
    assert cfg.hardware.memory_gib == 141
    assert cfg.hardware.name == "h100-sxm"
    ref = HardwareSpec.model_validate(load_preset_data("hardware", "h100-sxm"))
    assert cfg.hardware.peak_tflops == ref.peak_tflops  # the rest of the preset is kept
    assert ref.memory_gib != 141


def test_override_inside_model_preset_reference():
    cfg = load_config(preset="default", overrides=["model.layers=2"])
    assert cfg.model.layers == 2
    assert cfg.model.name == "qwen2.5-7b"


def test_build_config_does_not_mutate_input():
    data = load_preset_data("jobs", "default")
    build_config(data, ["hardware.memory_gib=141", "cluster.max_batch=8"])
    assert data["hardware"] == "h100-sxm"
    assert data["cluster"]["max_batch"] == 256


def test_override_is_validated_like_a_file():
    with pytest.raises(UserError, match=r"cluster\.max_batch"):
        load_config(preset="default", overrides=["cluster.max_batch=0"])
    with pytest.raises(UserError, match=r"cluster\.nosuchfield"):
        load_config(preset="default", overrides=["cluster.nosuchfield=1"])


# ----------------------------------------------------------------------------- validation


def test_model_drafter_without_model_is_refused():
    with pytest.raises(ValueError, match="needs a model"):
        DrafterSpec.model_validate({"name": "d", "kind": "model", "acceptance": {"mean": 0.5}})


def test_model_drafter_without_model_refused_in_config():
    data = load_preset_data("jobs", "default")
    del data["drafters"][0]["model"]
    with pytest.raises(UserError, match="drafters"):
        build_config(data)


def test_ngram_drafter_without_model_is_fine():
    d = DrafterSpec.model_validate({"name": "ng", "kind": "ngram", "acceptance": {"mean": 0.3}})
    assert d.model is None


def test_drafter_model_preset_resolves():
    d = DrafterSpec.model_validate({"name": "d", "kind": "model", "model": "qwen2.5-0.5b", "acceptance": {"mean": 0.5}})
    assert isinstance(d.model, ModelSpec)
    assert d.model.name == "qwen2.5-0.5b"


def test_duplicate_and_reserved_drafter_names_refused():
    data = load_preset_data("jobs", "default")
    data["drafters"].append(dict(data["drafters"][0]))
    with pytest.raises(UserError, match="unique"):
        build_config(data)
    data = load_preset_data("jobs", "default")
    data["drafters"][0]["name"] = "off"
    with pytest.raises(UserError, match="reserved"):
        build_config(data)


def test_lognormal_min_above_max_refused():
    with pytest.raises(UserError, match="min"):
        load_config(preset="default", overrides=["workload.response_len.min=9000"])


def test_preset_and_config_together_refused(tmp_path):
    with pytest.raises(UserError, match="not both"):
        load_config(preset="default", config=tmp_path / "x.yaml")


def test_read_config_file_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        read_config_file(tmp_path / "missing.yaml")
    bad = tmp_path / "list.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(UserError, match="mapping"):
        read_config_file(bad)
    bad_toml = tmp_path / "bad.toml"
    bad_toml.write_text("a = [1,\n")
    with pytest.raises(UserError, match="malformed"):
        read_config_file(bad_toml)


def test_config_is_frozen():
    cfg = load_config(preset="default")
    with pytest.raises(ValidationError):
        cfg.seed = 3
    assert cfg.seed == 0


def test_exponent_override_validates_as_float():
    # YAML 1.1 reads '1e-3' as a string; validation must still turn it into the float field's value
    cfg = load_config(preset="default", overrides=["rl.acceptance_drift_per_step=1e-3"])
    assert cfg.rl.acceptance_drift_per_step == pytest.approx(1e-3)
