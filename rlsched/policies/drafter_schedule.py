"""When to distil the model drafter again.

An update costs time now (distillation, measured); a stale drafter costs time at every
rollout after it (fewer tokens per speculative step as the actor moves away). `pays` is the
ski-rental rule: keep paying the rent (the staleness) until it adds up to the price of buying
(the last update's measured cost), then update: with the rent known, never more than twice
what the best choice in hindsight pays between two updates, whatever the drift (here the rent
is estimated). `every` updates on a fixed interval, as ReSpec does.

The rent of an RL step is its generation time times the share a fresh drafter would have
saved: 1 - E(a, k) / E(a_ref, k), where E(a, k) = 1 + a + ... + a^k is the tokens a chain of
k drafts yields at per-token acceptance a (the step's, from its accepted and rejected chain
trials), a_ref the acceptance of the first rollout after the last update (which itself pays
against the reference before it) and k the step's mean draft length. Steps that drafted
nothing tell nothing and add nothing.

No torch: the simulator may use it too.
"""

from __future__ import annotations

from rlsched.policies import tree

SCHEDULES = ("every", "pays")


def chain_tokens(a: float, k: float) -> float:
    """Expected tokens of a chain step with k drafts at per-token acceptance a (k may be a mean)."""
    a = min(max(a, 0.0), 1.0)
    return k + 1.0 if a >= 1.0 else tree.chain_tokens(a, k)


class DrafterSchedule:
    """Decides after each RL step whether the drafter is distilled at its end."""

    def __init__(self, mode: str, every: int, steps: int | None = None):
        """`steps`: the run's RL steps, when known: no update after the last, which no rollout uses."""
        if mode not in SCHEDULES:
            raise ValueError(f"unknown drafter update schedule '{mode}'; choose from {', '.join(SCHEDULES)}")
        self.mode, self.every, self.steps = mode, every, steps
        self.cost_s: float | None = None  # the last update's measured seconds
        self.rent_s = 0.0  # generation time staleness has cost since the last update (estimated)
        self.ref: float | None = None  # acceptance of the first rollout after the last update
        self._rebase = False  # the next rollout becomes the reference (an update came before it)

    def observe(self, generation_s: float, drafted: int, accepted: int, rejected: int | None, sd_rows: int) -> None:
        """One rollout's totals: chain trials (`rejected`: chains that stopped before their
        last draft; None where the backend does not count them: accepted / drafted then
        stands in, biased low but alike from step to step) and the row-steps that drafted."""
        if drafted <= 0 or sd_rows <= 0:
            return
        trials = accepted + rejected if rejected is not None else drafted
        a = accepted / trials if trials > 0 else 0.0
        if self.ref is not None:
            k = drafted / sd_rows
            saved = 1.0 - chain_tokens(a, k) / chain_tokens(self.ref, k)
            self.rent_s = max(0.0, self.rent_s + generation_s * saved)  # signed: noise around a_ref cancels
        if self.ref is None or self._rebase:
            self.ref, self._rebase = a, False

    def due(self, step: int) -> bool:
        """Whether to update at the end of RL step `step` (0-based)."""
        if self.every <= 0 or (self.steps is not None and step + 1 >= self.steps):
            return False
        if self.mode == "every" or self.cost_s is None:  # `pays` learns an update's cost from the first
            return (step + 1) % self.every == 0
        return self.rent_s >= self.cost_s

    def updated(self, seconds: float) -> None:
        """An update took `seconds` (on the critical path: an update hidden beside a rollout
        costs nothing, and then the next is due at once). The next rollout pays rent against
        the last reference, then becomes the reference."""
        self.cost_s, self.rent_s, self._rebase = max(seconds, 0.0), 0.0, True

    def state(self) -> dict:
        return dict(cost_s=self.cost_s, rent_s=self.rent_s, ref=self.ref, rebase=self._rebase)

    def load(self, state: dict | None) -> None:
        if state:
            self.cost_s, self.rent_s, self.ref = state["cost_s"], float(state["rent_s"]), state["ref"]
            self._rebase = bool(state.get("rebase", False))
