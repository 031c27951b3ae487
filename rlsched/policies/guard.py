"""A guard against losing to plain decoding: an adaptive policy's drafting steps are held to
what plain decoding would have done in their place, and speculation is switched off for a
while where it has not paid.

An adaptive policy decides from estimates (a learning acceptance estimate, a prior, a
bandit's exploration, a table learned on another job). Where they are wrong it can draft on
while every drafting step takes longer than plain decoding would have taken for the tokens
that step emitted. `Guarded` keeps the books of the inner policy's drafting steps: realised
seconds against plain decoding's seconds for the same tokens, and falls back to plain
decoding for a back-off stretch when the difference runs past a small margin.

Plain decoding's price of a token at batch b is (verify(b, 1, ctx) + b x feed) / b: one plain
step of the cost model, plus the drafter feed each of its b tokens defers (a model drafter
takes in the tokens of plain steps before it drafts again; priced as `GoodputPolicy` prices
it, the cost model's marginal drafter prefill a token, the least over the drafters). With
`ctx.calibrate` (measured step times: the executor) the verify is scaled by what the
measured verify steps took against the cost model (a geometric mean per octave of batch
size). Steps the books cannot price cleanly are left out of them: a step whose drafter catches
up (the rows' tokens since it last drafted, a joining row's prompt: the feed is in plain
decoding's price already, and one such step after a back-off would otherwise price speculation
out for good), a probe (`policies/probe.py`: not the inner policy's choice), and, in the choose
view, a step after which rows joined.

Two views of the same steps, by what the engine gives:

- observing (`observes`: the inner policy observes, or step times are measured): each
  StepOutcome's `emitted` and `step_time`;
- choosing (the simulator's fast path for policies that do not observe, which keeps its runs
  of steady steps): between two `choose` calls, the rows that still run grew by the tokens
  they emitted, in `time` seconds (their share of it, where rows finished), over `step` steps:
  a single step or a steady run priced at once.

The rule is a one-sided CUSUM in seconds: after each drafting step (or steady run) the excess
E <- max(0, E + S - (1 + margin) P), with S its realised seconds and P plain decoding's for its
tokens; when E exceeds `window` plain steps at the current batch, the guard falls back to
plain decoding for `backoff` x 2^(n - 1) steps (the n-th back-off in a row, at most
`backoff_max`), then lets the inner policy choose again with E = 0. Each `window` drafting
steps that paid (S <= P over them) take one doubling back.

The bound. E starts each stretch of trust at 0 and max(0, .) only raises it, so over a stretch
sum(S - (1 + margin) P) <= E at its end, which is at most the threshold plus the stretch's last
observation's excess. Plain steps cost nothing against plain decoding. So, over the steps in
the books (`regret_bound`),

    realised - plain <= margin x plain + (back-offs + 1) x (window plain steps + one observation)

with an observation a step or a steady run (at most `STEADY_CAP` steps once the books show a
loss; before, the engine's longest run), and the window's plain steps at the dearest batch.
Outside the books, each back-off adds the step that resumes drafting after it (with the
drafter's catch-up), and each row that joins its first drafting step. While speculation keeps
losing the back-offs double: n of them in a row hold plain decoding for backoff x (2^n - 1)
steps, so a run of N steps sees at most log2(1 + N / backoff) of them (then one per
`backoff_max` steps). Where speculation pays, E stays near 0 and the guard never intervenes:
its choices are the inner policy's.

The books price tokens, as the adaptive policies do; a rollout's time also depends on which
rows finish when (a drain's last steps run at a few rows, the dearest steps per token), which
neither the books nor the inner policies' token rates see.
"""

from __future__ import annotations

import math

import numpy as np

from rlsched.policies.types import OFF, CostModel, EngineState, StepOutcome, Strategy

MARGIN = 0.02  # realised time may exceed plain decoding's by this fraction
WINDOW = 16  # the loss, in plain steps at the current batch, beyond the margin before a back-off
BACKOFF = 64  # steps of plain decoding at the first back-off in a row
BACKOFF_MAX = 8192
STEADY_CAP = 32  # the longest steady run of drafting steps the guard promises once it has seen a loss
_CTX_STEP = 0.1  # the plain step is priced at contexts a row this fraction apart, linear in between
_LOG_CTX_STEP = math.log1p(_CTX_STEP)
_MARK_MAX = 1 << 22  # the largest sample id marked in an array (above: numpy's isin)
_DECAY = 0.9  # the weight of the old calibration against one measured verify


class Guarded:
    """`inner` (a DraftPolicy) held to plain decoding (the module's docstring: the rule and its
    bound). Its `name`, `needs_acceptance` and other attributes are the inner policy's; every
    StepOutcome reaches the inner policy's `observe`."""

    def __init__(
        self,
        inner,
        ctx,
        margin: float = MARGIN,
        window: int = WINDOW,
        backoff: int = BACKOFF,
        backoff_max: int = BACKOFF_MAX,
    ):
        self.inner = inner
        self.name = inner.name
        self.needs_acceptance = getattr(inner, "needs_acceptance", True)
        self._measured = bool(ctx.calibrate)
        self.observes = bool(getattr(inner, "observes", True)) or self._measured
        self._cost: CostModel = ctx.cost
        self._drafters = tuple(ctx.drafters)
        self.margin, self.window, self.backoff, self.backoff_max = margin, window, backoff, backoff_max
        self.excess = 0.0  # the CUSUM, seconds
        self.level = 0  # back-offs in a row
        self.off_left = 0  # steps of the current back-off still to run
        self.backoffs = 0
        self.realised_s = 0.0  # the books: drafting steps' seconds ...
        self.plain_s = 0.0  # ... and plain decoding's for their tokens
        self.booked_steps = 0  # drafting steps in the books
        self._dearest = 0.0  # the dearest plain step priced, seconds
        self._worst = 0.0  # the largest excess of one observation, seconds
        self._paid = [0.0, 0.0, 0]  # the current window: realised, plain, steps
        # (batch, context bucket) -> verify seconds of a plain step, and batch -> seconds a token
        # of deferred feed: the cost model's, shared by the cluster's guards on that cost model
        # (the entry keeps it alive, so no other takes its id)
        key = ("guard_prices", id(ctx.cost), self._drafters)
        self._verify_prices, self._feed_prices = ctx.shared.setdefault(key, (ctx.cost, {}, {}))[1:]
        self._verify_scale: dict = {}  # batch octave (0: all) -> measured / priced verify
        self._chosen: Strategy | None = None  # the last choice
        self._mark = np.zeros(0, dtype=bool)  # scratch: the sample ids of a batch
        self._offing = False  # the last choice was a back-off's
        # the last choose: (sample ids, ctx tokens, time, step, its choice, whether the step it
        # ran had its drafter current: the same drafter drafted the step before, same batch)
        self._seen: tuple | None = None

    def __getattr__(self, name: str):
        """The inner policy's attributes (a solved twostate's threshold, a table's cells)."""
        if name.startswith("__") or "inner" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.inner, name)

    # ------------------------------------------------------------------ choosing
    def choose(self, state: EngineState) -> Strategy:
        last = self._seen
        if self._offing:
            self.off_left -= state.step - last[3] if last is not None and state.step > last[3] else 1
        kept = self._kept(state)
        if not self.observes and kept is not None and last is not None:
            self._book_choose_view(state, kept, last)
        if self.off_left > 0:
            strategy, self._offing = OFF, True
        else:
            strategy, self._offing, self.off_left = self.inner.choose(state), False, 0
        # the step this choice runs has its drafter current when the same drafter drafted the
        # last one and no row has joined since (a joining row's prompt is fed before it drafts)
        same = last is not None and last[4].drafter is not None and last[4].drafter == strategy.drafter
        clean = kept is not None and same
        snapshot = None if self.observes else state.ctx_lens.copy()
        self._seen = (state.sample_ids, state.ctx_tokens, state.time, state.step, strategy, clean, snapshot)
        self._chosen = strategy
        return strategy

    def steady_steps(self, state: EngineState, strategy: Strategy, max_growth: int) -> int:
        """A back-off's remaining steps; else the inner policy's promise, for a drafting
        strategy none where its drafter catches up first (that step stays out of the books:
        alone, not a whole run), and at most STEADY_CAP steps once the books show a loss (the
        guard checks between runs)."""
        if self._offing:
            return max(0, self.off_left - 1)
        if not strategy.is_off and (self._seen is None or not self._seen[5]):
            return 0
        steady = getattr(self.inner, "steady_steps", None)
        n = steady(state, strategy, max_growth) if steady is not None else 0
        return n if strategy.is_off or (self.excess == 0.0 and self.level == 0) else min(n, STEADY_CAP - 1)

    def _kept(self, state: EngineState):
        """Which rows of the last choose's batch still run (True: all of them, the same id
        array), or None where rows joined since, or this is a new rollout's first step."""
        last = self._seen
        if last is None or state.step <= last[3]:
            return None
        before, now = last[0], state.sample_ids
        if before is now:
            return True
        if not (len(before) and len(now)):
            return None
        top = max(int(before.max()), int(now.max()))
        if min(int(before.min()), int(now.min())) < 0 or top > _MARK_MAX:
            kept = np.isin(before, now)
        else:  # (a mark a sample id: a tenth of isin's time at a few hundred rows)
            if len(self._mark) <= top:
                self._mark = np.zeros(max(2 * len(self._mark), top + 1), dtype=bool)
            self._mark[now] = True
            kept = self._mark[before]
            self._mark[now] = False
        return kept if np.array_equal(before[kept], now) else None

    def _book_choose_view(self, state: EngineState, kept, last: tuple) -> None:
        """The choose view: the steps since the last choose, when they drafted with their
        drafter current; where rows left after them, the rows that stayed, at their share of
        the steps' time."""
        if not last[5]:
            return
        seconds, b = state.time - last[2], len(last[0])
        if kept is True:
            tokens = state.ctx_tokens - last[1]
        else:
            n = int(np.count_nonzero(kept))
            if n == 0:
                return
            tokens = int((state.ctx_lens - last[6][kept]).sum())
            seconds *= n / b
        if tokens > 0 and seconds > 0:
            self._book(b, last[1], tokens, seconds, state.step - last[3])

    # ------------------------------------------------------------------ observing
    def observe(self, outcome: StepOutcome) -> None:
        self.inner.observe(outcome)
        if not self.observes:
            return
        last, s = self._seen, outcome.strategy
        ctx = outcome.batch * (last[1] / max(len(last[0]), 1) if last is not None else 0.0)
        if self._measured and outcome.verify_time > 0:
            self._calibrate(outcome, ctx)
        if (
            s.is_off
            or self._chosen is None
            or self._chosen.drafter != s.drafter
            or outcome.catch_up > 0
            or outcome.step_time <= 0
            or outcome.emitted <= 0
        ):
            return
        self._book(outcome.batch, ctx, outcome.emitted, outcome.step_time, 1)

    def _calibrate(self, outcome: StepOutcome, ctx: float) -> None:
        """Fold a measured verify into the scale of plain decoding's price."""
        priced = float(self._cost.verify_time(outcome.batch, outcome.strategy.tokens_per_row, ctx))
        if priced <= 0:
            return
        ratio = math.log(outcome.verify_time / priced)
        for key in (outcome.batch.bit_length(), 0):
            old = self._verify_scale.get(key)
            self._verify_scale[key] = ratio if old is None else _DECAY * old + (1 - _DECAY) * ratio

    # ------------------------------------------------------------------ the books
    def _book(self, b: int, ctx: float, tokens: int, seconds: float, steps: int) -> None:
        """One drafting step (or steady run of `steps`) of b rows that emitted `tokens` in
        `seconds`: into the books, the CUSUM and the window; a back-off when the CUSUM passes
        the threshold."""
        step = self._plain_step(b, ctx)
        plain = tokens * step / b
        self.realised_s += seconds
        self.plain_s += plain
        self.booked_steps += steps
        paid = self._paid
        paid[0] += seconds
        paid[1] += plain
        paid[2] += steps
        if paid[2] >= self.window:
            if paid[0] <= paid[1]:
                self.level = max(0, self.level - 1)
            self._paid = [0.0, 0.0, 0]
        over = seconds - (1 + self.margin) * plain
        self._dearest, self._worst = max(self._dearest, step), max(self._worst, over)
        self.excess = max(0.0, self.excess + over)
        if self.excess > self.window * step:
            self.level += 1
            self.backoffs += 1
            self.off_left = min(self.backoff << min(self.level - 1, 62), self.backoff_max)
            self.excess = 0.0
            self._paid = [0.0, 0.0, 0]

    def _plain_step(self, b: int, ctx: float) -> float:
        """Seconds of one plain step of b rows at `ctx` context tokens, with the feed it defers:
        the cost model's verify at the context a row's two neighbouring grid points (a geometric
        grid of `_CTX_STEP`), cached, and linear between them."""
        x = math.log(max(ctx / max(b, 1), 1.0)) / _LOG_CTX_STEP
        j = int(x)
        lo, hi = self._verify_at(b, j), self._verify_at(b, j + 1)
        r = (math.exp((x - j) * _LOG_CTX_STEP) - 1) / _CTX_STEP  # where ctx lies between the two, linearly
        verify = lo + r * (hi - lo)
        if self._verify_scale:
            verify *= math.exp(self._verify_scale.get(b.bit_length(), self._verify_scale[0]))
        return verify + b * self._feed_price(b)

    def _verify_at(self, b: int, j: int) -> float:
        verify = self._verify_prices.get((b, j))
        if verify is None:
            ctx = b * math.exp(j * _LOG_CTX_STEP)
            verify = self._verify_prices[b, j] = float(np.asarray(self._cost.verify_time(b, 1, ctx)).item())
        return verify

    def _feed_price(self, b: int) -> float:
        """Seconds a token for the drafter feed a plain step of b rows defers: the cost model's
        marginal price (b rows fed two tokens each against one), the least over the drafters."""
        price = self._feed_prices.get(b)
        if price is None:
            f = self._cost.drafter_prefill_time
            each = [max(0.0, (f(d, 2 * b, 4 * b) - f(d, b, b)) / b) for d in self._drafters]
            price = self._feed_prices[b] = min(each, default=0.0)
        return price

    @property
    def regret_bound(self) -> float:
        """What the books allow drafting to have cost beyond plain decoding (the module's
        bound): margin x plain decoding's seconds plus, per back-off and once more, `window`
        plain steps at the dearest step seen and the largest excess of one observation."""
        return self.margin * self.plain_s + (self.backoffs + 1) * (self.window * self._dearest + self._worst)


def unguarded(policy):
    """The policy a guard holds (the policy itself when unguarded)."""
    return policy.inner if isinstance(policy, Guarded) else policy
