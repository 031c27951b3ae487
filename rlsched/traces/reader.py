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
        raise UserError(f"trace file '{path}' is corrupt or truncated ({str(e).splitlines()[0]}); "
                        "delete it or re-run the job that wrote it") from None
    meta = (table.schema.metadata or {}).get(b"rlsched.trace")
    if meta is None:
        raise UserError(f"trace file '{path}' is not an rlsched trace (no rlsched.trace metadata)")
    info = json.loads(meta)
    if info.get("kind") != kind:
        raise UserError(f"trace file '{path}' holds '{info.get('kind')}' records, expected '{kind}'")
    if info.get("version") != TRACE_SCHEMA_VERSION:
        raise UserError(f"trace file '{path}' has schema version {info.get('version')}, this rlsched reads "
                        f"version {TRACE_SCHEMA_VERSION}; re-create it with this version")
    missing = [n for n in SCHEMAS[kind].names if n not in table.column_names]
    if missing:
        raise UserError(f"trace file '{path}' lacks columns {', '.join(missing)}")
    return table


def read_trace(path: Path, kind: str) -> pd.DataFrame:
    """Records of `kind` from a Parquet file or a folder of parts (in order)."""
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("part-*.parquet"))
    elif path.is_file():
        files = [path]
    else:
        raise UserError(f"trace '{path}' does not exist")
    if not files:
        return pd.DataFrame({n: pd.Series(dtype=t.to_pandas_dtype()) for n, t in zip(SCHEMAS[kind].names,
                                                                                       SCHEMAS[kind].types)})
    return pa.concat_tables([_read_one(f, kind) for f in files], promote_options="default").to_pandas()
