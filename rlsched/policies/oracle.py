"""The oracle policies: the goodput rules with the simulator's true acceptance of every
sequence, re-derived every step. Yardsticks for reports, never product policies."""

from __future__ import annotations

import numpy as np

from rlsched.errors import UserError
from rlsched.policies.draft import GoodputPolicy, PolicyContext, SeqGoodputPolicy
from rlsched.policies.types import EngineState


class _Truth(GoodputPolicy):
    """Mixin: the simulator's true acceptance instead of estimates, re-derived every step."""

    needs_acceptance = False

    def __init__(self, ctx: PolicyContext):
        if ctx.true_acceptance is None:
            raise UserError(
                f"policy '{self.name}' needs the true acceptance of every sequence: only the simulator has it"
            )
        super().__init__(ctx, refresh=1, ctx_tolerance=0.0)
        self._truth = ctx.true_acceptance

    def _acceptance(self, state: EngineState, drafter: str) -> np.ndarray:
        return self._truth(drafter, state.sample_ids)


class OraclePolicy(_Truth, GoodputPolicy):
    """The goodput rule (one k per step) with every sequence's true acceptance and the true
    costs: the yardstick for reports (the best per-step greedy choice, not a strict bound on
    makespan), never a product policy."""

    name = "oracle"


class SeqOraclePolicy(_Truth, SeqGoodputPolicy):
    """The per-sequence rule with the true acceptance: a yardstick for per-sequence policies
    (per-step greedy, so not a strict bound on the stage's makespan)."""

    name = "oracle:seq"  # greedy per step like the others, so not a bound on makespan: a yardstick
