"""Reading traces back, with one clear error naming the file and what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from rlsched.errors import UserError
from rlsched.traces.schema import SCHEMAS, TRACE_SCHEMA_VERSION


def _read_one(path: Path, kind: str) -> pa.Table:
    try:
        table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise UserError(
            f"trace file '{path}' is corrupt or truncated ({str(e).splitlines()[0]}); "
            "delete it or re-run the job that wrote it"
        ) from None
    meta = (table.schema.metadata or {}).get(b"rlsched.trace")
    if meta is None:
        raise UserError(f"trace file '{path}' is not an rlsched trace (no rlsched.trace metadata)")
    info = json.loads(meta)
    if info.get("kind") != kind:
        raise UserError(f"trace file '{path}' holds '{info.get('kind')}' records, expected '{kind}'")
    if info.get("version") != TRACE_SCHEMA_VERSION:
        raise UserError(
            f"trace file '{path}' has schema version {info.get('version')}, this rlsched reads "
            f"version {TRACE_SCHEMA_VERSION}; re-create it with this version"
        )
    missing = [n for n in SCHEMAS[kind].names if n not in table.column_names]
    if missing:
        raise UserError(f"trace file '{path}' lacks columns {', '.join(missing)}")
    return table


def _read_journal(path: Path, kind: str) -> pa.Table | None:
    """The complete records of a part's journal (a line cut short by a crash is dropped)."""
    from rlsched.traces.writer import to_table

    rows = []
    lines = path.read_text().split("\n")
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i < len(lines) - 1:  # only the last line may be cut short
                raise UserError(f"trace journal '{path}' is corrupt at line {i + 1}") from None
    return to_table(kind, pd.DataFrame(rows)) if rows else None


def read_trace(path: Path, kind: str) -> pd.DataFrame:
    """Records of `kind` from a Parquet file, a folder of parts (in order), or the folder
    holding that one (`traces/` for `traces/<kind>/`). Journals of parts a killed writer
    never wrote are read too."""
    path = Path(path)
    if path.is_dir() and (path / kind).is_dir():
        path = path / kind
    if path.is_dir():
        files = sorted(
            p
            for p in path.glob("part-*.*")
            if p.suffix in (".parquet", ".jsonl") and not (p.suffix == ".jsonl" and p.with_suffix(".parquet").exists())
        )
    elif path.is_file():
        files = [path]
    else:
        raise UserError(f"trace '{path}' does not exist")
    tables = [_read_one(f, kind) if f.suffix != ".jsonl" else _read_journal(f, kind) for f in files]
    tables = [t for t in tables if t is not None]
    if not tables:
        return pd.DataFrame(
            {n: pd.Series(dtype=t.to_pandas_dtype()) for n, t in zip(SCHEMAS[kind].names, SCHEMAS[kind].types)}
        )
    return pa.concat_tables(tables, promote_options="default").to_pandas()
