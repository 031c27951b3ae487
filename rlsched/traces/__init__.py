"""Trace schema, crash-safe writer and reader. Never imports torch."""

from rlsched.traces.reader import read_trace
from rlsched.traces.schema import SAMPLE_SCHEMA, STEP_SCHEMA, TRACE_SCHEMA_VERSION
from rlsched.traces.writer import TraceWriter, to_table, write_table

__all__ = [
    "read_trace",
    "SAMPLE_SCHEMA",
    "STEP_SCHEMA",
    "TRACE_SCHEMA_VERSION",
    "TraceWriter",
    "to_table",
    "write_table",
]
