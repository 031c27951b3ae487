"""Rotary position embeddings with the scalings found in Llama-family configs.

Frequencies follow `transformers` exactly (float32 inverse frequencies, rotate-half layout),
because the executor's logits must equal the reference's. Supported scalings: none,
`linear`, `dynamic` (NTK) and `llama3` (Llama-3.1). Others (yarn, longrope, ...) are refused
by the loader, so that a model never runs with silently wrong positions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

SUPPORTED_SCALINGS = ("default", "linear", "dynamic", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """The `rope_scaling` (or v5 `rope_parameters`) entry of a config, validated."""

    kind: str  # one of SUPPORTED_SCALINGS
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only


def inv_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None, max_position_embeddings: int, seq_len: int | None = None
) -> torch.Tensor:
    """Inverse frequencies (head_dim / 2,) in float32 on the CPU.

    `seq_len` matters only for `dynamic`: the base grows once the sequence outgrows
    `max_position_embeddings` (as in transformers, which takes the longest position of the
    forward pass).
    """
    kind = scaling.kind if scaling else "default"
    if kind == "dynamic":
        n = max(seq_len or 0, max_position_embeddings)
        f = scaling.factor
        theta = theta * ((f * n / max_position_embeddings) - (f - 1)) ** (head_dim / (head_dim - 2))
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv = 1.0 / (theta**exponents)
    if kind == "linear":
        inv = inv / scaling.factor
    elif kind == "llama3":
        inv = _llama3(inv, scaling)
    return inv


def _llama3(inv: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama-3.1: long wavelengths divided by `factor`, short ones kept, a smooth ramp between."""
    old = s.original_max_position_embeddings
    low_wavelen = old / s.low_freq_factor
    high_wavelen = old / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class Rope(nn.Module):
    """cos/sin tables for given positions; computed per forward (cheap: B x q x head_dim)."""

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None, max_position_embeddings: int):
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        self.max_position_embeddings = max_position_embeddings
        self.register_buffer("inv_freq", self._inv(None), persistent=False)

    def _inv(self, seq_len: int | None) -> torch.Tensor:
        return inv_frequencies(self.head_dim, self.theta, self.scaling, self.max_position_embeddings, seq_len)

    def materialize(self, device: torch.device | str) -> None:
        """Recompute the buffer on a real device (after the model was built on `meta`)."""
        self.inv_freq = self._inv(None).to(device)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype, longest: int | None = None, first: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (B, q) -> cos and signed sin (see `apply_rope`) of shape (B, 1, q, head_dim),
        in `dtype`. Looked up in tables grown on demand (one gather per forward instead of
        computing them), except for dynamic scaling past the trained length, where the
        frequencies depend on the length. `longest`: max(positions) + 1 when the caller knows it;
        `first`: every row's positions are first..first+q-1 (the tables are then sliced, not
        gathered, and broadcast over the rows)."""
        if longest is None:
            longest = int(positions.max()) + 1
        if self.scaling is not None and self.scaling.kind == "dynamic" and longest > self.max_position_embeddings:
            cos, sin = _tables(positions.float(), self._inv(longest).to(positions.device), dtype)
            return cos[:, None], sin[:, None]
        table = getattr(self, "_table", None)
        if (
            table is None
            or table[0].shape[0] < longest
            or table[0].dtype != dtype
            or table[0].device != positions.device
        ):
            inv = self.inv_freq
            n = max(longest, 256, 0 if table is None else 2 * table[0].shape[0])
            with torch.inference_mode(False):  # usable by autograd too (training after rollouts)
                cos, sin = _tables(torch.arange(n, device=inv.device).float(), inv, dtype)
            table = self._table = (cos, sin, cos[None, None], sin[None, None])
        if first is not None:  # views of (1, 1, n, head_dim) tables: narrow is one call, slicing three
            q = positions.shape[-1]
            return table[2].narrow(2, first, q), table[3].narrow(2, first, q)
        return table[0][positions][:, None], table[1][positions][:, None]


def _tables(positions: torch.Tensor, inv: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin (-sin on the first half) of positions x inverse frequencies."""
    freqs = positions[..., None] * inv  # (..., head_dim / 2)
    cos, sin = freqs.cos(), freqs.sin()
    return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x (B, heads, q, head_dim) rotated in the rotate-half layout of HF Llama checkpoints:
    x * cos + rotate_half(x) * sin, where rotate_half(x) = (-x2, x1). With the sign folded into
    the table, rotate_half(x) * sin = roll(x, half) * (-sin, sin): three ops instead of seven."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)
