"""Compiled forwards for decode and verify steps (`torch.compile`, inductor), opt-in.

A step of a small model is op dispatch more than arithmetic: the built-in drafter's one-token
forward is ~40 small kernels, and even the target's step at 64 rows spends much of its time
outside its matmuls. Compiled, the pointwise ops fuse into a few C++ loops and the wrapper
calls the rest from C++ (`cpp_wrapper`), which cuts a drafter forward at one row the most
(figures: docs/benchmarks.md). The eager `Transformer.forward`
stays the reference and the fallback; this is the same arithmetic written for graphs that are
compiled once:

- one row attends to its whole cache row with a mask (SDPA; its graph is static but for the
  cache's length); two or more rows attend to the first `upto` positions of theirs (the
  longest row's length after the step), as the eager forward's two batched matmuls
  (`cached_attention`). That graph is dynamic in the number of rows and in `upto`, which it
  reads off the shape of a view of an arange (`_seen`), so a step that reads one position
  more does not compile again;
- the new keys and values are written with `index_put_` on views of the rows (`_row_views`),
  which inductor does in place (with `index_copy_` through a view of a layer of the whole
  cache, or `scatter_` on a row's slice of it, it copies the cache back, a large cost a
  forward at many cache rows);
- positions and the rotary tables come in as tensors; the last kept token's logits are
  sliced outside (one graph serves decode, verify and a drafter's feed).

It applies to up to `max_batch` consecutive cache rows (the engine keeps its rows so) and at
most `max_new` new tokens a row (a decode step, a verify of k <= max_new - 1 drafts, a
drafter's feed; rows may keep different numbers of them), without autograd; any other
forward (scattered rows, longer prefills, training) runs eager. One graph per number of new
tokens at one row and one from two rows on, all compiled when the model is (inductor keeps
them on disk, so a second process compiles them much faster). What it pays in the engine:
`bench/engine.py`'s compiled rows (docs/benchmarks.md).
"""

from __future__ import annotations

import itertools
import types

import torch
import torch.nn.functional as F

from rlsched.executor.model.kvcache import KVCache
from rlsched.executor.model.ops import cached_attention, rms_norm
from rlsched.executor.model.rope import apply_rope

_copies = itertools.count()


def compile_for_engine(target, drafters, k_max: int, max_batch: int, log=None) -> None:
    """What `generate --compile` and `profile --compile` run: the target's forwards for decode
    and verify of up to k_max drafts, each model drafter's for its drafts and two-token feed,
    for up to max_batch rows."""
    if log:
        log(f"compiling the forwards of up to {max_batch} rows (minutes the first time; inductor keeps them on disk)")
    target.compile_decode(k_max + 1, max_batch)
    for d in drafters:
        d.compile_decode(2, max_batch)


def _own_code(fn):
    """A copy of `fn` with a code object of its own. Dynamo keeps a function's graphs on its
    code object and checks their guards in turn on every call: with a target's and a
    drafter's graphs on one, a drafter forward would first fail the target's guards, which
    makes it markedly slower in the engine's pattern than alone."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{next(_copies)}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


def _row_views(cache: KVCache, start: int, b: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Views (b, heads, max_len, head_dim) of cache rows start..start+b-1, a key and a value
    view a layer, made once a cache and row range. Their strides do not depend on the cache's
    number of rows (a view across layers would, and dynamo would make a graph per cache size); their
    length is dynamic (one graph for every cache length), and so is their number of rows
    from two on."""
    views = cache.__dict__.setdefault("_row_views", {})
    if (start, b) not in views:
        keys = [k[start : start + b] for k in cache.keys]
        values = [v[start : start + b] for v in cache.values]
        for t in keys + values:
            torch._dynamo.maybe_mark_dynamic(t, 2)
            if b > 1:
                torch._dynamo.maybe_mark_dynamic(t, 0)
        views[(start, b)] = keys, values
    return views[(start, b)]


class CompiledForward:
    """`model`'s cached forward of 1..`max_batch` consecutive cache rows and 1..`max_new` new
    tokens, one compiled graph for each number of tokens at one row and one (dynamic in the
    rows) from two rows on, all compiled here (so that no run stops mid-way to compile). Call
    it as the model's forward is called; it returns None where it does not apply (the caller
    then runs eager)."""

    def __init__(self, model, max_new: int = 8, max_batch: int = 1):
        import torch._dynamo.config as dynamo_config
        import torch._inductor.config as inductor_config

        # the generated wrapper in C++, not Python: cheaper a drafter forward
        inductor_config.cpp_wrapper = True
        # a graph per number of new tokens and rows (1, or more), per model (the default limit
        # is 8 a function)
        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 4 * max_new)
        self.model, self.max_new, self.max_batch = model, max_new, max_batch
        c = model.config
        self._dynamic_rope = c.rope_scaling is not None and c.rope_scaling.kind == "dynamic"
        self._marked = None  # the rope table last marked dynamic
        self._positions = None  # an arange over the cache's length (`_seen`)
        self._graph = torch.compile(_own_code(CompiledForward._trunk).__get__(self), dynamic=False)
        self._warm_up()

    @torch.inference_mode()
    def _warm_up(self) -> None:
        """Compile every graph now, with inputs made as the engine, the profiler and the model
        drafter make them: caches of inference tensors, forwards in inference mode. Dynamo
        guards on how a tensor was made, so a forward from outside inference mode (or on a
        cache made outside it) compiles graphs of its own on first use."""
        rows = (1, 2) if self.max_batch > 1 else (1,)
        cache = self.model.new_cache(max(rows), 2 * self.max_new + 8)
        dev = cache.lengths.device
        for b in rows:
            for q in range(1, self.max_new + 1):
                cache.free(torch.arange(b))
                # a read length (3 + q) unlike the number of rows: equal sizes would share a
                # symbol in the graph, which then holds only while they stay equal
                cache.lengths[:b] = 3
                self(torch.zeros((b, q), dtype=torch.long, device=dev), cache, None, None, False)

    def __call__(
        self, ids: torch.Tensor, cache: KVCache, slots, n: torch.Tensor | None, last_only: bool
    ) -> torch.Tensor | None:
        b, q = ids.shape
        if b > self.max_batch or q > self.max_new or torch.is_grad_enabled():
            return None
        if b == 1:
            start = 0 if slots is None else int(slots[0])
            longest = int(cache.lengths[start])
        else:
            start = 0 if slots is None else cache.consecutive(cache.rows(slots, b))
            if start is None:
                return None  # scattered rows: eager (the engine keeps its rows consecutive)
            longest = max(cache.lengths[start : start + b].tolist())
        c = self.model.config
        if longest + q > cache.max_len or (c.sliding_window is not None and longest + q > c.sliding_window):
            return None  # the eager forward raises the error
        if self._dynamic_rope and cache.max_len > c.max_position_embeddings:
            return None  # frequencies that depend on the length: eager
        if b > 1 and longest + q < 2:
            return None  # a read length of 1 would be specialised (a graph of its own): eager
        cos, sin = self._tables(cache.max_len, self.model.embed.weight.dtype, ids.device)
        keys, values = _row_views(cache, start, b)
        lengths = cache.lengths[start : start + b]
        pos = lengths.clone()
        seen = None
        if b > 1:  # one graph for every number of rows from two on and every read length
            torch._dynamo.maybe_mark_dynamic(ids, 0)
            torch._dynamo.maybe_mark_dynamic(pos, 0)
            seen = self._seen(longest + q, cache.max_len, ids.device)
        logits = self._graph(ids, pos, keys, values, cos, sin, seen)
        if n is None:
            lengths.add_(q)
            return logits[:, -1:] if last_only else logits
        lengths.add_(n)
        if not last_only:
            return logits
        return logits[torch.arange(b, device=logits.device), n - 1][:, None]

    def _seen(self, upto: int, max_len: int, device) -> torch.Tensor:
        """Positions 0..upto-1, a view of one arange (dynamic in its length): the graph of two
        or more rows reads keys up to there, and takes that length from this tensor's shape."""
        full = self._positions
        if full is None or full.shape[0] < max_len or full.device != device:
            full = self._positions = torch.arange(max_len, device=device)
        seen = full[:upto]
        torch._dynamo.maybe_mark_dynamic(seen, 0)
        return seen

    def _tables(self, length: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The rope's cos/sin tables, grown to cover every position of the cache; their length
        is dynamic in the graphs (a longer cache regrows them, which would otherwise compile
        every graph again mid-run)."""
        rope = self.model.rope
        table = getattr(rope, "_table", None)
        if table is None or table[0].shape[0] < length or table[0].dtype != dtype or table[0].device != device:
            rope.forward(torch.zeros((1, 1), dtype=torch.long, device=device), dtype, length)
            table = rope._table
        if table[0] is not self._marked:
            for t in table[:2]:
                torch._dynamo.maybe_mark_dynamic(t, 0)
            self._marked = table[0]
        return table[0], table[1]

    def _trunk(self, ids, pos, keys, values, cos_t, sin_t, seen):
        """Logits for ids (B, q) at positions pos[b] + 0..q-1 of B cache rows: keys and values
        are views of them, one a layer, written in place. One row (`seen` None) attends to its
        whole cache row with a mask (SDPA); two or more attend to the first `len(seen)`
        positions of theirs, as two batched matmuls (`cached_attention`)."""
        m = self.model
        c = m.config
        nh, nkv, hd, eps = c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps
        b, q = ids.shape
        embed = m.embed.weight
        p = pos[:, None] + torch.arange(q, device=ids.device)  # (B, q)
        cos, sin = cos_t[p][:, None], sin_t[p][:, None]  # (B, 1, q, d)
        if seen is None:
            seen = torch.arange(keys[0].shape[2], device=ids.device)
        length = seen.shape[0]
        mask = torch.zeros((), dtype=embed.dtype, device=ids.device).masked_fill(
            seen[None, None, :] > p[:, :, None], float("-inf")
        )[:, None]  # (B, 1, q, L)
        if b > 1:  # laid out as `cached_attention`'s scores: (B * KV, G * q, L)
            g = nh // nkv
            mask = mask[:, None].expand(b, nkv, g, q, length).reshape(b * nkv, g * q, length)
        # where the new keys/values go: (row, head, position), broadcast to (B, KV, q)
        at = (
            torch.arange(b, device=ids.device)[:, None, None],
            torch.arange(nkv, device=ids.device)[None, :, None],
            p[:, None, :],
        )
        h = F.embedding(ids, embed)
        for i, blk in enumerate(m.layers):
            a = blk.attn
            x = rms_norm(h, blk.attn_norm.weight, eps)
            xqk, xv = F.linear(x, a.qkv.weight, a.qkv.bias).split_with_sizes([(nh + nkv) * hd, nkv * hd], dim=-1)
            xqk = xqk.view(b, q, nh + nkv, hd)
            if a.q_norm is not None:
                xq, xk = xqk.split_with_sizes([nh, nkv], dim=2)
                xqk = torch.cat([rms_norm(xq, a.q_norm.weight, eps), rms_norm(xk, a.k_norm.weight, eps)], dim=2)
            xq, xk = apply_rope(xqk.transpose(1, 2), cos, sin).split_with_sizes([nh, nkv], dim=1)
            xv = xv.view(b, q, nkv, hd).transpose(1, 2)
            keys[i].index_put_(at, xk)
            values[i].index_put_(at, xv)
            if b > 1:
                out = cached_attention(xq, keys[i][:, :, :length], values[i][:, :, :length], mask, nkv)
            else:
                out = F.scaled_dot_product_attention(xq, keys[i], values[i], attn_mask=mask, enable_gqa=nkv != nh)
            h = h + F.linear(out.transpose(1, 2).reshape(b, q, nh * hd), a.o.weight, a.o.bias)
            x = rms_norm(h, blk.mlp_norm.weight, eps)
            gate, up = F.linear(x, blk.mlp.gate_up.weight, blk.mlp.gate_up.bias).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, blk.mlp.down.weight, blk.mlp.down.bias)
        h = rms_norm(h, m.norm.weight, eps)
        return F.linear(h, embed if m.lm_head is None else m.lm_head.weight).float()
