"""The tensor operations the eager model (model.py) and the compiled forwards (compiled.py)
share: RMSNorm as HF computes it, and attention of a few new tokens over a KV cache."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as HF computes it: normalised in float32, scaled in the input dtype (what
    RMSNorm does outside float32, and the compiled forwards everywhere: inductor fuses it)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def cached_attention(
    xq: torch.Tensor, xk: torch.Tensor, xv: torch.Tensor, mask: torch.Tensor, nkv: int
) -> torch.Tensor:
    """Attention of a few new tokens over a cache, as two batched matmuls: the query heads that
    share a KV head are stacked into one matrix, so keys and values are read once per KV head
    and never copied, and the scale and the mask go into the first matmul (`baddbmm`). Used for
    several new tokens per row (verify, prefill) at every batch size, since a step cost that
    jumps between batch sizes is one the cost model's smooth forms cannot fit; for one new
    token per row SDPA is faster at a few ragged rows, so this path takes over from
    `BMM_MIN_BATCH` rows (model.py), where the two cost about the same on a CPU.
    xq (B, H, q, d), xk/xv (B, KV, L, d), mask (B * KV, G * q, L) from `_Step.grouped_mask`.
    Scores in the model's dtype, softmax in float32, as transformers' eager attention does."""
    b, h, q, d = xq.shape
    g, length = h // nkv, xk.shape[2]
    q3 = xq.reshape(b * nkv, g * q, d)
    keys = xk.reshape(b * nkv, length, d).transpose(1, 2)
    scores = torch.baddbmm(mask, q3, keys, alpha=d**-0.5)
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(xv.dtype)
    return torch.bmm(weights, xv.reshape(b * nkv, length, d)).view(b, h, q, d)
