"""Compact per-step timeline: typed column buffers (8 bytes or less per value), so a
million engine steps cost tens of MB, not a list of Python objects."""

from __future__ import annotations

from array import array

import numpy as np

KIND_DECODE, KIND_PREFILL = 0, 1
KINDS = ("decode", "prefill")

# name -> array typecode
COLUMNS = {
    "rl_step": "i", "instance": "i", "step": "q", "t_start": "d", "kind": "b", "batch": "i", "drafter": "h",
    "k": "h", "width": "h", "drafted": "q", "accepted": "q", "emitted": "q", "draft_s": "d", "verify_s": "d",
    "ctx_tokens": "q",
}


class Timeline:
    """Append-only step records of every instance; `append` takes the values in COLUMNS order."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.cols = {name: array(code) for name, code in COLUMNS.items()}
        self._appends = tuple(c.append for c in self.cols.values())

    def append(self, *values) -> None:
        for add, v in zip(self._appends, values):
            add(v)

    def __len__(self) -> int:
        return len(self.cols["step"])

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: np.frombuffer(col, dtype=col.typecode) if len(col) else np.zeros(0, dtype=col.typecode)
                for name, col in self.cols.items()}
