"""fit, replay, plot and report on an engine-core trace folder (what rlsched's scheduler inside
vLLM writes: engine-<tag>.json, steps/, samples/), run through the real CLI on a real folder
written by vLLM's CPU build (tests/data/engine_core_trace: one engine, two windows)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support import ok, one_line_error, rlsched, snapshot

FIXTURE = Path(__file__).parent / "data" / "engine_core_trace"
TAG = "e0-15658"
STEPS_PART = f"steps/part-000001-{TAG}.parquet"


@pytest.fixture
def trace(tmp_path) -> Path:
    """A copy of the fixture (the commands write plots/ and report.html into it)."""
    out = tmp_path / "trace"
    shutil.copytree(FIXTURE, out)
    return out


def _edit_steps(part: Path, edit) -> None:
    """Rewrite a steps part with `edit(DataFrame)` applied, keeping its schema and metadata."""
    table = pq.read_table(part)
    df = edit(table.to_pandas())
    pq.write_table(pa.Table.from_pandas(df, schema=table.schema, preserve_index=False), part)


def _as_journal(part: Path) -> Path:
    """The part as the journal a killed engine leaves (one JSON record a line), the part removed."""
    rows = pq.read_table(part).to_pylist()
    journal = part.with_suffix(".jsonl")
    journal.write_text("".join(json.dumps(r) + "\n" for r in rows))
    part.unlink()
    return journal


def _untimed(df, which):
    df.loc[which(df), ["draft_ms", "verify_ms"]] = np.nan
    return df


def test_the_fixture_is_what_the_engine_wrote():
    engine = json.loads((FIXTURE / f"engine-{TAG}.json").read_text())
    assert engine["format"] == "rlsched-engine" and engine["k_max"] == 4 and engine["max_batch"] == 32
    assert snapshot(FIXTURE) >= {f"engine-{TAG}.json", STEPS_PART, f"samples/part-000000-{TAG}.parquet"}


def test_fit_reads_the_trace_and_names_its_engine(trace, tmp_path):
    out = tmp_path / "cost.json"
    proc = ok(rlsched("fit", str(trace), "--out", str(out), cwd=tmp_path))
    assert "verify" in proc.stdout and "draft:model" in proc.stdout
    data = json.loads(out.read_text())
    assert data["source"]["kind"] == "engine"
    assert data["source"]["engines"][0]["tag"] == TAG and data["source"]["engines"][0]["k_max"] == 4
    assert any("mixed steps" in n for n in data["notes"])  # the fixture's one prefill-and-decode step
    assert not any("draft/verify split" in n for n in data["notes"])  # every step of the fixture was timed


def test_fit_leaves_steps_without_timed_drafting_out_with_a_note(trace, tmp_path):
    _edit_steps(trace / STEPS_PART, lambda df: _untimed(df, lambda d: d["kind"] == "decode"))
    out = tmp_path / "cost.json"
    proc = ok(rlsched("fit", str(trace), "--out", str(out), cwd=tmp_path))
    untimed = 19  # the decode steps of the second part
    assert f"{untimed} of 58 decode steps have no draft/verify split" in proc.stdout
    data = json.loads(out.read_text())
    kept = data["ops"]["verify"]["quality"]["points"]
    assert 55 - untimed <= kept < 55  # the fixture's fit takes 55 verify points; the untimed ones left out
    assert all(math.isfinite(v) for v in data["ops"]["verify"]["params"].values())


def test_fit_of_a_trace_with_no_timed_drafting_at_all_is_one_line(trace, tmp_path):
    for part in (trace / "steps").glob("*.parquet"):
        _edit_steps(part, lambda df: _untimed(df, lambda d: d["kind"] == "decode"))
    proc = rlsched("fit", str(trace), "--out", str(tmp_path / "cost.json"), cwd=tmp_path)
    one_line_error(proc, "timed as a whole")
    assert not (tmp_path / "cost.json").exists()


def test_replay_sets_measured_beside_predicted_per_window(trace, tmp_path):
    proc = ok(rlsched("replay", str(trace), "--json", cwd=tmp_path))
    s = json.loads(proc.stdout)
    assert s["kind"] == "engine" and s["policy"] == "goodput" and s["drafter"] == "model"
    windows = s["windows"]
    assert [w["rl_step"] for w in windows] == [0, 1]
    assert [w["samples"] for w in windows] == [32, 4] and all(w["engines"] == 1 for w in windows)
    for w in windows:
        for key in ("measured_s", "predicted_s", "predicted_off_s", "error"):
            assert math.isfinite(w[key]), (key, w)
        assert w["measured_s"] > 0 and w["predicted_s"] > 0
    # the measured time of a window is the span of its step records
    steps = pq.read_table(trace / STEPS_PART).to_pandas()
    span = (steps["time_s"] + steps["step_ms"] / 1e3).max() - steps["time_s"].min()
    assert windows[1]["measured_s"] == pytest.approx(span)
    assert s["measured_generation_s"] == pytest.approx(sum(w["measured_s"] for w in windows))
    assert any("no RL stage times" in n for n in s["notes"])
    assert any("arrival times" in n for n in s["notes"])


def test_replay_prints_a_row_per_window_and_takes_a_cost_file(trace, tmp_path):
    cost = tmp_path / "cost.json"
    ok(rlsched("fit", str(trace), "--out", str(cost), cwd=tmp_path))
    proc = ok(rlsched("replay", str(trace), "--cost", str(cost), "--plot", str(tmp_path / "r.png"), cwd=tmp_path))
    rows = [line for line in proc.stdout.splitlines() if line.strip().startswith("│")]
    window_rows = [r.split("│")[1:-1] for r in rows if r.split("│")[1].strip() in ("0", "1")]
    assert len(window_rows) >= 2, proc.stdout
    for cells in window_rows[:2]:
        measured, predicted = float(cells[3]), float(cells[4])
        assert measured > 0 and predicted > 0 and math.isfinite(predicted)
    assert "per-window MAPE" in proc.stdout and (tmp_path / "r.png").stat().st_size > 0
    assert "note: an engine-core trace holds no RL stage times" in proc.stderr


def test_several_engines_are_instances_of_each_window(trace, tmp_path):
    other = "e1-4242"
    for kind in ("steps", "samples"):
        for part in (trace / kind).glob(f"*-{TAG}.parquet"):
            shutil.copy(part, part.with_name(part.name.replace(TAG, other)))
    engine = json.loads((trace / f"engine-{TAG}.json").read_text())
    (trace / f"engine-{other}.json").write_text(json.dumps({**engine, "rank": 1, "pid": 4242}))
    s = json.loads(ok(rlsched("replay", str(trace), "--json", cwd=tmp_path)).stdout)
    assert [w["engines"] for w in s["windows"]] == [2, 2]
    assert [w["samples"] for w in s["windows"]] == [64, 8]
    r = json.loads(ok(rlsched("report", str(trace), "--json", cwd=tmp_path)).stdout)
    assert r["numbers"]["engines"] == 2 and r["numbers"]["samples"] == 72


def test_plot_draws_what_an_engine_trace_supports(trace, tmp_path):
    proc = ok(rlsched("plot", str(trace), "--json", cwd=tmp_path))
    s = json.loads(proc.stdout)
    assert s["kind"] == "engine"
    assert {"fit", "acceptance", "batch_k", "step_times"} <= set(s["figures"])
    assert "stages" in s["skipped"] and "no RL stage times" in s["skipped"]["stages"]
    for name in s["figures"]:
        assert (trace / "plots" / f"{name}.png").stat().st_size > 0


def test_report_shows_the_engines_numbers(trace, tmp_path):
    proc = ok(rlsched("report", str(trace), "--json", cwd=tmp_path))
    s = json.loads(proc.stdout)
    n = s["numbers"]
    assert s["kind"] == "engine" and n["engines"] == 1 and n["windows"] == 2
    assert n["steps"] == 61 and n["samples"] == 36 and n["k_max"] == 4 and n["max_batch"] == 32
    assert n["tokens_per_s"] > 0 and math.isfinite(n["tokens_per_s"]) and 0 <= n["accept_rate"] <= 1
    page = (trace / "report.html").read_text()
    assert "drafter / k_max / max_num_seqs / tp" in page and 'id="step_times"' in page
    assert "no RL stage times" in page


def test_a_journal_cut_short_by_a_killed_engine_is_read_with_a_warning(trace, tmp_path):
    journal = _as_journal(trace / STEPS_PART)
    with journal.open("a") as f:
        f.write('{"rl_step": 1, "instan')
    proc = ok(rlsched("replay", str(trace), "--json", cwd=tmp_path))
    assert [w["rl_step"] for w in json.loads(proc.stdout)["windows"]] == [0, 1]
    assert "incomplete line" in proc.stderr and str(journal) in proc.stderr
    ok(rlsched("plot", str(trace), cwd=tmp_path))


@pytest.mark.parametrize("command", ["fit", "replay", "plot", "report"])
def test_bad_folders_are_one_line_and_exit_2(trace, tmp_path, command):
    out = ["--out", str(tmp_path / "cost.json")] if command == "fit" else []
    empty = tmp_path / "empty"
    empty.mkdir()
    one_line_error(rlsched(command, str(empty), *out, cwd=tmp_path), str(empty), "engine-core trace")

    garbage = tmp_path / "garbage"
    shutil.copytree(trace, garbage)
    (garbage / f"engine-{TAG}.json").write_text('{"format": "rlsched-engine", "vers')
    one_line_error(rlsched(command, str(garbage), *out, cwd=tmp_path), f"engine-{TAG}.json", "not valid JSON")

    wrong = tmp_path / "wrong"
    shutil.copytree(trace, wrong)
    engine = json.loads((wrong / f"engine-{TAG}.json").read_text())
    (wrong / f"engine-{TAG}.json").write_text(json.dumps({**engine, "max_batch": "many"}))
    one_line_error(rlsched(command, str(wrong), *out, cwd=tmp_path), f"engine-{TAG}.json", "max_batch")

    torn = tmp_path / "torn"
    shutil.copytree(trace, torn)
    journal = _as_journal(torn / STEPS_PART)
    lines = journal.read_text().splitlines(keepends=True)
    journal.write_text("".join(lines[:2]) + '{"rl_step": 1, "inst\n' + "".join(lines[2:]))
    one_line_error(rlsched(command, str(torn), *out, cwd=tmp_path), str(journal), "line 3")
    assert not (tmp_path / "cost.json").exists()


def test_an_engine_trace_without_sample_records_cannot_be_replayed(trace, tmp_path):
    shutil.rmtree(trace / "samples")
    one_line_error(rlsched("replay", str(trace), cwd=tmp_path), "samples", "no sample records")
    ok(rlsched("plot", str(trace), cwd=tmp_path))  # the step records still draw
