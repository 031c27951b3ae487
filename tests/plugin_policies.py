"""DraftPolicies loaded by qualified name (`plugin:plugin_policies.NAME`), as a user's own
module would be: the registry's test and the vLLM engine-core tests (the engine core imports
this module in its own process, with tests/ on PYTHONPATH)."""

from __future__ import annotations

import numpy as np

from rlsched.policies.types import Strategy

CYCLE = (0, 1, 3, 6)


class Cycling:
    """k = 0, 1, 3, 6, 0, ... by engine step; or, per_request, each row its own k from the cycle."""

    name, needs_acceptance, observes = "cycling", True, True

    def __init__(self, drafter: str = "model", per_request: bool = False):
        self.drafter, self.per_request, self.ks = drafter, per_request, []

    def choose(self, state):
        if self.per_request:
            ks = np.array([CYCLE[(i + state.step) % len(CYCLE)] for i in state.sample_ids], dtype=np.int64)
            self.ks.append(tuple(np.unique(ks)))
            return Strategy(self.drafter, int(ks.max()), k_per_row=ks) if ks.max() else Strategy()
        k = CYCLE[state.step % len(CYCLE)]
        self.ks.append(k)
        return Strategy(self.drafter, k) if k else Strategy()

    def observe(self, outcome):
        pass


def cycling(ctx) -> Cycling:
    return Cycling(ctx.drafters[0])


def cycling_per_request(ctx) -> Cycling:
    return Cycling(ctx.drafters[0], per_request=True)


NOT_A_POLICY = 3
