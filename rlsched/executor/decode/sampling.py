"""Logits -> the sampling distribution, and sampling from it.

One function, `probs`, turns logits into the distribution a token is drawn from (temperature,
then top-k, then top-p, as transformers' warpers do); the target and the drafter both go
through it, so that speculative verification compares p and q after the very same processing
(the condition for losslessness). Temperature 0 means greedy: a one-hot at the argmax.
Sampling takes a torch.Generator so that the same seed gives the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return probs(logits, self.temperature, self.top_k, self.top_p)


GREEDY = SamplingParams(temperature=0.0)


def probs(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The sampling distribution (float32, same shape) over the last dimension of `logits`.

    top-k keeps the k largest logits (ties at the k-th value are all kept); top-p keeps the
    smallest set of most likely tokens whose mass reaches top_p (at least one token), both
    renormalised. Temperature 0 gives a one-hot at the argmax (the first one on ties)."""
    logits = logits.float()
    if temperature == 0:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    if temperature != 1.0:
        logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    p = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_p, order = p.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass of the more likely tokens
        drop_sorted = before >= top_p  # the first token always has before = 0: kept
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        p = p.masked_fill(drop, 0.0)
        p = p / p.sum(-1, keepdim=True)
    return p


def sample(p: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per distribution: p (..., V) -> (...) int64, by the exponential race
    argmax_i p_i / E_i with E_i ~ Exp(1) i.i.d., which picks i with probability p_i / sum(p),
    so p need not be normalised (and cheaper than torch.multinomial at batch 1). E is kept above 0 so a
    token of probability 0 can never win (0 / 0 would be NaN, which argmax takes)."""
    e = torch.empty_like(p).exponential_(generator=generator).clamp_min_(torch.finfo(p.dtype).tiny)
    return (p / e).argmax(-1)
