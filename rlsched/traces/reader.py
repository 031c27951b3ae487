"""Reading traces back, with one clear error naming the file and what is wrong.

A journal (`part-NNNNNN.jsonl`, see writer.TraceWriter) holds one JSON object per line. Its
last line may be cut short by a writer killed mid-write: that line (the record in flight) is
dropped with one warning line on stderr. Any other line that is not a record is refused with
the file and the line number.

An engine-core trace folder (the `trace_dir` of rlsched's scheduler inside vLLM) holds
`engine-<tag>.json` (what each engine process ran), `steps/` and `samples/` parts named
`part-NNNNNN-<tag>`; `read_engine_files` reads and checks the engine files, `read_trace(...,
tag=)` one engine's parts.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from rlsched.errors import UserError
from rlsched.traces.schema import OPTIONAL_COLUMNS, SCHEMAS, TRACE_SCHEMA_VERSION

_warned: set[Path] = set()  # journals whose dropped last line was already reported


def _first_line(e: BaseException) -> str:
    """The first line of an exception's message (pyarrow's conversion errors hold several)."""
    text = "; ".join(a for a in e.args if isinstance(a, str)) or str(e)
    text = text.strip()
    return text.splitlines()[0] if text else type(e).__name__


def _conform(path: Path, table: pa.Table, kind: str) -> pa.Table:
    """The table with the schema's columns as the schema types them, and the optional columns
    it holds as `OPTIONAL_COLUMNS` types them (other columns kept)."""
    schema = SCHEMAS[kind]
    want_of = {**OPTIONAL_COLUMNS[kind], **dict(zip(schema.names, schema.types))}
    for name in [n for n in table.column_names if n in want_of]:
        want, have = want_of[name], table.schema.field(name).type
        if have == want:
            continue
        try:
            table = table.set_column(table.schema.get_field_index(name), name, table.column(name).cast(want))
        except (pa.ArrowException, ValueError, TypeError) as e:
            raise UserError(
                f"'{path}': column {name} holds {have} values where {want} is expected "
                f"({_first_line(e)}); re-create the file with rlsched"
            ) from None
    return table


def _read_one(path: Path, kind: str) -> pa.Table:
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise UserError(
            f"trace file '{path}' is corrupt or truncated ({_first_line(e)}); delete it or re-run the job that wrote it"
        ) from None
    meta = (table.schema.metadata or {}).get(b"rlsched.trace")
    if meta is None:
        raise UserError(f"trace file '{path}' is not an rlsched trace (no rlsched.trace metadata)")
    try:
        info = json.loads(meta)
    except (json.JSONDecodeError, UnicodeDecodeError):
        info = None
    if not isinstance(info, dict):
        raise UserError(f"trace file '{path}' has unreadable rlsched.trace metadata; re-create it with rlsched")
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
    return _conform(path, table, kind)


def read_profile(path: Path) -> pd.DataFrame:
    """Step-cost records of a run's profile.parquet (step records without the trace metadata)."""
    path = Path(path)
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise UserError(
            f"profile file '{path}' is corrupt or truncated ({_first_line(e)}); delete it or re-run"
        ) from None
    missing = [n for n in SCHEMAS["steps"].names if n not in table.column_names]
    if missing:
        raise UserError(f"profile file '{path}' lacks columns {', '.join(missing)}; delete it or re-run")
    return _conform(path, table, "steps").to_pandas()


def _record(raw: bytes) -> tuple[dict | None, str]:
    """A journal line as a record, or (None, why it is not one)."""
    try:
        record = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        return None, "not UTF-8 text"
    except json.JSONDecodeError as e:
        return None, f"not JSON: {e.msg} at column {e.colno}"
    if not isinstance(record, dict):
        return None, f"a JSON {type(record).__name__}, not an object"
    return record, ""


def _journal_rows(path: Path, kind: str) -> list[dict]:
    """The records of a journal's lines; a last line that is no record is dropped, with a warning."""
    try:
        lines = path.read_bytes().split(b"\n")
    except OSError as e:
        raise UserError(f"trace journal '{path}' cannot be read ({e.strerror or e}); check the file") from None
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    names = SCHEMAS[kind].names
    rows = []
    for i, raw in enumerate(lines):
        if not raw.strip():
            continue
        record, why = _record(raw)
        if record is None and i == last:
            if path not in _warned:
                _warned.add(path)
                print(
                    f"warning: trace journal '{path}' ends in an incomplete line {i + 1} ({why}): "
                    "dropped it, the record in flight when its writer stopped",
                    file=sys.stderr,
                )
            continue
        if record is None:
            raise UserError(
                f"trace journal '{path}' is corrupt at line {i + 1} ({why}); only a last line may be cut short: "
                "remove that line (its record is lost) or re-run the job that wrote the file"
            )
        missing = [n for n in names if n not in record]
        if missing:
            raise UserError(
                f"trace journal '{path}' line {i + 1}: the record lacks columns {', '.join(missing)}; "
                f"it is not a '{kind}' trace journal"
            )
        rows.append(record)
    return rows


def _read_journal(path: Path, kind: str) -> pa.Table | None:
    """The complete records of a part's journal (a line cut short by a crash is dropped)."""
    from rlsched.traces.writer import to_table

    rows = _journal_rows(path, kind)
    if not rows:
        return None
    try:
        return to_table(kind, pd.DataFrame(rows))
    except (pa.ArrowException, ValueError, TypeError, OverflowError) as e:
        raise UserError(
            f"trace journal '{path}' holds values of the wrong type ({_first_line(e)}); "
            "re-run the job that wrote the file"
        ) from None


def part_tag(path: Path) -> str:
    """The writer's tag of a part (`part-000003-e0-123.parquet` -> `e0-123`; untagged: "")."""
    return Path(path).name.split(".")[0][len("part-") :].partition("-")[2]


def part_files(folder: Path, tag: str | None = None) -> list[Path]:
    """A folder's parts in order (a journal only where its part was never written), those of
    writer `tag` alone where given."""
    return sorted(
        p
        for p in Path(folder).glob("part-*.*")
        if p.suffix in (".parquet", ".jsonl")
        and not (p.suffix == ".jsonl" and p.with_suffix(".parquet").exists())
        and (tag is None or part_tag(p) == tag)
    )


def read_trace(path: Path, kind: str, tag: str | None = None) -> pd.DataFrame:
    """Records of `kind` from a Parquet file, a folder of parts (in order; of writer `tag`
    alone where given), or the folder holding that one (`traces/` for `traces/<kind>/`).
    Journals of parts a killed writer never wrote are read too."""
    path = Path(path)
    if path.is_dir() and (path / kind).is_dir():
        path = path / kind
    if path.is_dir():
        files = part_files(path, tag)
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
    try:
        return pa.concat_tables(tables, promote_options="permissive").to_pandas()
    except (pa.ArrowException, ValueError, TypeError) as e:
        raise UserError(
            f"the trace parts in '{path}' disagree on a column's type ({_first_line(e)}); "
            "re-create them with one rlsched"
        ) from None


# ----------------------------------------------------------------------------- engine-core trace folders

ENGINE_FORMAT = "rlsched-engine"
ENGINE_VERSION = 1
# whole-number fields and their least values; besides, drafter is a name; the rest is kept as written
_ENGINE_COUNTS = {"k_max": 0, "max_batch": 1, "tp": 1, "rank": 0}


def read_json(path: Path, label: str = "", fix: str = "re-run the command that wrote it"):
    """A JSON file's content; one UserError naming it (`label` before its path) where it is
    not JSON or cannot be read."""
    try:
        return json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{label}'{path}' is not valid JSON ({_first_line(e)}); {fix}") from None
    except OSError as e:
        raise UserError(f"{label}'{path}' cannot be read ({e.strerror or e}); check the file") from None


def engine_file_paths(folder: Path) -> list[Path]:
    """The `engine-<tag>.json` files of an engine-core trace folder (none: not such a folder)."""
    folder = Path(folder)
    return sorted(folder.glob("engine-*.json")) if folder.is_dir() else []


def _engine_fault(data) -> str | None:
    """What is wrong with an engine file's content, or None."""
    if not isinstance(data, dict):
        return f"holds a JSON {type(data).__name__}, not an object"
    if data.get("format") != ENGINE_FORMAT:
        return f"format is {data.get('format')!r}, not {ENGINE_FORMAT!r}"
    if data.get("version") != ENGINE_VERSION:
        return f"version is {data.get('version')!r}; this rlsched reads version {ENGINE_VERSION}"
    block = data.get("rlsched")
    if not isinstance(block, dict) or not isinstance(block.get("policy"), str):
        return "rlsched.policy is missing or not a name"
    for key in ("cost_model", "trace_dir"):
        if block.get(key) is not None and not isinstance(block[key], str):
            return f"rlsched.{key} is {block[key]!r}, not a path or name"
    for key in ("seed", "probe_every"):
        v = block.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            return f"rlsched.{key} is {v!r}, not a whole number >= 0"
    if not isinstance(data.get("drafter"), str):
        return f"drafter is {data.get('drafter')!r}, not a name"
    for key, least in _ENGINE_COUNTS.items():
        v = data.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < least:
            return f"{key} is {v!r}, not a whole number >= {least}"
    return None


def read_engine_files(folder: Path) -> list[dict]:
    """Each engine file of an engine-core trace folder, checked, with `tag` (its name's) and
    `file` added; a damaged one is one UserError naming it and the field."""
    out = []
    for path in engine_file_paths(folder):
        fix = "restore the file the engine wrote, or delete it and the parts of its tag"
        data = read_json(path, "engine file ", fix)
        fault = _engine_fault(data)
        if fault is not None:
            raise UserError(f"engine file '{path}': {fault}; {fix}")
        out.append({**data, "tag": path.name[len("engine-") : -len(".json")], "file": str(path)})
    return out
