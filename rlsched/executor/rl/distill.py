"""Keeping the model drafter fresh (ReSpec): distil it from the actor on recent rollouts.

The actor moves away from the drafter at every RL update, so acceptance falls unless the
drafter follows. Every I steps the drafter takes a few optimizer steps on the responses of the
last few rollouts, minimising w(r) x KL(p_actor || q_drafter) per response token, where w is a
sample's reward weight: its reward normalised over the buffer, 1 + z clipped to
[weight_min, weight_max] and rescaled to mean 1 (the responses the actor is moving towards
count more), or 1 for plain distillation.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from rlsched.executor.rl.algos import kl_to


@dataclass
class ReplaySample:
    tokens: list[int]  # prompt + response
    prompt_len: int
    reward: float


class ReplayBuffer:
    """The samples of the last `steps` rollouts (samples whose reward failed are not kept)."""

    def __init__(self, steps: int):
        self.rollouts: deque[list[ReplaySample]] = deque(maxlen=steps)

    def add(self, samples: list[ReplaySample]) -> None:
        self.rollouts.append([s for s in samples if len(s.tokens) > s.prompt_len and np.isfinite(s.reward)])

    def samples(self) -> list[ReplaySample]:
        return [s for r in self.rollouts for s in r]

    def state(self) -> list[list[ReplaySample]]:
        return [list(r) for r in self.rollouts]

    def load(self, state: list[list[ReplaySample]]) -> None:
        self.rollouts.clear()
        self.rollouts.extend(state)


def reward_weights(rewards: np.ndarray, weighting: str, lo: float, hi: float) -> np.ndarray:
    """Per-sample weights with mean 1: 'plain' all ones; 'reward' 1 + z-score, clipped."""
    rewards = np.asarray(rewards, dtype=np.float64)
    if weighting == "plain" or len(rewards) == 0:
        return np.ones(len(rewards))
    std = rewards.std()
    z = (rewards - rewards.mean()) / std if std > 0 else np.zeros_like(rewards)
    w = np.clip(1.0 + z, lo, hi)
    return w / w.mean() if w.mean() > 0 else np.ones(len(rewards))


def _pad(samples: list[ReplaySample], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s.tokens) for s in samples)
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(samples), width - 1), dtype=torch.bool)
    for i, s in enumerate(samples):
        ids[i, : len(s.tokens)] = torch.tensor(s.tokens, dtype=torch.long)
        mask[i, s.prompt_len - 1 : len(s.tokens) - 1] = True
    return ids, mask


def distill(
    actor,
    drafter,
    optimizer,
    buffer: ReplayBuffer,
    *,
    steps: int,
    batch: int,
    weighting: str,
    weight_min: float,
    weight_max: float,
    temperature: float,
    generator: torch.Generator,
    pad_id: int,
    loss_fn=None,
) -> dict:
    """`steps` optimizer steps of the drafter on minibatches of the buffer. Returns the mean
    per-token KL(p_actor || q_drafter) of the first and the last minibatch (unweighted).
    `loss_fn(ids, mask, weights) -> (weighted loss, unweighted KL)` replaces the model
    drafter's per-token KL (an EAGLE head's unrolled loss, `eagle.distill_head`)."""
    samples = buffer.samples()
    if not samples:
        return dict(kl_before=float("nan"), kl_after=float("nan"), samples=0)
    weights = torch.as_tensor(
        reward_weights(np.array([s.reward for s in samples]), weighting, weight_min, weight_max), dtype=torch.float32
    )
    drafter.train().requires_grad_(True)
    kls = []
    try:
        for _ in range(steps):
            rows = torch.randperm(len(samples), generator=generator)[:batch]
            ids, mask = _pad([samples[i] for i in rows.tolist()], pad_id)
            if loss_fn is None:
                with torch.no_grad():
                    p_logits = actor(ids[:, :-1])
                kl = kl_to(p_logits, drafter(ids[:, :-1]), temperature)  # (b, T-1)
                m = mask.float()
                loss = (kl * weights[rows][:, None] * m).sum() / m.sum().clamp(min=1.0)
                kl_value = float((kl.detach() * m).sum() / m.sum().clamp(min=1.0))
            else:
                loss, kl_value = loss_fn(ids, mask, weights[rows])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
            optimizer.step()
            kls.append(kl_value)
    finally:
        drafter.eval().requires_grad_(False)
    return dict(kl_before=kls[0], kl_after=kls[-1], samples=len(samples))
