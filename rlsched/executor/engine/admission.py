"""Rows joining rlsched's engine: queued rows take free cache slots while KV room allows, in one
ragged prefill (a prompt another row already holds is copied, not computed, as vLLM's prefix
cache shares a group's prompt), and running rows are kept in slots 0..n-1.

`Admission` is the part of `RolloutEngine` that runs before each step (`work`).
"""

from __future__ import annotations

import time

import torch

from rlsched.errors import UserError
from rlsched.executor.decode.speculative import prefill
from rlsched.executor.engine.recorder import step_record
from rlsched.executor.engine.rows import Row, kv_reserved, reserve


class Admission:
    """Cache slots, admissions and prefills; mixed into `RolloutEngine`, whose queue, running
    rows, cache, drafters and recorder it works on."""

    def _ensure_cache(self, longest_reserve: int) -> None:
        """A cache of max_batch rows long enough for the longest request plus k_max (a ragged
        verify writes K + 1 positions in every row, padding included; reused if it is)."""
        need = longest_reserve + self.k_max
        if self._cache is None or self._cache.max_len < need:
            self._cache = self.model.new_cache(self.max_batch, need)
        self._cache.free(torch.arange(self.max_batch))
        for name, d in self.drafters.items():
            c = getattr(d, "cache", None)  # a model drafter's own cache must hold as much
            if c is not None and (c.max_batch < self.max_batch or c.max_len < need):
                raise UserError(
                    f"drafter '{name}': its KV cache ({c.max_batch} rows x {c.max_len}) is smaller than "
                    f"the engine needs ({self.max_batch} rows x {need}); build it with max_batch >= "
                    f"{self.max_batch} and max_len >= {need}"
                )

    def _admit(self) -> int:
        """Queued rows join (in order) while slots and KV room allow; one ragged prefill of
        their tokens so far (the prompt, or a migrated row's prompt and response). Returns the
        KV tokens the running rows then reserve."""
        running = self._running
        free_slots = [s for s in range(self.max_batch) if s not in running]
        room = self.cache_capacity - kv_reserved(running)
        joining: list[Row] = []
        while self._queue and free_slots and reserve(self._queue[0].req) <= room:
            row = self._queue.pop(0)
            room -= reserve(row.req)
            row.seq.slot = free_slots.pop(0)
            joining.append(row)
        if not joining:
            return self.cache_capacity - room
        t = time.perf_counter()
        computed, copies = plan_prefill(self._running, joining, self.share_prompts)
        if computed:
            states = {} if self._observers else None
            prefill(
                self.model, self._cache, [r.seq.slot for r in computed], [r.seq.tokens for r in computed], states=states
            )
            for i, st in (states or {}).items():
                for d in self._observers:
                    d.remember(computed[i].seq.tokens[:-1], st)
        for row, src in copies:
            self._cache.copy_prefix(src, row.seq.slot, len(row.seq.tokens) - 1)
        ms = (time.perf_counter() - t) * 1e3
        for row in joining:
            row.last = row.seq.tokens[-1]
            running[row.seq.slot] = row
        if computed:  # the tokens computed: what a prefill's time is a function of
            ctx = sum(len(r.seq.tokens) for r in computed)
            # fmt: off
            self.recorder.step(step_record(
                self.rl_step, self.instance, self.step_index, t - self._t0, "prefill", len(computed), None,
                0, 0, 0, 0, 0, 0.0, ms, ms, ctx,
            ))
            # fmt: on
        return self.cache_capacity - room

    def _compact(self) -> None:
        """Running rows in cache slots 0..n-1, in slot order, so that every layer reads the
        cache as views: rows finish (or leave) at different times, and the holes they leave
        would make every step gather all rows' keys and values in every layer. A row moves by
        copying its cached tokens, in the target's cache and in a model drafter's."""
        running = self._running
        n = len(running)
        movers = sorted(s for s in running if s >= n)
        holes = [s for s in range(n) if s not in running]
        for src, dst in zip(movers, holes):
            self._cache.move(src, dst)
            for d in self.drafters.values():
                if hasattr(d, "move"):
                    d.move(src, dst)
            row = running.pop(src)
            row.seq.slot = dst
            running[dst] = row
        self._running = dict(sorted(running.items()))


def plan_prefill(
    running: dict[int, Row], joining: list[Row], share_prompts: bool
) -> tuple[list[Row], list[tuple[Row, int]]]:
    """(rows to prefill, (row, source slot) pairs whose prompt's KV is copied instead).

    GRPO samples every prompt `group_size` times: with `share_prompts`, a fresh row whose
    prompt another row of this engine already holds (running, or prefilled in this same
    step) copies that row's prompt KV, as vLLM's prefix cache lets a group share one
    prefill. Rows that bring generated tokens (migrated ones) are prefilled whole."""
    if not share_prompts:
        return joining, []
    holder = {tuple(r.req.prompt): slot for slot, r in running.items()}
    computed, copies = [], []
    for row in joining:
        key = tuple(row.req.prompt)
        fresh = len(row.seq.tokens) == len(row.req.prompt)
        if fresh and key in holder:
            copies.append((row, holder[key]))
            continue
        computed.append(row)
        if fresh:
            holder.setdefault(key, row.seq.slot)
    return computed, copies
