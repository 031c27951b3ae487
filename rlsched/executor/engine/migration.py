"""Row migration between rlsched's engines: a running row leaves one engine with its tokens,
log-probs, counters, acceptance counts and (optionally) its KV cache rows, and joins another.

`RowMigration` is the part of `RolloutEngine` a pool (`executor/pool/`) calls between two
steps: `view` (what its ReallocPolicy sees), `export_rows` on the source, `import_rows` on the
destination.
"""

from __future__ import annotations

import numpy as np
import torch

from rlsched.executor.decode.speculative import Seq
from rlsched.executor.engine.rows import Row, kv_reserved, reserve


class RowMigration:
    """Export and import of running rows; mixed into `RolloutEngine`, whose queue, running
    rows, cache, drafters and estimator it moves rows between."""

    def view(self) -> dict:
        """What a reallocation policy sees of this instance (InstanceView's fields)."""
        rows = list(self._running.values())
        return dict(
            running_ids=np.array([r.index for r in rows], dtype=np.int64),
            running_ctx=np.array([len(r.seq.tokens) for r in rows], dtype=np.int64),
            waiting_ids=[r.index for r in self._queue],
            kv_free_tokens=self.cache_capacity - kv_reserved(self._running) - sum(reserve(r.req) for r in self._queue),
            max_batch=self.max_batch,
        )

    def export_rows(self, indices, with_kv: set | frozenset = frozenset()) -> list[dict]:
        """Take these samples off this instance (those still here: a sample that finished
        meanwhile has been reported and stays). Each leaves as a dict: its request, tokens,
        log-probs, counters, acceptance counts and, for indices in `with_kv`, its KV cache rows."""
        want = {int(i) for i in indices}
        with torch.inference_mode():
            self.estimator.retire(self._ids)  # apply pending acceptance counts before reading them
            out = []
            for row in [r for r in self._queue if r.index in want]:
                self._queue.remove(row)
                out.append(self._moved(row, None))
            leaving = [(slot, r) for slot, r in self._running.items() if r.index in want]
            for slot, row in leaving:
                kv = None
                if row.index in with_kv:
                    n = int(self._cache.lengths[slot])
                    kv = self._cache.kv[:, :, slot, :, :n].to("cpu", copy=True)  # travels between processes
                del self._running[slot]
                out.append(self._moved(row, kv))
            if leaving:
                self._cache.free(torch.tensor([s for s, _ in leaving], dtype=torch.long))
                for d in self.drafters.values():
                    if hasattr(d, "release"):
                        d.release([r.seq for _, r in leaving])
            return out

    def _moved(self, row: Row, kv) -> dict:
        counts = {d: self.estimator.take_sample_counts(d, row.index) for d in self.estimator.drafters}
        return dict(
            req=row.req,
            index=row.index,
            seq_tokens=list(row.seq.tokens),
            last=row.last,
            tokens=row.tokens,
            logprobs=row.logprobs,
            steps=row.steps,
            drafted=row.drafted,
            accepted=row.accepted,
            rejected=row.rejected,
            migrations=row.migrations + 1,
            counts=counts,
            kv=kv,
        )

    def import_rows(self, moved: list[dict]) -> None:
        """Rows from another instance: with KV they run at once in a free slot (their cache
        rows copied in); without (or when no slot is free) they queue to be re-prefilled."""
        with torch.inference_mode():
            for m in moved:
                row = _arrived(m)
                for d, (succ, fail) in m["counts"].items():
                    if d in self.estimator.drafters:
                        self.estimator.add_sample_counts(d, row.index, succ, fail)
                self._place(row, m["kv"])

    def _place(self, row: Row, kv) -> None:
        """A row that arrived: running at once in a free slot with its `kv` rows, else queued."""
        free = [s for s in range(self.max_batch) if s not in self._running]
        fits = kv_reserved(self._running) + reserve(row.req) <= self.cache_capacity
        if kv is not None and free and fits and kv.shape[3] + self.k_max + 1 <= self._cache.max_len:
            slot = free[0]
            n = kv.shape[3]
            self._cache.kv[:, :, slot, :, :n] = kv.to(self._cache.kv.device, self._cache.kv.dtype)
            self._cache.lengths[slot] = n
            row.seq.slot = slot
            self._running[slot] = row
        else:
            self._queue.append(row)


def _arrived(m: dict) -> Row:
    """The running row a migration dict (`RowMigration._moved`) describes."""
    return Row(
        m["req"],
        m["index"],
        Seq(list(m["seq_tokens"]), -1, m["req"].prompt_id),
        m["last"],
        list(m["tokens"]),
        list(m["logprobs"]),
        m["steps"],
        m["drafted"],
        m["accepted"],
        m["rejected"],
        migrations=m["migrations"],
    )
