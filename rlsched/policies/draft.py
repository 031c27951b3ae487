"""Drafting-strategy selection: which drafter and how many draft tokens, each engine step."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rlsched.errors import UserError
from rlsched.policies.types import NEVER_CHANGES, OFF, CostModel, EngineState, StepOutcome, Strategy


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
    a = np.atleast_1d(np.asarray(acceptance, dtype=float))
    powers = np.empty((len(a), k_max))
    powers[:] = a[:, None]
    np.cumprod(powers, axis=1, out=powers)
    out = np.empty(k_max + 1)
    out[0] = 0.0
    np.cumsum(powers.sum(axis=0), out=out[1:])
    out += len(a)
    return out


class OffPolicy:
    """Plain decoding, every step."""

    name = "off"
    needs_acceptance = False  # engines skip the estimator update
    observes = False  # engines skip building StepOutcomes

    def choose(self, state: EngineState) -> Strategy:
        return OFF

    def steady_steps(self, state: EngineState, strategy: Strategy, max_growth: int) -> int:
        return NEVER_CHANGES

    def observe(self, outcome: StepOutcome) -> None:
        pass


class StaticPolicy:
    """The same drafter and k every step, whatever the batch."""

    needs_acceptance = False
    observes = False

    def __init__(self, drafter: str, k: int):
        self.strategy = Strategy(drafter, k)
        self.name = f"static:{k}"

    def choose(self, state: EngineState) -> Strategy:
        return self.strategy

    def steady_steps(self, state: EngineState, strategy: Strategy, max_growth: int) -> int:
        return NEVER_CHANGES

    def observe(self, outcome: StepOutcome) -> None:
        pass


class GoodputPolicy:
    """RLHFSpec's rule: the (drafter, k) in {off} + drafters x 1..k_max that maximises
    expected tokens / (draft + verify time), from the cost model and each running sequence's
    acceptance estimate.

    The choice is re-derived whenever the batch size changes, the batch's context grows by
    `ctx_tolerance`, or `refresh` steps have passed (acceptance estimates move slowly); in
    between the last choice stands. refresh=1 re-derives every step.
    """

    name = "goodput"
    needs_acceptance = True
    observes = False

    def __init__(self, ctx: PolicyContext, refresh: int = 32, ctx_tolerance: float = 0.05):
        self.cost, self.drafters, self.k_max = ctx.cost, ctx.drafters, ctx.k_max
        self.refresh, self.ctx_tolerance = refresh, ctx_tolerance
        self._ks = np.arange(1, self.k_max + 1)
        self._last = None  # (batch, ctx_tokens, step, strategy)

    def choose(self, state: EngineState) -> Strategy:
        b, ctx = state.batch, state.ctx_tokens
        last = self._last
        if (last is not None and last[0] == b and ctx <= last[1] * (1 + self.ctx_tolerance)
                and state.step - last[2] < self.refresh):
            return last[3]
        best, best_rate = OFF, b / self.cost.verify_time(b, 1, ctx)
        for d in self.drafters:
            tokens = expected_tokens(state.accept_est(d), self.k_max)[1:]
            times = self.cost.draft_time(d, b, self._ks, ctx) + self.cost.verify_time(b, self._ks + 1, ctx)
            rates = tokens / times
            j = int(np.argmax(rates))
            if rates[j] > best_rate:
                best, best_rate = Strategy(d, int(self._ks[j])), float(rates[j])
        self._last = (b, ctx, state.step, best)
        return best

    def steady_steps(self, state: EngineState, strategy: Strategy, max_growth: int) -> int:
        """Steps after this one that `choose` will answer from its cache (same batch)."""
        last = self._last
        if last is None or last[3] is not strategy:
            return 0
        by_refresh = self.refresh - 1 - (state.step - last[2])
        room = last[1] * (1 + self.ctx_tolerance) - state.ctx_tokens
        by_ctx = int(room // max_growth) - 1 if max_growth > 0 else NEVER_CHANGES
        return max(0, min(by_refresh, by_ctx))

    def observe(self, outcome: StepOutcome) -> None:
        pass


DRAFT_POLICIES = "off, static:K (or static:K:DRAFTER), goodput (or goodput:REFRESH_STEPS)"


def make_draft_policy(spec: str, ctx: PolicyContext):
    """A DraftPolicy from its name: `off`, `static:K[:DRAFTER]`, `goodput`."""
    name, _, arg = spec.strip().partition(":")
    if name == "off" and not arg:
        return OffPolicy()
    if name == "goodput":
        if not ctx.drafters:
            raise UserError("policy 'goodput' needs at least one drafter in the config (drafters: [...])")
        if arg and (not arg.isdigit() or int(arg) < 1):
            raise UserError(f"policy '{spec}': the refresh interval must be a whole number >= 1, as in goodput:1")
        return GoodputPolicy(ctx, refresh=int(arg) if arg else 32)
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
