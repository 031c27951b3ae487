"""A preallocated KV cache whose rows keep their own lengths.

Speculative decoding verifies k+1 tokens per row and then keeps a different number of them
in each row; continuous batching puts new sequences into free rows between steps. Both are
length bookkeeping here: a forward writes its tokens after each row's length and advances
it; `trim` moves a row's length back (the dropped entries stay in memory but are masked out
and overwritten by the next write); `free` empties a row. Only a draft tree's verification
moves entries: `keep_path` moves the accepted branch next to the row's context.

Layout: one tensor (layers, 2, max_batch, kv_heads, max_len, head_dim), index 0 = keys,
1 = values; `lengths` (max_batch,) int64 on the same device.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_batch: int,
        max_len: int,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ):
        if max_batch < 1 or max_len < 1:
            raise ValueError(f"KV cache needs max_batch >= 1 and max_len >= 1 (got {max_batch}, {max_len})")
        self.max_batch, self.max_len = max_batch, max_len
        self.kv = torch.zeros(num_layers, 2, max_batch, num_kv_heads, max_len, head_dim, device=device, dtype=dtype)
        self.lengths = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.on_cpu = self.lengths.device.type == "cpu"
        # per-layer views, indexed once here rather than twice per access in every forward
        self.keys = [self.kv[layer, 0] for layer in range(num_layers)]
        self.values = [self.kv[layer, 1] for layer in range(num_layers)]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Memory one cached token costs, for sizing a cache to a budget."""
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def rows(self, slots: torch.Tensor | None, batch: int) -> torch.Tensor:
        """The cache rows a batch of `batch` sequences uses: `slots`, or rows 0..batch-1."""
        if slots is None:
            if batch > self.max_batch:
                raise ValueError(f"batch {batch} exceeds the cache's max_batch {self.max_batch}")
            return torch.arange(batch, device=self.lengths.device)
        slots = torch.as_tensor(slots, dtype=torch.long, device=self.lengths.device)
        if slots.shape != (batch,):
            raise ValueError(f"slots must have shape ({batch},), got {tuple(slots.shape)}")
        return slots

    def write(
        self,
        layer: int,
        rows: torch.Tensor,
        positions: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        start: int | None = None,
        first: int | None = None,
        flat: torch.Tensor | None = None,
    ) -> None:
        """Store k, v (B, kv_heads, q, head_dim) of row rows[b] at positions[b] (B, q). When the
        rows are start..start+B-1 and every row's positions begin at `first`, a plain slice
        copy (no index tensors); otherwise one index_copy_ per tensor at `flat_index(rows,
        positions)` (pass it to compute it once for all layers)."""
        if start is not None and first is not None:
            b, q = positions.shape
            self.keys[layer][start : start + b, :, first : first + q] = k
            self.values[layer][start : start + b, :, first : first + q] = v
            return
        if flat is None:
            flat = self.flat_index(rows, positions)
        d = k.shape[-1]
        self.keys[layer].view(-1, d).index_copy_(0, flat, k.reshape(-1, d))
        self.values[layer].view(-1, d).index_copy_(0, flat, v.reshape(-1, d))

    def flat_index(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Where (row, head, position) lands in one layer's keys viewed as (-1, head_dim), in
        the order of k (B, kv_heads, q, head_dim): an index_copy_ is cheaper than the
        equivalent advanced-index assignment."""
        heads = torch.arange(self.kv.shape[3], device=rows.device)
        return (
            (rows[:, None, None] * self.kv.shape[3] + heads[None, :, None]) * self.max_len + positions[:, None, :]
        ).reshape(-1)

    def read(self, layer: int, rows: torch.Tensor, upto: int, start: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (B, kv_heads, upto, head_dim) of the given rows; views when the rows
        are the consecutive range start..start+B-1, a gather otherwise."""
        if start is not None:
            end = start + rows.shape[0]
            return self.keys[layer][start:end, :, :upto], self.values[layer][start:end, :, :upto]
        return self.keys[layer][rows, :, :upto], self.values[layer][rows, :, :upto]

    def consecutive(self, rows: torch.Tensor) -> int | None:
        """The first row when `rows` is a consecutive ascending range (reads are then views, no
        copy), else None. Checked on the CPU only (on a GPU it would cost a sync), on a Python
        list, which is cheaper than tensor ops at these sizes (once per forward)."""
        if not self.on_cpu:
            return None
        r = rows.tolist()
        first = r[0]
        ok = first + len(r) <= self.max_batch and r == list(range(first, first + len(r)))
        return first if ok else None

    def trim(self, slots, new_lengths, *, check: bool = True) -> None:
        """Drop the tail of rows: row slots[i] keeps its first new_lengths[i] tokens.
        `check=False` skips the bounds check, for callers whose lengths hold by construction
        (a speculative step trims twice per step, and the check is a large part of the trim)."""
        slots = torch.as_tensor(slots, dtype=torch.long, device=self.lengths.device)
        new = torch.as_tensor(new_lengths, dtype=torch.long, device=self.lengths.device)
        if check and (bool((new < 0).any()) or bool((new.expand(slots.shape) > self.lengths[slots]).any())):
            raise ValueError("trim can only shorten rows (0 <= new length <= current length)")
        self.lengths[slots] = new

    def keep_path(self, slots, start: torch.Tensor, keep_index: torch.Tensor, n_keep: torch.Tensor) -> None:
        """After a draft tree's verification: row slots[b] keeps its first start[b] + 1 tokens
        (its context and the root) and then the accepted nodes, whose entries were written at
        start[b] + 1 + keep_index[b, j] and move to start[b] + 1 + j, for j < n_keep[b].
        One gather and one scatter over all layers, keys and values at once."""
        rows = torch.as_tensor(slots, dtype=torch.long, device=self.lengths.device)
        start = torch.as_tensor(start, dtype=torch.long, device=rows.device)
        keep = torch.as_tensor(keep_index, dtype=torch.long, device=rows.device)
        n = torch.as_tensor(n_keep, dtype=torch.long, device=rows.device).expand(rows.shape)
        if keep.shape[1]:
            j = torch.arange(keep.shape[1], device=rows.device)
            used = j < n[:, None]
            # unused slots copy the root onto itself: a position no move writes to
            src = torch.where(used, start[:, None] + 1 + keep, start[:, None])
            dst = torch.where(used, start[:, None] + 1 + j, start[:, None])
            self.kv[:, :, rows[:, None], :, dst] = self.kv[:, :, rows[:, None], :, src]
        self.lengths[rows] = start + 1 + n

    def move(self, src: int, dst: int) -> None:
        """Row `src`'s cached tokens into the empty row `dst`; `src` is emptied."""
        self.copy_prefix(src, dst, int(self.lengths[src]))
        self.lengths[src] = 0

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Row `dst` holds row `src`'s first n cached tokens (a shared prompt), and only those."""
        self.kv[:, :, dst, :, :n] = self.kv[:, :, src, :, :n]
        self.lengths[dst] = n

    def free(self, slots) -> None:
        """Empty rows so that new sequences can take them."""
        slots = torch.as_tensor(slots, dtype=torch.long, device=self.lengths.device)
        self.lengths[slots] = 0
