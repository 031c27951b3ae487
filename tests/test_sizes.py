"""Simulations too big for this machine are refused, with one line, before any work."""

from __future__ import annotations

import pytest
from support import one_line_error, rlsched, snapshot

from rlsched.config import load_config, preset_names
from rlsched.errors import UserError
from rlsched.sim.learn import Learner
from rlsched.sim.runs import run_jobs
from rlsched.sim.sizes import (
    TIMELINE_ROW_BYTES,
    available_memory,
    check_fits,
    estimate,
    free_disk,
    timeline_rows,
)

GIB = 1024**3
HUGE = 10**7  # prompts: hundreds of GiB with the default preset's timeline


def _fits_here(prompts: int) -> bool:
    have = available_memory()
    return have is not None and estimate(load_config(overrides=[f"workload.prompts={prompts}"])).memory <= have


# ----------------------------------------------------------------------------- through the CLI


@pytest.mark.parametrize("prompts", [10**12, HUGE])
def test_simulate_refuses_prompts_that_do_not_fit(tmp_path, prompts):
    if _fits_here(prompts):
        pytest.skip(f"this machine holds {prompts} prompts")
    proc = rlsched("simulate", "--set", f"workload.prompts={prompts}", "--out", str(tmp_path / "out"), cwd=tmp_path)
    line = one_line_error(proc, "workload.prompts", "available", "fit")
    assert "record_timeline=false" in line
    assert snapshot(tmp_path) == set()


def test_compare_refuses_before_any_run(tmp_path):
    if _fits_here(HUGE):
        pytest.skip("this machine holds the prompts")
    proc = rlsched(
        "compare",
        "--set",
        f"workload.prompts={HUGE}",
        "--policies",
        "off,goodput",
        "--seeds",
        "1",
        "--workers",
        "2",
        "--out",
        str(tmp_path / "out"),
        cwd=tmp_path,
    )
    one_line_error(proc, "workload.prompts", "available")
    assert snapshot(tmp_path) == set()


@pytest.mark.parametrize("command", ["plan", "learn"])
def test_plan_and_learn_refuse_before_any_run(tmp_path, command):
    have = available_memory()
    lean = load_config(overrides=[f"workload.prompts={HUGE}", "record_timeline=false"])
    if have is not None and 2 * estimate(lean, grid=True).memory <= have:
        pytest.skip("this machine holds the prompts")
    out = ["--out", str(tmp_path / ("out" if command == "plan" else "policy.json"))]
    where = ["--workload", "default", "--gpus", "2"] if command == "plan" else ["--preset", "default"]
    proc = rlsched(command, *where, "--set", f"workload.prompts={HUGE}", "--workers", "1", *out, cwd=tmp_path)
    one_line_error(proc, "workload.prompts", "available")
    assert snapshot(tmp_path) == set()


# ----------------------------------------------------------------------------- the estimate


def _cfg(prompts: int, timeline: bool = True, *more: str):
    return load_config(overrides=[f"workload.prompts={prompts}", f"record_timeline={str(timeline).lower()}", *more])


def test_estimate_grows_linearly_with_prompts():
    for timeline in (False, True):
        m = [estimate(_cfg(p, timeline)).memory for p in (10**5, 2 * 10**5, 3 * 10**5)]
        assert m[2] > m[1] > m[0]
        assert m[2] - m[1] == pytest.approx(m[1] - m[0], rel=1e-3)
        d = [estimate(_cfg(p, timeline)).disk for p in (10**5, 2 * 10**5, 3 * 10**5)]
        assert d[2] - d[1] == pytest.approx(d[1] - d[0], rel=1e-3)


def test_estimate_grows_linearly_with_the_timeline():
    with_, without = estimate(_cfg(10**4)), estimate(_cfg(10**4, False))
    assert without.timeline_rows == 0 and with_.timeline_rows > 0
    assert with_.memory - without.memory == pytest.approx(with_.timeline_rows * TIMELINE_ROW_BYTES)
    # longer responses, more engine steps: the timeline's rows grow with the tokens
    lengths = [f"workload.response_len={{dist: fixed, value: {n}}}" for n in (1000, 2000, 3000)]
    rows = [timeline_rows(_cfg(10**4, True, length)) for length in lengths]
    assert rows[2] > rows[1] > rows[0]
    assert rows[2] - rows[1] == pytest.approx(rows[1] - rows[0], rel=0.01)
    # every RL step keeps its samples
    one, three = (estimate(_cfg(10**4, False, f"rl.steps={n}")).memory for n in (1, 3))
    assert three > 2 * one


@pytest.mark.parametrize("preset", preset_names("jobs"))
def test_every_shipped_preset_fits_in_8_gib(preset):
    cfg = load_config(preset)
    check_fits(cfg, available=8 * GIB)
    check_fits(cfg, workers=2, processes=True, available=8 * GIB)
    check_fits(cfg.model_copy(update={"record_timeline": False}), grid=True, workers=2, available=8 * GIB)


def test_a_refusal_names_the_sizes_and_ways_to_fit():
    cfg = _cfg(10**5)
    est = estimate(cfg)
    lean = estimate(_cfg(10**5, False))
    with pytest.raises(UserError) as e:
        check_fits(cfg, available=int((est.memory + lean.memory) / 2))
    msg = str(e.value)
    assert "\n" not in msg
    assert "workload.prompts 100,000" in msg and "timeline" in msg and "--set record_timeline=false" in msg
    # side by side: how many fit at once
    with pytest.raises(UserError, match=r"--workers 3\b"):
        check_fits(cfg, workers=8, available=int(3.5 * est.memory))
    check_fits(cfg, workers=3, available=int(3.5 * est.memory))


def test_pricing_every_batch_is_counted_for_the_solved_two_state_rule():
    cfg = _cfg(8, True, f"cluster.max_batch={2**40}")
    assert estimate(cfg, "twostate").grid_memory > 1024 * GIB
    assert estimate(cfg, "twostate:32:4").grid_memory == 0
    assert estimate(cfg, "goodput").grid_memory == 0
    with pytest.raises(UserError, match="cluster.max_batch"):
        check_fits(cfg, policy="twostate", available=8 * GIB)


def test_the_folder_must_fit_where_it_goes(tmp_path):
    cfg = _cfg(10**4)
    with pytest.raises(UserError, match="file system") as e:
        check_fits(cfg, out=tmp_path / "a" / "b", disk_free=1000, available=8 * GIB)
    assert str(tmp_path / "a" / "b") in str(e.value)
    check_fits(cfg, out=tmp_path / "a" / "b", disk_free=10 * GIB, available=8 * GIB)
    assert (free_disk(tmp_path / "a" / "b") or 0) > 0  # the nearest existing folder's file system
    assert not (tmp_path / "a").exists()


def test_runners_refuse_before_any_simulation():
    cfg = _cfg(10**12)
    with pytest.raises(UserError, match="workload.prompts"):
        run_jobs(cfg, [("off", "none", 0, None), ("goodput", "none", 0, None)], workers=2)
    with pytest.raises(UserError, match="workload.prompts"):
        Learner(cfg, [0])
