"""Trace writer and reader: parts appended in order, and one clear error per broken file."""

from __future__ import annotations

import json

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlsched.errors import UserError
from rlsched.traces import SAMPLE_SCHEMA, STEP_SCHEMA, TRACE_SCHEMA_VERSION, TraceWriter, read_trace, to_table
from rlsched.traces.writer import write_table


def step_record(i: int) -> dict:
    return {
        "rl_step": 0,
        "instance": i % 2,
        "step": i,
        "time_s": 0.01 * i,
        "kind": "decode",
        "batch": 4,
        "drafter": "model",
        "k": 3,
        "width": 1,
        "drafted": 12,
        "accepted": 7,
        "emitted": 11,
        "draft_ms": 0.5,
        "verify_ms": 1.5,
        "step_ms": 2.0,
        "ctx_tokens": 100 + i,
    }


def sample_frame(n: int = 5) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "rl_step": [0] * n,
            "sample_id": range(n),
            "prompt_id": [i // 2 for i in range(n)],
            "instance": [0] * n,
            "prompt_len": [10] * n,
            "response_len": [20 + i for i in range(n)],
            "finish_s": [1.0 + i for i in range(n)],
            "preemptions": [0] * n,
            "migrations": [0] * n,
        }
    )


def write_samples(path) -> None:
    write_table(path, to_table("samples", sample_frame()))


# ----------------------------------------------------------------------------- writer and reader


def test_trace_writer_appends_parts_read_back_in_order(tmp_path):
    w = TraceWriter(tmp_path, "steps", flush_every=3)
    for i in range(10):
        w.append(step_record(i))
    w.close()
    parts = sorted((tmp_path / "steps").glob("part-*.parquet"))
    assert [p.name for p in parts] == [f"part-{i:06d}.parquet" for i in range(4)]  # 3+3+3+1
    df = read_trace(tmp_path / "steps", "steps")
    assert list(df["step"]) == list(range(10))
    assert list(df["ctx_tokens"]) == [100 + i for i in range(10)]
    assert list(df.columns)[: len(STEP_SCHEMA.names)] == STEP_SCHEMA.names


def test_trace_writer_continues_numbering_after_reopen(tmp_path):
    w = TraceWriter(tmp_path, "steps")
    w.append(step_record(0))
    w.append(step_record(1))
    w.close()
    w2 = TraceWriter(tmp_path, "steps")
    w2.append(step_record(2))
    w2.close()
    parts = sorted((tmp_path / "steps").glob("part-*.parquet"))
    assert [p.name for p in parts] == ["part-000000.parquet", "part-000001.parquet", "part-000002.parquet"]
    assert list(read_trace(tmp_path / "steps", "steps")["step"]) == [0, 1, 2]


def test_trace_writer_keeps_unflushed_rows_until_flush(tmp_path):
    w = TraceWriter(tmp_path, "steps", flush_every=100)
    w.append(step_record(0))
    assert list((tmp_path / "steps").glob("part-*.parquet")) == []
    assert len(read_trace(tmp_path / "steps", "steps")) == 0
    w.close()
    assert len(read_trace(tmp_path / "steps", "steps")) == 1


def test_written_table_carries_schema_types_and_version(tmp_path):
    path = tmp_path / "samples.parquet"
    write_samples(path)
    table = pq.read_table(path)
    info = json.loads(table.schema.metadata[b"rlsched.trace"])
    assert info == {"kind": "samples", "version": TRACE_SCHEMA_VERSION}
    for field in SAMPLE_SCHEMA:
        assert table.schema.field(field.name).type == field.type
    df = read_trace(path, "samples")
    assert list(df["response_len"]) == [20, 21, 22, 23, 24]
    assert not list(tmp_path.glob(".*.tmp"))  # atomic write leaves no temp file


def test_to_table_refuses_missing_columns():
    with pytest.raises(ValueError, match="response_len"):
        to_table("samples", sample_frame().drop(columns=["response_len"]))


def test_read_trace_missing_path(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        read_trace(tmp_path / "nope.parquet", "steps")


# ----------------------------------------------------------------------------- broken files


def test_truncated_file(tmp_path):
    path = tmp_path / "samples.parquet"
    write_samples(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError) as exc:
        read_trace(path, "samples")
    msg = str(exc.value)
    assert str(path) in msg
    assert "corrupt or truncated" in msg
    assert "\n" not in msg


def test_truncated_part_in_folder(tmp_path):
    w = TraceWriter(tmp_path, "steps")
    for i in range(3):
        w.append(step_record(i))
    w.close()
    last = sorted((tmp_path / "steps").glob("part-*.parquet"))[-1]
    last.write_bytes(last.read_bytes()[:40])
    with pytest.raises(UserError, match=last.name):
        read_trace(tmp_path / "steps", "steps")


def test_file_without_rlsched_metadata(tmp_path):
    path = tmp_path / "plain.parquet"
    pq.write_table(pa.Table.from_pandas(sample_frame(), preserve_index=False).replace_schema_metadata(None), path)
    with pytest.raises(UserError) as exc:
        read_trace(path, "samples")
    msg = str(exc.value)
    assert str(path) in msg
    assert "not an rlsched trace" in msg


def test_file_with_wrong_version(tmp_path):
    path = tmp_path / "future.parquet"
    table = to_table("samples", sample_frame())
    meta = {b"rlsched.trace": json.dumps({"kind": "samples", "version": 999}).encode()}
    pq.write_table(table.replace_schema_metadata(meta), path)
    with pytest.raises(UserError) as exc:
        read_trace(path, "samples")
    msg = str(exc.value)
    assert str(path) in msg
    assert "version 999" in msg
    assert f"version {TRACE_SCHEMA_VERSION}" in msg


def test_file_of_wrong_kind(tmp_path):
    path = tmp_path / "samples.parquet"
    write_samples(path)
    with pytest.raises(UserError) as exc:
        read_trace(path, "steps")
    msg = str(exc.value)
    assert str(path) in msg
    assert "samples" in msg and "steps" in msg


def test_file_lacking_a_schema_column(tmp_path):
    path = tmp_path / "short.parquet"
    table = to_table("samples", sample_frame())
    meta = table.schema.metadata
    table = table.drop_columns(["finish_s"]).replace_schema_metadata(meta)
    pq.write_table(table, path)
    with pytest.raises(UserError) as exc:
        read_trace(path, "samples")
    msg = str(exc.value)
    assert str(path) in msg
    assert "finish_s" in msg
    assert "lacks" in msg


def test_journaled_writer_killed_mid_part_keeps_every_appended_record(tmp_path):
    """A writer that never flushes (killed) leaves its records in the part's journal; a line
    cut short by the kill is dropped; once the part is written its journal is gone."""
    w = TraceWriter(tmp_path, "steps", flush_every=4, journal=True)
    for i in range(6):
        w.append(step_record(i))
    # no close: as if killed. Part 0 (4 records) is Parquet, part 1 (2 records) only a journal.
    assert sorted(p.name for p in (tmp_path / "steps").iterdir()) == ["part-000000.parquet", "part-000001.jsonl"]
    with open(tmp_path / "steps" / "part-000001.jsonl", "a") as f:
        f.write('{"rl_step": 0, "step": 6, "ki')  # the record in flight, cut short
    df = read_trace(tmp_path, "steps")
    assert list(df["step"]) == list(range(6))
    # a new writer after the crash continues after the journal's number
    w2 = TraceWriter(tmp_path, "steps", flush_every=4, journal=True)
    w2.append(step_record(6))
    w2.close()
    assert list(read_trace(tmp_path / "steps", "steps")["step"]) == list(range(7))
    assert not list((tmp_path / "steps").glob("part-000002.jsonl"))
