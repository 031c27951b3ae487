"""The trace records both engines write, rlsched's and vLLM's (through its scheduler hook).

One step record per engine step and one sample record per finished sample, in the shared
schema (`traces/schema.py`), journaled every record so a crash loses at most the step in
flight. Instances of a pool share one folder: `tag` names this engine's parts. No torch.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from rlsched.traces.schema import POSITION_COLUMNS
from rlsched.traces.writer import TraceWriter


def position_counts(drafts, accepted) -> dict | None:
    """A chain step's counts by draft position i = 1..k (k: its longest draft) from each row's
    drafts and accepted drafts (`traces/schema.py`: POSITION_COLUMNS); None where nothing was
    drafted."""
    dk = np.asarray(drafts, dtype=np.int64).reshape(-1, 1)
    acc = np.minimum(np.asarray(accepted, dtype=np.int64).reshape(-1, 1), dk)
    k = int(dk.max(initial=0))
    if k == 0:
        return None
    i = np.arange(1, k + 1)
    drafted = dk >= i
    return dict(
        accepted_by_position=(acc >= i).sum(0).tolist(),
        tried_by_position=(drafted & (acc >= i - 1)).sum(0).tolist(),
        drafted_by_position=drafted.sum(0).tolist(),
    )


def step_record(
    rl_step: int,
    instance: int,
    step: int,
    time_s: float,
    kind: str,
    batch: int,
    drafter: str | None,
    k: int,
    width: int,
    drafted: int,
    accepted: int,
    emitted: int,
    draft_ms: float,
    verify_ms: float,
    step_ms: float,
    ctx_tokens: int,
    positions: dict | None = None,
) -> dict:
    """One engine step: `kind` prefill, decode or mixed; `drafter` None when nothing was drafted;
    `positions` a chain step's counts by draft position (`position_counts`; None: not counted)."""
    counts = positions or {}
    return dict(
        rl_step=rl_step,
        instance=instance,
        step=step,
        time_s=time_s,
        kind=kind,
        batch=batch,
        drafter=drafter or "off",
        k=k,
        width=width,
        drafted=drafted,
        accepted=accepted,
        emitted=emitted,
        draft_ms=draft_ms,
        verify_ms=verify_ms,
        step_ms=step_ms,
        ctx_tokens=ctx_tokens,
        **{name: counts.get(name) for name in POSITION_COLUMNS},
    )


def sample_record(
    rl_step: int,
    req,
    instance: int,
    response_len: int,
    finish_s: float,
    preemptions: int,
    migrations: int,
    drafted: int,
    accepted: int,
    rejected: int,
    acceptance: dict[str, float],
) -> dict:
    """One finished sample of request `req`, with `acceptance_<drafter>` for each drafter."""
    rec = dict(
        rl_step=rl_step,
        sample_id=req.sample_id,
        prompt_id=req.prompt_id,
        instance=instance,
        prompt_len=len(req.prompt),
        response_len=response_len,
        finish_s=finish_s,
        preemptions=preemptions,
        migrations=migrations,
        drafted=drafted,
        accepted=accepted,
        rejected=rejected,
    )
    for name, a in acceptance.items():
        rec[f"acceptance_{name}"] = a
    return rec


class Recorder:
    """An engine's step and sample trace writers under `trace_dir` (none when it is None:
    records are then dropped)."""

    def __init__(self, trace_dir: Path | None, tag: str = ""):
        self.trace_dir = None if trace_dir is None else Path(trace_dir)
        self._steps = self._samples = None
        if self.trace_dir is not None:
            self._steps = TraceWriter(self.trace_dir, "steps", flush_every=256, journal=True, tag=tag)
            self._samples = TraceWriter(self.trace_dir, "samples", flush_every=256, journal=True, tag=tag)

    @property
    def on(self) -> bool:
        return self._steps is not None

    def step(self, record: dict) -> None:
        if self._steps is not None:
            self._steps.append(record)

    def sample(self, record: dict) -> None:
        if self._samples is not None:
            self._samples.append(record)

    def flush(self) -> None:
        """Write the records so far as trace parts (readers see them before `close`)."""
        for w in (self._steps, self._samples):
            if w is not None:
                w.flush()

    def close(self) -> None:
        """Write the last trace parts (the journals hold every record until then)."""
        for w in (self._steps, self._samples):
            if w is not None:
                w.close()
        self._steps = self._samples = None
