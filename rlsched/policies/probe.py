"""Probing: a policy that prices acceptance learns it only from steps that draft.

`goodput`, or a learned table with acceptance buckets, turns SD off where its acceptance
estimate says drafting does not pay; from then on no step drafts, so the estimate never
moves, even once the drafter has become good (a refreshed drafter in RL, or a prior set too
low: a learned table sat off for a whole executor run whose drafter accepted 0.92, because the
estimator's prior of 0.6 fell in its all-off cells). After `every` off steps in a row, one step
drafts PROBE_K tokens a row (the drafters in turn). The count runs on across rollouts: an RL
step's rollout is often shorter than `every` steps (48 tokens in the default run), and a count
that restarted with each never probed. Policies that never read an acceptance estimate (off,
static k, bandit, twostate) are left alone. The executor's engine and the simulator's
instances use the same rule (one Prober per policy object, `prober_for`), so a replay probes
where the run did.
"""

from __future__ import annotations

from rlsched.policies.types import NEVER_CHANGES, Strategy

PROBE_EVERY = 64  # the executor's default (rollout.probe_every); the simulator's is off
PROBE_K = 2


class Prober:
    def __init__(self, policy, drafters, every: int | None):
        self.drafters = list(drafters)
        self.every = every
        self.active = every is not None and bool(self.drafters) and getattr(policy, "needs_acceptance", True)
        self.off_run = 0  # off steps in a row so far
        self.probes = 0
        self.probed = False  # the last call returned a probe

    def __call__(self, strategy: Strategy) -> Strategy:
        """The strategy this step runs: the policy's, or a probe in its place. (Once a step in
        the simulator's loop: inactive, it returns at once.)"""
        if not self.active:
            return strategy
        self.probed = False
        if not strategy.is_off:
            self.off_run = 0
            return strategy
        self.off_run += 1
        assert self.every is not None  # (active)
        if self.off_run <= self.every:
            return strategy
        self.off_run = 0
        self.probes += 1
        self.probed = True
        return Strategy(self.drafters[self.probes % len(self.drafters)], PROBE_K)

    def off_steps_left(self) -> int:
        """Off steps that may follow the current one before a probe (a run of steps priced at
        once must stop short of it)."""
        return self.every - self.off_run if self.active and self.every is not None else NEVER_CHANGES

    def skip(self, n: int) -> None:
        """n more off steps passed without asking (the rest of such a run)."""
        if self.active:
            self.off_run += n


def prober_for(policy, drafters, every: int | None) -> Prober:
    """The policy's Prober, made on first use and kept on the policy: a policy outlives the
    simulator's per-rollout instances (and the executor's engine holds one policy), so the
    count runs on from one rollout to the next."""
    prober = getattr(policy, "_prober", None)
    if prober is None or prober.every != every or prober.drafters != list(drafters):
        prober = policy._prober = Prober(policy, drafters, every)
    return prober
