"""Drafting-strategy selection: which drafter and how many draft tokens, each engine step."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rlsched.errors import UserError
from rlsched.policies.types import OFF, CostModel, EngineState, StepOutcome, Strategy


@dataclass(frozen=True)
class PolicyContext:
    """What a policy may be built from: the cost model and the drafters the engine has."""

    cost: CostModel
    drafters: tuple[str, ...]
    k_max: int = 8


def expected_tokens(acceptance: np.ndarray, k_max: int) -> np.ndarray:
    """Expected tokens emitted by a chain step, summed over the batch, for k = 0..k_max.

    Per sequence with acceptance a: sum_{j=0..k} a^j = (1 - a^(k+1)) / (1 - a).
    """
    a = np.asarray(acceptance, dtype=float)
    if a.ndim == 0:
        a = a[None]
    powers = np.cumprod(np.broadcast_to(a[:, None], (len(a), k_max)), axis=1).sum(axis=0)
    return len(a) + np.concatenate(([0.0], np.cumsum(powers)))


class OffPolicy:
    """Plain decoding, every step."""

    name = "off"

    def choose(self, state: EngineState) -> Strategy:
        return OFF

    def observe(self, outcome: StepOutcome) -> None:
        pass


class StaticPolicy:
    """The same drafter and k every step, whatever the batch."""

    def __init__(self, drafter: str, k: int):
        self.strategy = Strategy(drafter, k)
        self.name = f"static:{k}"

    def choose(self, state: EngineState) -> Strategy:
        return self.strategy

    def observe(self, outcome: StepOutcome) -> None:
        pass


class GoodputPolicy:
    """RLHFSpec's rule: each step, the (drafter, k) in {off} + drafters x 1..k_max that
    maximises expected tokens / (draft + verify time), from the cost model and each running
    sequence's acceptance estimate."""

    name = "goodput"

    def __init__(self, ctx: PolicyContext):
        self.cost, self.drafters, self.k_max = ctx.cost, ctx.drafters, ctx.k_max
        self._ks = np.arange(1, self.k_max + 1)

    def choose(self, state: EngineState) -> Strategy:
        b, ctx = state.batch, state.ctx_tokens
        best, best_rate = OFF, b / self.cost.verify_time(b, 1, ctx)
        for d in self.drafters:
            tokens = expected_tokens(state.accept_est(d), self.k_max)[1:]
            times = self.cost.draft_time(d, b, self._ks, ctx) + self.cost.verify_time(b, self._ks + 1, ctx)
            rates = tokens / times
            j = int(np.argmax(rates))
            if rates[j] > best_rate:
                best, best_rate = Strategy(d, int(self._ks[j])), float(rates[j])
        return best

    def observe(self, outcome: StepOutcome) -> None:
        pass


DRAFT_POLICIES = "off, static:K (or static:K:DRAFTER), goodput"


def make_draft_policy(spec: str, ctx: PolicyContext):
    """A DraftPolicy from its name: `off`, `static:K[:DRAFTER]`, `goodput`."""
    name, _, arg = spec.strip().partition(":")
    if name == "off" and not arg:
        return OffPolicy()
    if name == "goodput" and not arg:
        if not ctx.drafters:
            raise UserError("policy 'goodput' needs at least one drafter in the config (drafters: [...])")
        return GoodputPolicy(ctx)
    if name == "static":
        k_str, _, drafter = arg.partition(":")
        if not k_str.isdigit() or int(k_str) < 0:
            raise UserError(f"policy '{spec}': K must be a whole number >= 0, as in static:4")
        k = int(k_str)
        if k == 0:
            return OffPolicy()
        if not ctx.drafters:
            raise UserError(f"policy '{spec}' needs a drafter in the config (drafters: [...])")
        drafter = drafter or ctx.drafters[0]
        if drafter not in ctx.drafters:
            raise UserError(f"policy '{spec}': unknown drafter '{drafter}'; the config has {', '.join(ctx.drafters)}")
        return StaticPolicy(drafter, k)
    raise UserError(f"unknown policy '{spec}'; choose from {DRAFT_POLICIES}")
