"""GRPO-style workload: P prompts x G samples, lengths with a long tail, acceptance per sample.

Acceptance is drawn per drafter: a prompt-level Beta around the drafter's (drifted) mean, then
a sample-level Beta around the prompt's value, so samples of one prompt are alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rlsched.config import (
    AcceptanceSpec,
    DrafterSpec,
    EmpiricalLength,
    FixedLength,
    LengthDist,
    LognormalLength,
    WorkloadSpec,
)

_EPS = 1e-9


@dataclass
class Rollout:
    """The samples of one RL step's generation stage (one row per sample)."""

    prompt_of: np.ndarray  # prompt index of each sample
    prompt_len: np.ndarray
    response_len: np.ndarray
    acceptance: np.ndarray  # (samples, drafters): true per-token acceptance
    drafters: tuple[str, ...]

    @property
    def n(self) -> int:
        return len(self.prompt_of)

    @property
    def n_prompts(self) -> int:
        return int(self.prompt_of.max()) + 1 if self.n else 0


def sample_lengths(dist: LengthDist, n_groups: int, group_size: int, rng: np.random.Generator) -> np.ndarray:
    """n_groups x group_size lengths, flattened group by group; correlated within a group."""
    n = n_groups * group_size
    if isinstance(dist, FixedLength):
        return np.full(n, dist.value, dtype=np.int64)
    if isinstance(dist, EmpiricalLength):
        out = rng.choice(np.asarray(dist.values, dtype=np.int64), size=n, replace=True)
        return np.minimum(out, dist.max) if dist.max else out
    assert isinstance(dist, LognormalLength)
    group = rng.normal(0.0, dist.group_sigma, size=n_groups) if dist.group_sigma > 0 else np.zeros(n_groups)
    z = np.repeat(group, group_size) + dist.sigma * rng.standard_normal(n)
    return np.clip(np.rint(dist.median * np.exp(z)), dist.min, dist.max).astype(np.int64)


def _beta_around(mean, concentration: float | None, size, rng: np.random.Generator):
    mean = np.clip(np.broadcast_to(np.asarray(mean, dtype=float), size), _EPS, 1 - _EPS)
    if concentration is None:
        return mean.copy()
    return rng.beta(mean * concentration, (1 - mean) * concentration)


def sample_acceptance(
    spec: AcceptanceSpec, mean: float, n_prompts: int, group_size: int, rng: np.random.Generator
) -> np.ndarray:
    if mean <= 0.0 or mean >= 1.0:
        return np.full(n_prompts * group_size, float(np.clip(mean, 0.0, 1.0)))
    per_prompt = _beta_around(mean, spec.prompt_concentration, n_prompts, rng)
    return _beta_around(np.repeat(per_prompt, group_size), spec.sample_concentration, n_prompts * group_size, rng)


def sample_rollout(
    spec: WorkloadSpec, drafters: list[DrafterSpec], accept_means: dict[str, float], rng: np.random.Generator
) -> Rollout:
    """Draw one rollout: prompts and their lengths, responses, per-drafter acceptance."""
    p, g = spec.prompts, spec.samples_per_prompt
    prompt_len = np.repeat(sample_lengths(spec.prompt_len, p, 1, rng), g)
    response_len = sample_lengths(spec.response_len, p, g, rng)
    acc = np.empty((p * g, len(drafters)))
    for j, d in enumerate(drafters):
        acc[:, j] = sample_acceptance(d.acceptance, accept_means[d.name], p, g, rng)
    return Rollout(np.repeat(np.arange(p), g), prompt_len, response_len, acc, tuple(d.name for d in drafters))


class AcceptanceDrift:
    """Mean acceptance per drafter across RL steps: it falls by `drift` per step as the actor
    moves away from the drafter (down to `floor`) and a drafter update wins back `recovery`
    of what was lost."""

    def __init__(self, drafters: list[DrafterSpec], drift: float, floor: float, recovery: float):
        self.base = {d.name: d.acceptance.mean for d in drafters}
        self.current = dict(self.base)
        self.drift, self.floor, self.recovery = drift, floor, recovery

    def means(self) -> dict[str, float]:
        return dict(self.current)

    def step(self) -> None:
        """One RL update of the actor happened."""
        for name, m in self.current.items():
            self.current[name] = max(min(self.floor, self.base[name]), m - self.drift)

    def drafter_updated(self) -> None:
        for name, m in self.current.items():
            self.current[name] = m + self.recovery * (self.base[name] - m)
