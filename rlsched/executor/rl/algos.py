"""The RL update's mathematics, as plain tensor functions: padded batches of whole sequences,
token log-probs, GRPO's group-normalised advantages, GAE for PPO, the PPO-clip policy loss with
an optional KL penalty to a reference, and the clipped value loss.

Layout: a rollout of N samples is one right-padded (N, T) id tensor of prompt + response.
Position t of every (N, T-1) tensor is about the token ids[:, t + 1] (predicted at t), so a
response token's log-prob, advantage and mask sit at the position before it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class SequenceBatch:
    ids: torch.Tensor  # (N, T) prompt + response, right-padded
    mask: torch.Tensor  # (N, T-1) bool: position predicts a response token of a sample that counts
    old_logp: torch.Tensor  # (N, T-1) the sampler's log-probs of the response tokens (0 elsewhere)
    prompt_lens: list[int]
    response_lens: list[int]

    def __len__(self) -> int:
        return self.ids.shape[0]

    def select(self, rows: torch.Tensor) -> SequenceBatch:
        idx = rows.tolist()
        return SequenceBatch(
            self.ids[rows],
            self.mask[rows],
            self.old_logp[rows],
            [self.prompt_lens[i] for i in idx],
            [self.response_lens[i] for i in idx],
        )


def make_batch(
    prompts: list[list[int]],
    responses: list[list[int]],
    logprobs: list[list[float]] | None,
    pad_id: int,
    valid: list[bool] | None = None,
) -> SequenceBatch:
    """Pad prompt + response sequences (right-padded with `pad_id`; `mask`: the positions whose
    next token is a response token); `valid[i]` False keeps sample i out of the loss (its
    reward failed, say) while it keeps its row. `logprobs` None: no old log-probs (zeros)."""
    n = len(prompts)
    width = max(len(p) + len(r) for p, r in zip(prompts, responses))
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    mask = torch.zeros((n, width - 1), dtype=torch.bool)
    old = torch.zeros((n, width - 1))
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r, dtype=torch.long)
        if r and (valid is None or valid[i]):
            mask[i, len(p) - 1 : len(p) - 1 + len(r)] = True
        if logprobs is not None:
            old[i, len(p) - 1 : len(p) - 1 + len(r)] = torch.tensor(logprobs[i], dtype=torch.float32)
    return SequenceBatch(ids, mask, old, [len(p) for p in prompts], [len(r) for r in responses])


def token_logprobs(model: nn.Module, ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(ids[:, t+1] | ids[:, :t+1]) under softmax(logits / temperature): (N, T-1).
    The temperature is the sampler's, so these match the engine's log-probs."""
    logits = model(ids[:, :-1]) / temperature
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def grpo_advantages(
    rewards: torch.Tensor, groups: torch.Tensor, valid: torch.Tensor, normalise_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """(r - mean of its group) / (std of its group + eps), over the valid samples of each group;
    invalid samples get 0. A group whose rewards are all equal teaches nothing: 0."""
    adv = torch.zeros_like(rewards)
    for g in torch.unique(groups[valid]):
        rows = (groups == g) & valid
        r = rewards[rows]
        a = r - r.mean()
        if normalise_std:
            a = a / (r.std(unbiased=False) + eps)
        adv[rows] = a
    return adv


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the response positions (contiguous per row).
    rewards, values, mask: (N, T-1). Returns (advantages, returns), 0 outside the mask."""
    m = mask.float()
    adv = torch.zeros_like(values)
    last = torch.zeros(values.shape[0])
    for t in range(values.shape[1] - 1, -1, -1):
        nxt = m[:, t + 1] if t + 1 < values.shape[1] else torch.zeros_like(last)
        next_v = values[:, t + 1] * nxt if t + 1 < values.shape[1] else torch.zeros_like(last)
        delta = rewards[:, t] + gamma * next_v - values[:, t]
        last = delta + gamma * lam * nxt * last
        adv[:, t] = last * m[:, t]
    return adv, (adv + values) * m


def terminal_rewards(rewards: torch.Tensor, batch: SequenceBatch) -> torch.Tensor:
    """(N, T-1) with each sample's reward at its last response position (PPO's sparse reward)."""
    out = torch.zeros(batch.mask.shape)
    for i, (p, r) in enumerate(zip(batch.prompt_lens, batch.response_lens)):
        if r and batch.mask[i].any():
            out[i, p - 1 + r - 1] = rewards[i]
    return out


def aggregate(x: torch.Tensor, mask: torch.Tensor, how: str) -> torch.Tensor:
    """token: mean over every response token of the batch (long answers weigh more);
    sequence: mean per sequence, then over sequences (each sample weighs the same)."""
    m = mask.float()
    if how == "token":
        return (x * m).sum() / m.sum().clamp(min=1.0)
    per_seq = (x * m).sum(-1) / m.sum(-1).clamp(min=1.0)
    has = m.sum(-1) > 0
    return per_seq[has].mean() if has.any() else per_seq.sum() * 0


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
    agg: str,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, dict]:
    """PPO-clip: -min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A), plus kl_coef x KL(actor ||
    reference) by the k3 estimator (exp(ref - logp) - (ref - logp) - 1, unbiased and >= 0).
    advantages: (N, T-1) (GRPO broadcasts a sample's advantage over its tokens)."""
    ratio = torch.exp(logp - old_logp)
    surrogate = torch.maximum(-ratio * advantages, -ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages)
    loss = aggregate(surrogate, mask, agg)
    stats = {}
    with torch.no_grad():
        m = mask.float()
        n = m.sum().clamp(min=1.0)
        stats["clip_frac"] = float((((ratio - 1).abs() > clip_eps).float() * m).sum() / n)
        stats["approx_kl_old"] = float(((old_logp - logp) * m).sum() / n)
    if ref_logp is not None and kl_coef > 0:
        d = ref_logp - logp
        kl = torch.exp(d) - d - 1
        loss = loss + kl_coef * aggregate(kl, mask, agg)
        stats["kl_ref"] = float((kl.detach() * mask.float()).sum() / mask.float().sum().clamp(min=1.0))
    return loss, stats


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, clip: float, agg: str
) -> torch.Tensor:
    """PPO's clipped value loss: max of the squared errors of the new and the clipped value."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    err = torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)
    return 0.5 * aggregate(err, mask, agg)


class Critic(nn.Module):
    """PPO's value model: a copy of the actor's trunk with a scalar head (zero-initialised, so
    it starts from V = 0). values(ids)[:, t] is the value of the state after ids[:, :t+1]."""

    def __init__(self, trunk: nn.Module, hidden: int):
        super().__init__()
        self.trunk = trunk
        self.head = nn.Linear(hidden, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.trunk.features(ids)).squeeze(-1)[:, :-1]


def kl_to(p_logits: torch.Tensor, q_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """KL(p || q) per position of two logit tensors (..., V) at the sampler's temperature."""
    logp = F.log_softmax(p_logits / temperature, -1)
    logq = F.log_softmax(q_logits / temperature, -1)
    return (logp.exp() * (logp - logq)).sum(-1)
