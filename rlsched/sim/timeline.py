"""Compact per-step timeline. Steps are appended as tuples (cheap in the hot loop) and
packed every few thousand rows into typed column arrays, so a million engine steps cost
tens of MB, not a list of Python objects."""

from __future__ import annotations

import numpy as np

# mixed: decode/verify rows beside prompt chunks in one step (`engine.kind: vllm`)
KIND_DECODE, KIND_PREFILL, KIND_MIXED = 0, 1, 2
KINDS = ("decode", "prefill", "mixed")

# name -> numpy dtype, in `append` order
COLUMNS = {
    "rl_step": np.int32,
    "instance": np.int32,
    "step": np.int64,
    "t_start": np.float64,
    "kind": np.int8,
    "batch": np.int32,
    "drafter": np.int16,
    "k": np.int16,
    "width": np.int16,
    "drafted": np.int64,
    "accepted": np.int64,
    "emitted": np.int64,
    "draft_s": np.float64,
    "verify_s": np.float64,
    "ctx_tokens": np.int64,
}
_CHUNK = 8192


class Timeline:
    """Append-only step records of every instance; `append` takes one tuple in COLUMNS order."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._rows: list[tuple] = []
        self._chunks: list[tuple[int, tuple]] = []  # (rows, columns)
        self._n_packed = 0

    def append(self, row: tuple) -> None:
        rows = self._rows
        rows.append(row)
        if len(rows) >= _CHUNK:
            self._pack()

    def append_run(self, columns: tuple, n: int) -> None:
        """n rows at once: each column an array of n values or one value for all (expanded
        only when the arrays are read)."""
        self._pack()
        self._chunks.append((n, columns))
        self._n_packed += n

    def _pack(self) -> None:
        if not self._rows:
            return
        self._chunks.append(
            (len(self._rows), tuple(np.asarray(c, dtype=t) for c, t in zip(zip(*self._rows), COLUMNS.values())))
        )
        self._n_packed += len(self._rows)
        self._rows = []

    def __len__(self) -> int:
        return self._n_packed + len(self._rows)

    def arrays(self) -> dict[str, np.ndarray]:
        self._pack()
        total = self._n_packed
        out = {name: np.empty(total, dtype=t) for name, t in COLUMNS.items()}
        cols_out = list(out.values())
        o = 0
        for n, cols in self._chunks:
            for dst, c in zip(cols_out, cols):
                dst[o : o + n] = c
            o += n
        return out
