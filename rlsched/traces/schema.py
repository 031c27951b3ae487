"""Trace schema shared by the simulator and the executor (version-stamped Parquet).

- step records: one per engine step of each instance; a chain step of an engine that counts
  them also holds its counts by draft position (`POSITION_COLUMNS`, optional).
- sample records: one per sample of each rollout.
- rl_step records: one per RL step (stage times).
"""

from __future__ import annotations

import pyarrow as pa

TRACE_SCHEMA_VERSION = 1

STEP_SCHEMA = pa.schema(
    [
        ("rl_step", pa.int32()),
        ("instance", pa.int32()),
        ("step", pa.int64()),
        ("time_s", pa.float64()),
        ("kind", pa.string()),
        ("batch", pa.int32()),
        ("drafter", pa.string()),
        ("k", pa.int16()),
        ("width", pa.int16()),
        ("drafted", pa.int64()),
        ("accepted", pa.int64()),
        ("emitted", pa.int64()),
        ("draft_ms", pa.float64()),
        ("verify_ms", pa.float64()),
        ("step_ms", pa.float64()),
        ("ctx_tokens", pa.int64()),
    ]
)

# Optional step columns: a chain step's counts by draft position i = 1..k (k: the longest draft
# of the step), over its rows. Null where nothing was drafted, for trees, and absent in traces
# of writers that do not count them (the simulator's, vLLM's metrics): readers fall back to the
# step's sums. accepted_i <= tried_i, and accepted_i given tried_i is Binomial(tried_i, alpha_i):
# the i-th draft of a row is tried only where it was drafted and every draft before it accepted.
POSITION_COLUMNS = {
    "accepted_by_position": "rows whose i-th draft was accepted",
    "tried_by_position": "rows that drafted position i and had every draft before it accepted",
    "drafted_by_position": "rows that drafted at least i drafts",
}
OPTIONAL_COLUMNS = {"steps": {name: pa.list_(pa.int32()) for name in POSITION_COLUMNS}, "samples": {}, "rl_steps": {}}

SAMPLE_SCHEMA = pa.schema(
    [
        ("rl_step", pa.int32()),
        ("sample_id", pa.int64()),
        ("prompt_id", pa.int64()),
        ("instance", pa.int32()),
        ("prompt_len", pa.int64()),
        ("response_len", pa.int64()),
        ("finish_s", pa.float64()),
        ("preemptions", pa.int32()),
        ("migrations", pa.int32()),
    ]
)  # plus optional acceptance_<drafter> float64 columns

RL_STEP_SCHEMA = pa.schema(
    [
        ("rl_step", pa.int32()),
        ("generation_s", pa.float64()),
        ("inference_s", pa.float64()),
        ("training_s", pa.float64()),
        ("drafter_update_s", pa.float64()),
        ("total_s", pa.float64()),
        ("prompt_tokens", pa.int64()),
        ("response_tokens", pa.int64()),
    ]
)  # plus optional accept_mean_<drafter> float64 columns

SCHEMAS = {"steps": STEP_SCHEMA, "samples": SAMPLE_SCHEMA, "rl_steps": RL_STEP_SCHEMA}
