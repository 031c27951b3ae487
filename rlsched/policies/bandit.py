"""TLT-style online learner: a climbing bandit per batch-size bucket, no cost model needed."""

from __future__ import annotations

import numpy as np

from rlsched.policies.draft import PolicyContext, log_mean
from rlsched.policies.types import OFF, EngineState, StepOutcome, Strategy

ARM_KS = (1, 2, 3, 4, 6, 8)
TRIES = 2  # steps an arm gets in a bucket before its mean there is trusted
HOLD = 4  # steps a claim on an arm outlasts its step, in that step's time (then another instance may try it)
SKIP = 0.05  # a bucket's climb skips a draft that trailed the leader by more than this at a smaller batch


class BanditPolicy:
    """Buckets by batch size (powers of two); arms are off and (drafter, k); the reward of a
    step is its tokens a row per second, with a row's tokens counted as the drain counts them:
    the tokens the step emitted a row, times the harmonic over the plain mean of the rows'
    expected advances (1 + a + ... + a^k at each row's estimated acceptance a). A drain waits
    for its slowest rows; a deep draft that the likely rows use lifts the plain mean while the
    rows it serves worst finish last and run the drain's tail at a few rows a step, the dearest
    steps per token. A row's own luck from step to step evens out over its steps and is not
    counted against the draft. Per row, a step's rate also moves far less with the batch within
    a bucket, so an arm tried at the top of a bucket is not favoured over one tried at its bottom.

    Exploration is bounded by what it can win. A step's rate rises and falls once along k
    (deeper drafts gain fewer tokens for a costlier verify), so a bucket climbs: it starts
    from the leader of the nearest bucket already learned (off for the first), tries each of
    its leader's neighbours (k one step shallower, off below the least k, or deeper, and the
    other drafters at the leader's k) TRIES times, and moves to a neighbour that beats it,
    until none does. A draft that trailed the leader by more than SKIP at a smaller batch is
    not tried (verification only grows dearer with the batch). Arms away from the leader
    (k = 8 at a batch of hundreds, or off where k = 3 leads) are never tried. After the climb a
    step takes the leader or the neighbour with the highest optimistic rate, mean x (1 +
    epsilon sqrt(2 ln(bucket steps) / arm steps)) (UCB1, relative): a neighbour within a few
    percent of the leader is re-tried now and then, so drift in acceptance is followed, one
    that trails by more is re-tried ever more rarely. The statistics are shared by the
    instances of one cluster (they see the same hardware). An instance whose drafter is behind
    (it decoded plainly since it last drafted) does not try a draft away from the leader that
    another instance is trying (a claim lasts that instance's step and HOLD more of its step
    times): the cluster learns the arm for one drafter catch-up, not one an instance.

    A step whose drafter caught up (a joining row's prompt, the tokens of off steps) is not its
    arm's usual rate; what it took beyond that rate, over the tokens fed, is what feeding the
    drafter costs a token (`_feed`). The drafter takes in an off step's tokens only when it
    drafts again, which the drain does if a smaller batch's bucket (where the batch goes next)
    leads with a draft: only then is an off step charged that feed for each token it emits.
    Off in a bucket that stays off to the end of the drain defers nothing it ever pays."""

    name = "bandit"
    needs_acceptance = True
    observes = True

    def __init__(self, ctx: PolicyContext, epsilon: float = 0.05):
        self.epsilon = epsilon
        self.arms = [OFF] + [Strategy(d, k) for d in ctx.drafters for k in ARM_KS if k <= ctx.k_max]
        self._neighbours = self._neighbours_of(self.arms)
        self._stats: dict[int, np.ndarray] = ctx.shared.setdefault("bandit_stats", {})  # bucket -> (2, arms)
        self._start: dict[int, int] = ctx.shared.setdefault("bandit_start", {})  # bucket -> arm it climbs from
        self._skip: dict[int, dict[int, bool]] = ctx.shared.setdefault("bandit_skip", {})  # bucket -> arm -> tried
        # (bucket, arm) -> (owner, since, until): an arm away from the leader that an instance is
        # trying; the others keep to the leader meanwhile, so one catch-up pays for the cluster's try
        self._claims: dict[tuple[int, int], tuple[int, float, float]] = ctx.shared.setdefault("bandit_claims", {})
        self._claim: tuple[int, int] | None = None
        self._now = 0.0
        self._stale = True  # this instance's drafter is behind (it decoded plainly since it last drafted)
        self._pending: tuple[int, int] | None = None
        self._accept: np.ndarray | None = None  # the chosen draft's acceptance estimate a row
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

    def leader(self, bucket: int) -> int:
        """The bucket's best arm among those tried TRIES times (before any: the arm it climbs from)."""
        stats = self._stats.get(bucket)
        start = self._start.get(bucket, 0)
        if stats is None:
            return start
        trusted = stats[0] >= TRIES
        if not trusted.any():
            return start
        return int(np.argmax(np.where(trusted, stats[1], -np.inf)))

    def _open(self, bucket: int) -> np.ndarray:
        """A bucket's statistics, made on first use, climbing from the nearest learned bucket's leader."""
        stats = self._stats.get(bucket)
        if stats is None:
            known = sorted(self._stats, key=lambda b: (abs(b - bucket), -b))
            self._start[bucket] = self.leader(known[0]) if known else 0
            stats = self._stats[bucket] = np.zeros((2, len(self.arms)))  # counts, mean rewards
        return stats

    def choose(self, state: EngineState) -> Strategy:
        bucket = state.batch.bit_length()
        stats = self._open(bucket)
        lead = self.leader(bucket)
        near = self._neighbours[lead]
        short = stats[0, near] < TRIES
        fresh = near[short & (stats[0, near] == 0)]
        untried = near[short & (stats[0, near] > 0)]
        if len(fresh):
            untried = np.sort(np.concatenate((untried, fresh[self._promising(bucket, fresh)])))
        if len(untried):
            arm = int(untried[0])
        else:  # the neighbour (or the leader) with the highest optimistic rate
            near = near[stats[0, near] > 0]
            n, mean = stats[0, near], stats[1, near]
            arm = int(near[np.argmax(mean * (1.0 + self.epsilon * np.sqrt(2.0 * np.log(stats[0].sum()) / n)))])
        arm = self._claimed(bucket, arm, lead, state.time)
        self._pending = (bucket, arm)
        s = self.arms[arm]
        self._accept = None if s.drafter is None else state.accept_est(s.drafter)
        self._stale = s.is_off
        return s

    def _claimed(self, bucket: int, arm: int, lead: int, now: float) -> int:
        """`arm`, claimed for this instance, or the leader where another instance is trying it."""
        if self._claim is not None and self._claim != (bucket, arm):
            self._claims.pop(self._claim, None)
            self._claim = None
        self._now = now
        if arm == lead or self.arms[arm].is_off or not self._stale:
            return arm
        owner, since, until = self._claims.get((bucket, arm), (id(self), now, now))
        if owner != id(self) and since <= now <= until:
            return lead
        self._claim = (bucket, arm)
        self._claims[self._claim] = (id(self), now, np.inf)  # held while its step runs
        return arm

    def _promising(self, bucket: int, arms: np.ndarray) -> np.ndarray:
        """Per arm, False for a draft that trailed the leader by more than SKIP in the nearest
        bucket of smaller batches where both are trusted (a draft that loses at a smaller batch
        loses at a larger one: verification only grows dearer), else True. Decided once per
        bucket and arm where such a bucket exists."""
        decided = self._skip.setdefault(bucket, {})
        out = np.ones(len(arms), dtype=bool)
        for i, a in enumerate(int(x) for x in arms):
            if a in decided:
                out[i] = decided[a]
            elif not self.arms[a].is_off:
                for b in sorted((b for b in self._stats if b < bucket), reverse=True):
                    other, lead = self._stats[b], self.leader(b)
                    if other[0, a] >= TRIES and other[0, lead] >= TRIES:
                        out[i] = decided[a] = bool(other[1, a] >= (1.0 - SKIP) * other[1, lead])
                        break
        return out

    def _drafts_later(self, bucket: int) -> bool:
        """Whether the drain, going on to smaller batches, reaches a bucket that leads with a draft."""
        return any(not self.arms[self.leader(b)].is_off for b in self._stats if b < bucket)

    @staticmethod
    def _advance(outcome: StepOutcome, accept: np.ndarray | None = None) -> float:
        """A step's tokens a row, as the drain counts them: the tokens it emitted a row, times
        the harmonic over the plain mean of the rows' expected advances (1 + a + ... + a^k at
        their estimated acceptance a) where the step has them. A row's own step-to-step luck
        evens out over its steps; the spread of its expected advance does not, and the drain
        waits for the rows it serves worst."""
        mean = outcome.emitted / outcome.batch
        if accept is None or len(accept) != outcome.batch or outcome.strategy.is_off:
            return mean
        a = np.clip(np.asarray(accept, dtype=float), 0.0, 0.999)
        expected = (1.0 - a ** (outcome.strategy.k + 1)) / (1.0 - a)
        return mean / (float(np.mean(expected)) * float(np.mean(1.0 / expected)))

    def observe(self, outcome: StepOutcome) -> None:
        if self._pending is None or outcome.step_time <= 0 or outcome.batch <= 0:
            return
        bucket, arm = self._pending
        stats = self._stats[bucket]
        self._pending = None
        if self._claim is not None and self._claim in self._claims:
            end = self._now + outcome.step_time
            self._claims[self._claim] = (id(self), self._now, end + HOLD * outcome.step_time)
        rate = self._advance(outcome, self._accept)
        if outcome.catch_up > 0:  # the drafter caught up (see StepOutcome): not this arm's usual rate
            if stats[1, arm] > 0:
                extra = outcome.step_time - rate / stats[1, arm]
                if extra > 0:
                    self._feed = log_mean(self._feed, extra / outcome.catch_up)
            return
        step_time = outcome.step_time
        if self.arms[arm].is_off and self._feed and self._drafts_later(bucket):
            step_time += outcome.emitted * self._feed  # the feed it defers
        stats[0, arm] += 1
        stats[1, arm] += (rate / step_time - stats[1, arm]) / stats[0, arm]
