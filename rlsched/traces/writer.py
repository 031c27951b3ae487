"""Writing traces so that nothing is ever half-written.

`write_table` writes a whole Parquet file atomically (temp file, then rename).
`TraceWriter` appends records in small Parquet parts, each renamed into place when complete,
so a process killed mid-run loses at most the records not yet flushed (the step in flight).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from rlsched.atomic import atomic_path
from rlsched.traces.schema import OPTIONAL_COLUMNS, SCHEMAS, TRACE_SCHEMA_VERSION


def to_table(kind: str, df: pd.DataFrame) -> pa.Table:
    """A DataFrame as a table of trace `kind`: the schema's columns cast to their types, the
    optional columns (`OPTIONAL_COLUMNS`) to theirs, other columns kept, the schema version in
    the metadata."""
    schema, optional = SCHEMAS[kind], OPTIONAL_COLUMNS[kind]
    missing = [n for n in schema.names if n not in df.columns]
    if missing:
        raise ValueError(f"{kind} records lack columns {missing}")
    table = pa.Table.from_pandas(df, preserve_index=False)
    fields = [
        schema.field(n) if n in schema.names else pa.field(n, optional[n]) if n in optional else table.schema.field(n)
        for n in table.column_names
    ]
    table = table.cast(pa.schema(fields))
    meta = {b"rlsched.trace": json.dumps({"kind": kind, "version": TRACE_SCHEMA_VERSION}).encode()}
    return table.replace_schema_metadata(meta)


def write_table(path: Path, table: pa.Table) -> None:
    """A whole Parquet file, atomically."""
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


def _plain(x):
    """json.dumps fallback for numpy scalars."""
    return x.item() if hasattr(x, "item") else str(x)


class TraceWriter:
    """Append-only records of one kind under `root/<kind>/part-NNNNNN.parquet`.

    Parquet parts hold `flush_every` records each. With `journal=True` every record is also
    appended (and flushed to the OS) to `part-NNNNNN.jsonl`, the journal of the part being
    filled, removed once that part is written: a process killed at any moment leaves every
    record it appended readable (`read_trace` reads journals whose part is missing), at the
    cost of a line of JSON per record instead of a Parquet file per record."""

    def __init__(self, root: Path, kind: str, flush_every: int = 1, journal: bool = False, tag: str = ""):
        self.dir = Path(root) / kind
        self.dir.mkdir(parents=True, exist_ok=True)
        self.kind, self.flush_every, self.journal = kind, flush_every, journal
        self.tag = f"-{tag}" if tag else ""  # writers sharing a folder (pool instances) each tag their parts
        self._rows: list[dict] = []
        numbers = []
        for p in self.dir.glob("part-*.*"):
            number, _, rest = p.name.split(".")[0][len("part-") :].partition("-")
            if p.suffix in (".parquet", ".jsonl") and (f"-{rest}" if rest else "") == self.tag and number.isdigit():
                numbers.append(int(number))
        self._next = max(numbers) + 1 if numbers else 0
        self._journal: IO[str] | None = None

    def _part(self, suffix: str) -> Path:
        return self.dir / f"part-{self._next:06d}{self.tag}{suffix}"

    def append(self, record: dict) -> None:
        self._rows.append(record)
        if self.journal:
            if self._journal is None:
                self._journal = open(self._part(".jsonl"), "a")  # noqa: SIM115 - open until close()
            self._journal.write(json.dumps(record, default=_plain) + "\n")
            self._journal.flush()
        if len(self._rows) >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        if not self._rows:
            return
        write_table(self._part(".parquet"), to_table(self.kind, pd.DataFrame(self._rows)))
        if self._journal is not None:  # the part is in place: its journal is no longer needed
            self._journal.close()
            Path(self._journal.name).unlink(missing_ok=True)
            self._journal = None
        self._next += 1
        self._rows = []

    def close(self) -> None:
        self.flush()
