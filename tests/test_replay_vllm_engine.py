"""`rlsched replay` of vLLM engines: the engine's recorded scheduling arguments become the
simulator's `engine` section (kind vllm), vLLM's defaults where the engine file lacks them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from support import ok, one_line_error, rlsched

from rlsched.analysis.engine import engine_section, read_engine_trace, run_engine
from rlsched.analysis.engine_replay import _limits, replay_engine
from rlsched.errors import UserError

FIXTURE = Path(__file__).parent / "data" / "engine_core_trace"


@pytest.fixture
def trace(tmp_path) -> Path:
    out = tmp_path / "trace"
    shutil.copytree(FIXTURE, out)
    return out


def _engine_file(folder: Path) -> Path:
    return next(folder.glob("engine-*.json"))


def test_the_fixture_engine_is_replayed_as_vllm_with_its_knobs():
    tr = read_engine_trace(FIXTURE)
    section = engine_section(tr.engines[0])
    assert section == {
        "kind": "vllm",
        "max_num_batched_tokens": 4096,
        "enable_chunked_prefill": True,
        "enable_prefix_caching": True,
        "async_scheduling": False,
    }


def test_limits_drop_prompt_sharing_for_the_engine_model():
    from rlsched.analysis.replay import _rollout

    tr = read_engine_trace(FIXTURE)
    rollouts = [_rollout(tr.samples[tr.samples["rl_step"] == 0], "model")]
    limits = _limits(tr.engines[0], rollouts)
    assert limits["share_prompts"] is False
    assert limits["engine"]["kind"] == "vllm" and limits["engine"]["max_num_batched_tokens"] == 4096


def test_missing_knobs_take_vllm_defaults_and_enforce_eager_captures_nothing(trace):
    path = _engine_file(trace)
    data = json.loads(path.read_text())
    for key in ("max_num_batched_tokens", "enable_chunked_prefill", "async_scheduling"):
        del data[key]
    data["enforce_eager"] = True
    path.write_text(json.dumps(data))
    section = engine_section(read_engine_trace(trace).engines[0])
    assert section == {"kind": "vllm", "enable_prefix_caching": True, "cudagraph_capture_sizes": []}
    result = replay_engine(trace)
    assert np.isfinite(result.steps["predicted_s"]).all() and (result.steps["predicted_s"] > 0).all()


def test_recorded_capture_sizes_are_kept():
    section = engine_section({"kind": "x", "cudagraph_capture_sizes": [8, 1, 4, 2]})
    assert section["cudagraph_capture_sizes"] == [1, 2, 4, 8]


@pytest.mark.parametrize(
    "key, value", [("async_scheduling", "yes"), ("max_num_batched_tokens", 0), ("cudagraph_capture_sizes", [0, 8])]
)
def test_a_knob_of_the_wrong_type_is_one_error_naming_it(trace, tmp_path, key, value):
    path = _engine_file(trace)
    data = json.loads(path.read_text())
    data[key] = value
    path.write_text(json.dumps(data))
    with pytest.raises(UserError, match=key):
        engine_section(read_engine_trace(trace).engines[0])
    one_line_error(rlsched("replay", str(trace), cwd=tmp_path), key)


def test_replay_of_the_fixture_prices_its_steps_as_vllm_ran_them(tmp_path):
    s = json.loads(ok(rlsched("replay", str(FIXTURE), "--json", cwd=tmp_path)).stdout)
    assert s["kind"] == "engine" and s["rl_steps"] == 2
    measured, predicted = s["measured_generation_s"], s["predicted_generation_s"]
    assert 0.5 * measured < predicted < 1.5 * measured
    assert not any("no form prices them" in n for n in s["notes"])


def test_a_vllm_run_folder_replays_its_engine_files(tmp_path):
    cfg = {"rollout": {"backend": "vllm"}}
    traces = tmp_path / "run" / "traces"
    traces.mkdir(parents=True)
    assert run_engine(tmp_path / "run", {"rollout": {"backend": "local"}}) == (None, [])
    section, notes = run_engine(tmp_path / "run", cfg)
    assert section == {"kind": "vllm"} and "vLLM's defaults" in notes[0]
    shutil.copy(_engine_file(FIXTURE), traces / _engine_file(FIXTURE).name)
    section, notes = run_engine(tmp_path / "run", cfg)
    assert section["max_num_batched_tokens"] == 4096 and section["async_scheduling"] is False and not notes


def test_a_rollouts_time_outside_its_step_records_is_charged_as_measured():
    """A run's generation stage holds its engine steps and time before the first and after the
    last (requests handed over, outputs back): the median of that over RL steps, 0 for a pool
    whose instances keep their own clocks."""
    import pandas as pd

    from rlsched.analysis.replay import outside_steps_s

    rows = []
    for rl_step in range(5):
        t = 0.0
        for _ in range(4):
            rows.append(dict(rl_step=rl_step, instance=0, time_s=t, step_ms=10.0))
            t += 0.012  # 10 ms a step and 2 ms between
    steps = pd.DataFrame(rows)
    span = 3 * 0.012 + 0.010
    extra = [0.030, 0.031, 0.029, 0.5, 0.030]  # one slow outlier: the median ignores it
    rl = pd.DataFrame(dict(rl_step=range(5), generation_s=[span + e for e in extra]))
    assert outside_steps_s(rl, steps) == pytest.approx(0.030)
    two = pd.concat([steps, steps.assign(instance=1)])
    assert outside_steps_s(rl, two) == 0.0
    assert outside_steps_s(rl.assign(generation_s=span - 0.01), steps) == 0.0  # never below nothing
