"""TLT-style online learner: bucketed epsilon-greedy over strategies, no cost model needed."""

from __future__ import annotations

import itertools

import numpy as np

from rlsched.policies.draft import PolicyContext, log_mean
from rlsched.policies.types import OFF, EngineState, StepOutcome, Strategy

ARM_KS = (1, 2, 3, 4, 6, 8)


class BanditPolicy:
    """Buckets by batch size (powers of two); arms are off and (drafter, k); the reward of a
    step is its tokens per second. Untried arms of a bucket go first, then the best arm, or
    with probability epsilon / sqrt(1 + visits / 20) one of its neighbours: exploration fades
    as a bucket is learned, so its cost does not last the whole run. A step's rate rises and
    falls once along k (deeper drafts gain fewer tokens for a costlier verify), so the arms
    worth re-trying are the leader's neighbours: k one step shallower (off below the least
    k) or deeper, and the other drafters at the leader's k (exploring every arm, TLT's way,
    spends its tries on k = 8 at a batch of hundreds or on off where k = 3 leads). The statistics
    are shared by the instances of one cluster (they see the same hardware), each instance
    explores with its own random stream.

    A step whose drafter caught up (a joining row's prompt, the tokens of off steps) is not its
    arm's usual rate; what it took beyond that rate, over the tokens fed, is what feeding the
    drafter costs a token (`_feed`), and an off step is charged that for each token it emits:
    those tokens reach the drafter before it drafts again. Uncharged, exploring SD from off
    would pay a catch-up that the off arm's rate never shows."""

    name = "bandit"
    needs_acceptance = False
    observes = True
    _scale = 20.0  # exploration falls as 1/sqrt(1 + visits / _scale)

    def __init__(self, ctx: PolicyContext, epsilon: float = 0.05):
        self.epsilon = epsilon
        self.arms = [OFF] + [Strategy(d, k) for d in ctx.drafters for k in ARM_KS if k <= ctx.k_max]
        self._neighbours = self._neighbours_of(self.arms)
        self._stats: dict[int, np.ndarray] = ctx.shared.setdefault("bandit_stats", {})  # bucket -> (2, arms)
        member = next(ctx.shared.setdefault("bandit_members", itertools.count()))
        self._rng = np.random.default_rng([ctx.seed, member])
        self._pending: tuple[int, int] | None = None
        self._feed: float | None = None  # seconds to feed the drafter a token, as catch-up steps measured it

    @staticmethod
    def _neighbours_of(arms: list[Strategy]) -> list[np.ndarray]:
        """Per arm, the arms one step from it (itself included): along its drafter's k's, off
        next to each drafter's least k, and the other drafters at the same k."""
        near = [{i} for i in range(len(arms))]
        line: dict[str | None, list[int]] = {}
        for i, a in enumerate(arms[1:], 1):
            line.setdefault(a.drafter, [0]).append(i)  # off, then the drafter's k's in order
        for chain in line.values():
            for x, y in zip(chain, chain[1:]):
                near[x].add(y)
                near[y].add(x)
        for i, a in enumerate(arms):
            for j, b in enumerate(arms):
                if not a.is_off and not b.is_off and a.k == b.k:
                    near[i].add(j)
        return [np.array(sorted(n)) for n in near]

    def choose(self, state: EngineState) -> Strategy:
        bucket = state.batch.bit_length()
        stats = self._stats.get(bucket)
        if stats is None:
            stats = self._stats[bucket] = np.zeros((2, len(self.arms)))  # counts, mean rewards
        untried = np.flatnonzero(stats[0] == 0)
        if len(untried):
            arm = int(untried[0])
        else:
            arm = int(np.argmax(stats[1]))
            if self._rng.random() < self.epsilon / np.sqrt(1.0 + stats[0].sum() / self._scale):
                near = self._neighbours[arm]
                arm = int(near[self._rng.integers(len(near))])
        self._pending = (bucket, arm)
        return self.arms[arm]

    def observe(self, outcome: StepOutcome) -> None:
        if self._pending is None or outcome.step_time <= 0:
            return
        bucket, arm = self._pending
        stats = self._stats[bucket]
        self._pending = None
        if outcome.catch_up > 0:  # the drafter caught up (see StepOutcome): not this arm's usual rate
            if stats[1, arm] > 0:
                extra = outcome.step_time - outcome.emitted / stats[1, arm]
                if extra > 0:
                    self._feed = log_mean(self._feed, extra / outcome.catch_up)
            return
        step_time = outcome.step_time
        if self.arms[arm].is_off and self._feed:
            step_time += outcome.emitted * self._feed  # the feed it defers
        stats[0, arm] += 1
        stats[1, arm] += (outcome.emitted / step_time - stats[1, arm]) / stats[0, arm]
