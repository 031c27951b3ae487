"""A decoder-only Llama-family transformer (Llama, Mistral, Qwen2/2.5, Qwen3) in plain PyTorch.

Written for the speculative executor, in the spirit of gpt-fast and nano-vllm: q/k/v and
gate/up are fused into one matmul each (fewer, larger kernels at small batch), attention is
`scaled_dot_product_attention` for one new token per row (from 32 ragged rows two batched
matmuls) and two batched matmuls for several, with an explicit mask built once per forward
from the cache rows' lengths, and a forward accepts q >= 1 new tokens per row at per-row
positions, so the same call does prefill, decode and verification of k drafts (q = k + 1),
and, given a `TreeMask`, of a draft tree's nodes (each sees only its ancestors).

Not implemented: sliding-window attention. Models that declare one (Mistral v0.1,
Qwen2 with `use_sliding_window`) run with full attention, which is exact as long as a row's
context stays within the window; a longer context raises rather than silently differing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from rlsched.executor.model.kvcache import KVCache
from rlsched.executor.model.ops import cached_attention, rms_norm
from rlsched.executor.model.rope import Rope, RopeScaling, apply_rope


@dataclass(frozen=True)
class ModelConfig:
    """The architecture, read from a HF config.json by `loading.load_config`."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 always; Llama/Qwen3 with attention_bias
    o_bias: bool = False  # Llama/Qwen3 with attention_bias
    mlp_bias: bool = False  # Llama with mlp_bias
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    sliding_window: int | None = None  # declared by the model, not implemented (see above)
    model_type: str = "llama"

    @property
    def shape(self) -> dict:
        """The architecture numbers a policy file is checked against (`policyfile.SHAPE_KEYS`,
        named as in the simulator's model presets)."""
        return dict(
            hidden=self.hidden_size,
            layers=self.num_layers,
            heads=self.num_heads,
            kv_heads=self.num_kv_heads,
            vocab=self.vocab_size,
        )

    def new_cache(self, max_batch: int, max_len: int, *, device="cpu", dtype: torch.dtype = torch.float32) -> KVCache:
        return KVCache(
            self.num_layers, self.num_kv_heads, self.head_dim, max_batch, max_len, device=device, dtype=dtype
        )


class RMSNorm(nn.Module):
    """Normalised in float32, scaled in the input dtype, as HF does."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self._eps = None  # eps as a tensor on the input's device, for addcmul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # mean(x^2) as |x|^2 / d from one norm kernel: cheaper on CPU than F.rms_norm,
            # whose CPU kernel is a composite of ~8 ops (the same values to ~1e-7)
            eps = self._eps
            if eps is None or eps.device != x.device:
                with torch.inference_mode(False):  # usable by training after rollouts
                    eps = self._eps = torch.tensor(self.eps, device=x.device)
            n = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
            return x * torch.rsqrt(torch.addcmul(eps, n, n, value=1 / x.shape[-1])) * self.weight
        return rms_norm(x, self.weight, self.eps)


class TreeMask(NamedTuple):
    """The attention of a forward over draft-tree nodes (`tree_verify.DraftTree` makes them).

    The forward's q new tokens are the last q of a tree region of T >= q tokens that starts
    at cache position R = L + q - T of each row (L: the row's length before the forward): new
    token j sees the row's cache before R and the region's token t iff visible[j, t], and
    its rotary position is R + rel[j] (its depth in the tree, not its place in the cache)."""

    visible: torch.Tensor  # (q, T) bool
    rel: torch.Tensor  # (q,) long


def _tree_attention(
    tree: TreeMask, positions: torch.Tensor, upto: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The additive mask (B, 1, q, upto) and rotary positions (B, q) of a tree forward whose
    new tokens are written at `positions` (B, q) (rows of ragged lengths)."""
    visible, rel = tree
    q, t = visible.shape
    region = positions[:, :1] + (q - t)  # (B, 1): where each row's tree region starts
    off = torch.arange(upto, device=positions.device) - region  # (B, upto): key's place in the region
    inside = (off >= 0) & (off < t)
    seen = visible[:, off.clamp(0, t - 1)].transpose(0, 1) & inside[:, None]  # (B, q, upto)
    hidden = ~(seen | (off < 0)[:, None])
    mask = torch.zeros(hidden.shape, dtype=dtype, device=positions.device).masked_fill_(hidden, float("-inf"))
    return mask[:, None], region + rel


@dataclass
class _Step:
    """What every layer of one forward shares: rows, positions, mask, rotary tables."""

    cache: KVCache | None
    rows: torch.Tensor | None
    start: int | None  # rows are start..start+B-1: the cache is read as views
    first: int | None  # every row's new tokens start at this position (writes are slice copies)
    positions: torch.Tensor  # (B, q)
    upto: int  # keys 0..upto-1 of each row are read
    mask: torch.Tensor | None  # (B, 1, q, upto) additive: 0 = attend, -inf = not; None: attend to all read
    flat: torch.Tensor | None  # where a ragged write lands in the cache (KVCache.flat_index), shared by all layers
    cos: torch.Tensor
    sin: torch.Tensor
    grouped: torch.Tensor | None = None  # the mask laid out for `_cached_attention`, made by the first layer

    def grouped_mask(self, nkv: int, g: int) -> torch.Tensor:
        """The mask (B, 1, q, L) repeated for every query head as (B * KV, G * q, L), the
        layout of `_cached_attention`'s scores: one copy per forward instead of a broadcast
        add in every layer. (Every forward of q > 1 new tokens has a mask.)"""
        if self.grouped is None:
            b, _, q, length = self.mask.shape
            self.grouped = (
                self.mask.view(b, 1, 1, q, length).expand(b, nkv, g, q, length).reshape(b * nkv, g * q, length)
            )
        return self.grouped


BMM_MIN_BATCH = 32  # one new token per row on CPU: two batched matmuls from this many ragged rows, SDPA below


class Attention(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.nh, self.nkv, self.hd = c.num_heads, c.num_kv_heads, c.head_dim
        self.qkv = nn.Linear(c.hidden_size, (self.nh + 2 * self.nkv) * self.hd, bias=c.qkv_bias)
        self.o = nn.Linear(self.nh * self.hd, c.hidden_size, bias=c.o_bias)
        if c.qk_norm:
            self.q_norm = RMSNorm(self.hd, c.rms_norm_eps)
            self.k_norm = RMSNorm(self.hd, c.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, layer: int, s: _Step) -> torch.Tensor:
        b, q, _ = x.shape
        qkv = F.linear(x, self.qkv.weight, self.qkv.bias)
        # split_with_sizes: Tensor.split's Python wrapper costs more than the view itself here
        xqk, xv = qkv.split_with_sizes([(self.nh + self.nkv) * self.hd, self.nkv * self.hd], dim=-1)
        xqk = xqk.view(b, q, self.nh + self.nkv, self.hd)
        if self.q_norm is not None:
            xq, xk = xqk.split_with_sizes([self.nh, self.nkv], dim=2)
            xqk = torch.cat([self.q_norm.forward(xq), self.k_norm.forward(xk)], dim=2)
        # q and k heads rotated together: one set of rotary ops per layer (they dominate the
        # cost of a small model's step, which is op count, not FLOPs)
        xq, xk = apply_rope(xqk.transpose(1, 2), s.cos, s.sin).split_with_sizes([self.nh, self.nkv], dim=1)
        xv = xv.view(b, q, self.nkv, self.hd).transpose(1, 2)
        if s.cache is not None:
            s.cache.write(layer, s.rows, s.positions, xk, xv, s.start, s.first, s.flat)
            xk, xv = s.cache.read(layer, s.rows, s.upto, s.start)
        bmm = q > 1 or (s.mask is not None and b >= BMM_MIN_BATCH and x.is_cpu)  # (measured on CPU only)
        if s.cache is not None and not torch.is_grad_enabled() and bmm:
            out = cached_attention(xq, xk, xv, s.grouped_mask(self.nkv, self.nh // self.nkv), self.nkv)
        else:
            out = F.scaled_dot_product_attention(xq, xk, xv, attn_mask=s.mask, enable_gqa=self.nkv != self.nh)
        return F.linear(out.transpose(1, 2).reshape(b, q, self.nh * self.hd), self.o.weight, self.o.bias)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up in one matmul."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.gate_up = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=c.mlp_bias)
        self.down = nn.Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up.weight, self.gate_up.bias).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down.weight, self.down.bias)


class Block(nn.Module):
    """Pre-norm attention and MLP with residuals. Inside a forward, submodules are run by
    their `forward` and linears by F.linear: nn.Module.__call__'s hook handling is measurable
    where a small model's step is op dispatch (CPU, batch 1)."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.attn = Attention(c)
        self.mlp_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(self, x: torch.Tensor, layer: int, s: _Step) -> torch.Tensor:
        x = x + self.attn.forward(self.attn_norm.forward(x), layer, s)
        return x + self.mlp.forward(self.mlp_norm.forward(x))


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        c = self.config = config
        self.embed = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        # Tied models read the output projection from `embed.weight` (no second parameter,
        # so loading with assign=True cannot untie them).
        self.lm_head = None if c.tie_word_embeddings else nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.rope = Rope(c.head_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings)
        self.compiled = None  # a CompiledForward once `compile_decode` was called
        self.capture: tuple[int, ...] | None = None  # layer ids whose input every forward keeps (`_trunk_capturing`)
        self.captured: torch.Tensor | None = None

    def compile_decode(self, max_new: int = 8, max_batch: int = 1) -> None:
        """Run cached forwards of up to `max_batch` rows and `max_new` new tokens a row (decode,
        verify of up to max_new - 1 drafts) through compiled graphs (`executor/model/compiled.py`),
        compiled now; everything else stays eager."""
        from rlsched.executor.model.compiled import CompiledForward

        self.compiled = CompiledForward(self, max_new, max_batch)

    def new_cache(self, max_batch: int, max_len: int) -> KVCache:
        """A cache on this model's device, in its dtype."""
        w = self.embed.weight
        return self.config.new_cache(max_batch, max_len, device=w.device, dtype=w.dtype)

    def forward(
        self,
        ids: torch.Tensor,
        cache: KVCache | None = None,
        *,
        slots=None,
        n_new=None,
        last_only: bool = False,
        tree: TreeMask | None = None,
    ) -> torch.Tensor:
        """Logits (float32) for `ids` (B, q) appended to each row's cached context.

        Row b is cache row `slots[b]` (default: b); its tokens go to positions
        `cache.lengths[row] + 0..q-1`, attend causally to that row's cache and to each
        other, and the row's length then grows by `n_new[b]` (default q): tokens past
        n_new[b] are padding for ragged batches (a prompt shorter than the longest, a row
        verifying fewer drafts), computed but dropped. After verification, `cache.trim`
        drops rejected tokens. Without a cache every row is one sequence from position 0.
        `last_only` returns only the logits of each row's last kept token: (B, 1, V).
        `tree` makes it a forward over draft-tree nodes (`TreeMask`): the tokens are written
        and kept as above, but each attends only to the row's context and its tree
        ancestors, at the rotary position of its depth (always eager).
        """
        b, q = ids.shape
        n = None  # every row keeps its q tokens
        if n_new is not None:
            n = torch.as_tensor(n_new, dtype=torch.long).expand(b)
            if bool((n < int(last_only)).any()) or bool((n > q).any()):
                raise ValueError(f"n_new must lie in [{int(last_only)}, {q}] for every row")
            n = n.to(ids.device)
        if self.compiled is not None and cache is not None and tree is None and self.capture is None:
            logits = self.compiled(ids, cache, slots, n, last_only)
            if logits is not None:
                return logits
        embed = self.embed.weight  # (each Module attribute lookup costs time: once a forward)
        s = self._step(b, q, ids.device, embed.dtype, cache, slots, tree)
        h = self._trunk(ids, s, embed)
        if last_only:
            h = h[:, -1:] if n is None else h[torch.arange(b, device=h.device), n - 1][:, None]
        logits = F.linear(h, embed if self.lm_head is None else self.lm_head.weight).float()
        if cache is not None:
            if n is None and s.start is not None:
                cache.lengths.narrow(0, s.start, b).add_(q)
            else:
                cache.lengths[s.rows] = s.positions[:, 0] + (q if n is None else n.to(cache.lengths.device))
        return logits

    def features(self, ids: torch.Tensor) -> torch.Tensor:
        """The final-norm hidden states (B, T, hidden) of whole sequences, no cache: what a
        value head or a reward model's score head reads."""
        b, q = ids.shape
        embed = self.embed.weight
        return self._trunk(ids, self._step(b, q, ids.device, embed.dtype, None, None), embed)

    def _trunk(self, ids: torch.Tensor, s: _Step, embed: torch.Tensor) -> torch.Tensor:
        h = F.embedding(ids, embed)
        if self.capture is not None:
            return self._trunk_capturing(h, s)
        for i, layer in enumerate(self.layers):
            h = layer.forward(h, i, s)
        return self.norm.forward(h)

    def _trunk_capturing(self, h: torch.Tensor, s: _Step) -> torch.Tensor:
        """`_trunk`, keeping the residual stream entering the layers in `capture` (id L: after
        the last layer) as `captured` (B, q, len(capture) * hidden): what an EAGLE-3 head
        drafts from."""
        got = []
        for i, layer in enumerate(self.layers):
            if i in self.capture:
                got.append(h)
            h = layer.forward(h, i, s)
        if len(self.layers) in self.capture:
            got.append(h)
        self.captured = torch.cat(got, dim=-1)
        return self.norm.forward(h)

    def _step(
        self, b: int, q: int, device, dtype: torch.dtype, cache: KVCache | None, slots, tree: TreeMask | None = None
    ) -> _Step:
        # (no shortcut for a single row: a step cost that jumps between batch 1 and 2 is one
        # the cost model's smooth forms cannot fit, and the policies price steps with them.
        # The rows' lengths are read once, as a list: this bookkeeping runs once a forward, and
        # done with tensor ops it is a sizeable part of a small drafter's forward at batch 1)
        if cache is None:
            rows, start, lo, hi = None, 0, 0, 0
            positions = torch.arange(q, device=device).expand(b, q)
        else:
            rows = cache.rows(slots, b)
            start = 0 if slots is None else cache.consecutive(rows)
            lengths = cache.lengths.narrow(0, start, b) if start is not None else cache.lengths[rows]
            known = lengths.tolist()
            lo, hi = min(known), max(known)
            positions = lengths[:, None] + torch.arange(q, device=device)  # (the cache is on ids' device)
        upto = hi + q
        if cache is not None and upto > cache.max_len:
            raise ValueError(f"a row needs {upto} cache positions, more than the cache's max_len {cache.max_len}")
        window = self.config.sliding_window
        if window is not None and upto > window:
            raise ValueError(
                f"context of {upto} tokens exceeds the model's sliding window ({window}),"
                " which this executor does not implement"
            )
        if tree is not None:
            mask, rotary = _tree_attention(tree, positions, upto, dtype)
        elif q == 1 and lo == hi:
            mask = None  # one new token per row, every row as long: it sees all it reads
        else:  # additive, built once here: SDPA would convert a bool mask in every layer
            keys = torch.arange(upto, device=device)
            hidden = (keys[None, None, :] > positions[:, :, None])[:, None]
            mask = torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))
        first = flat = None
        if cache is not None and start is not None and lo == hi:
            first = lo
        if cache is not None and (start is None or first is None):
            flat = cache.flat_index(rows, positions)
        if tree is None:
            cos, sin = self.rope.forward(positions, dtype, upto, first)
        else:
            cos, sin = self.rope.forward(rotary, dtype, upto)
        return _Step(cache, rows, start, first, positions, upto, mask, flat, cos, sin)
