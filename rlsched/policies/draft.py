"""Drafting-strategy selection: which drafter and how many draft tokens, each engine step."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import numpy as np

from rlsched.policies.position import CONSTANT, reach
from rlsched.policies.position import chain_tokens as curve_tokens
from rlsched.policies.tree import (
    TREE_GAIN,
    TreeShape,
    TreeTable,
    chain_tokens,
    reference_acceptance,
    tree_options,
    tree_shape,
)
from rlsched.policies.types import NEVER_CHANGES, OFF, CostModel, EngineState, StepOutcome, Strategy


@dataclass(frozen=True)
class PolicyContext:
    """What a policy may be built from: the cost model, the drafters the engine has, and
    what is known of the job before it runs. The simulator and the executor both fill it."""

    cost: CostModel | None
    drafters: tuple[str, ...]
    k_max: int = 8
    max_batch: int = 256
    typical_ctx: int = 1024  # a sequence's typical context length while it decodes
    acceptance_prior: dict[str, float] = field(default_factory=dict)  # drafter -> expected acceptance
    tree_gain: dict[str, float] = field(default_factory=dict)  # drafter -> its trees' gain (policies/tree.py)
    tree_top1: dict[str, float] = field(default_factory=dict)  # drafter -> its rank-1 rate / its chain acceptance
    # drafter -> its acceptance's fall by draft position (policies/position.py; absent: constant)
    position_decay: dict[str, float] = field(default_factory=dict)
    width_max: int = 1  # widest draft tree a policy may choose (1: chains only)
    nodes_max: int = 8  # most draft tokens of a tree
    seed: int = 0
    identity: dict = field(default_factory=dict)  # model, hardware, drafters: checked against policy files
    true_acceptance: Callable[[str, np.ndarray], np.ndarray] | None = None  # the simulator's truth (oracle only)
    shared: dict = field(default_factory=dict)  # state shared by the policies of one cluster (learners)
    # Step times are measured (the executor): policies that price steps scale the cost model's
    # draft and verify times by what recent steps took against it (off in the simulator, whose
    # step times are the cost model's).
    calibrate: bool = False

    def prior(self, drafter: str) -> float:
        return self.acceptance_prior.get(drafter, 0.6)

    def decay(self, drafter: str) -> float:
        """The drafter's position decay: draft i is accepted at acceptance x decay^(i - 1)."""
        return self.position_decay.get(drafter, CONSTANT)

    def top1(self, drafter: str, acceptance):
        """The rate a tree's rank-1 child is taken at, for a chain's `acceptance` (policies/tree.py)."""
        return acceptance * self.tree_top1.get(drafter, 1.0)

    def tree(self, drafter: str, strategy: Strategy) -> TreeShape:
        """The shape of a tree strategy of this drafter (built for its expected acceptance)."""
        return tree_shape(
            strategy.k,
            strategy.width,
            strategy.nodes,
            self._tree_reference(drafter),
            self.tree_gain.get(drafter, TREE_GAIN),
        )

    def _tree_reference(self, drafter: str) -> float:
        return reference_acceptance(self.prior(drafter), self.tree_top1.get(drafter, 1.0))

    def trees(self, drafter: str) -> tuple[list[Strategy], TreeTable] | None:
        """The tree strategies a policy may choose for `drafter` and their table (None: chains
        only), shared by the policies built from this context."""
        options = tree_options(self.k_max, self.width_max, self.nodes_max)
        if not options:
            return None
        key = ("trees", drafter, self.k_max, self.width_max, self.nodes_max)
        if key not in self.shared:
            table = TreeTable(options, self._tree_reference(drafter), self.tree_gain.get(drafter, TREE_GAIN))
            self.shared[key] = ([Strategy(drafter, k, w, n) for k, w, n in options], table)
        return self.shared[key]


def tree_parts(
    cost: CostModel, drafter: str, options: list[Strategy], batch: int, ctx_tokens
) -> tuple[np.ndarray, np.ndarray]:
    """Draft and verify seconds of each tree strategy in `options` over `batch` rows: k drafter
    forwards of the tree's width, and a verify of 1 + nodes tokens a row."""
    k = np.array([s.k for s in options])
    width = np.array([s.width for s in options])
    verify = np.asarray(cost.verify_time(batch, 1 + np.array([s.nodes for s in options]), ctx_tokens), dtype=float)
    draft = np.zeros(len(options))
    for w in np.unique(width):
        draft[width == w] = cost.draft_time(drafter, batch, k[width == w], ctx_tokens, int(w))
    return draft, verify


def tree_times(cost: CostModel, drafter: str, options: list[Strategy], batch: int, ctx_tokens) -> np.ndarray:
    """Draft + verify seconds of each tree strategy in `options` over `batch` rows (`tree_parts`)."""
    draft, verify = tree_parts(cost, drafter, options, batch, ctx_tokens)
    return draft + verify


def expected_tokens(acceptance: np.ndarray, k_max: int, decay: float = CONSTANT) -> np.ndarray:
    """Expected tokens emitted by a chain step, summed over the batch, for k = 0..k_max.

    Per sequence with acceptance a: sum_{j=0..k} a^j (`tree.chain_tokens`), as running products;
    under a position `decay`, sum_{j=0..k} prod_{i<=j} a decay^(i-1) (`position.reach`).
    """
    a = np.atleast_1d(np.asarray(acceptance, dtype=float))
    if decay != CONSTANT:
        return len(a) + np.concatenate(([0.0], np.cumsum(reach(a, k_max, decay)[:, 1:].sum(axis=0))))
    powers = np.empty((len(a), k_max))
    powers[:] = a[:, None]
    np.cumprod(powers, axis=1, out=powers)
    out = np.empty(k_max + 1)
    out[0] = 0.0
    np.cumsum(powers.sum(axis=0), out=out[1:])
    out += len(a)
    return out


def drain_tokens(acceptance: np.ndarray, k_max: int, decay: float = CONSTANT) -> np.ndarray:
    """`expected_tokens` for a batch that must drain: B^2 / sum_i 1 / E_i(k), for k = 0..k_max
    (B times the harmonic mean of the rows' expected tokens a step, E_i).

    Lossless SD leaves each row's length L_i as it is; it only cuts the row's steps to about
    L_i / E_i(k). A step of B rows costs about B times a row's share, so the stage takes
    sum_i (L_i / E_i(k)) x (step time / B): with lengths unknown and alike, the step that
    gains most is the one with the most B^2 / sum_i(1 / E_i) per second. The plain sum gives
    the same answer when the rows are alike; when they differ it favours long drafts that the
    likely rows use, and the unlikely rows, which then finish last, run the tail of the drain
    at a few rows a step, the dearest steps per token there are."""
    a = np.atleast_1d(np.asarray(acceptance, dtype=float))
    if decay != CONSTANT:
        per_row = np.cumsum(reach(a, k_max, decay), axis=1)
        return len(a) ** 2 / (1.0 / per_row).sum(axis=0)
    per_row = np.ones((len(a), k_max + 1))
    per_row[:, 1:] = a[:, None]
    np.cumprod(per_row, axis=1, out=per_row)
    np.cumsum(per_row, axis=1, out=per_row)
    return len(a) ** 2 / (1.0 / per_row).sum(axis=0)


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
    """The same drafter and k (or tree) every step, whatever the batch."""

    needs_acceptance = False
    observes = False

    def __init__(self, drafter: str, k: int, width: int = 1, nodes: int = 0):
        self.strategy = Strategy(drafter, k, width, nodes)
        self.name = f"tree:{k}:{width}:{self.strategy.nodes}" if width > 1 else f"static:{k}"

    def choose(self, state: EngineState) -> Strategy:
        return self.strategy

    def steady_steps(self, state: EngineState, strategy: Strategy, max_growth: int) -> int:
        return NEVER_CHANGES

    def observe(self, outcome: StepOutcome) -> None:
        pass


def log_mean(old: float | None, new: float, decay: float = 0.8) -> float:
    """A running geometric mean: `old` weighted `decay` against one `new` value (None: none yet)."""
    if old is None:
        return new
    return math.exp(decay * math.log(old) + (1 - decay) * math.log(new))


class GoodputPolicy:
    """RLHFSpec's rule: the (drafter, k) in {off} + drafters x 1..k_max that maximises
    expected tokens / (draft + verify time), from the cost model and each running sequence's
    acceptance estimate.

    The choice is re-derived whenever the batch size changes, the batch's context grows by
    `ctx_tolerance`, or `refresh` steps have passed (acceptance estimates move slowly); in
    between the last choice stands. refresh=1 re-derives every step.

    With `ctx.calibrate` (the executor) the verify and each drafter's times are scaled by the
    geometric mean of measured / priced over recent steps: a profile taken minutes earlier on a
    shared machine, or one that misses per-step overheads, can misprice drafting against
    verification. The choices then depend on measured times, as bandit's do.

    A plain step is charged for the drafter work it defers: the tokens it emits must be fed to
    a model drafter before it drafts again; unpriced, plain steps look cheaper than they are
    in a drain. The price of a token is the cost model's (`drafter_prefill_time`: a profile's feed,
    the roofline's drafter forward) until, calibrating, steps whose drafter caught up have
    measured it (`_feed`).

    `drain` (`goodput:drain`): tokens counted by `drain_tokens` (B x the harmonic mean of the
    rows' expected tokens) instead of their sum.
    """

    name = "goodput"
    needs_acceptance = True
    observes = False
    _DECAY = 0.8  # weight of the running scale against one new step's ratio
    _REL_DECAY = 0.95  # the same for a k's factor against its octave (structure, not drift)
    _EXPLORE_MARGIN, _EXPLORE_STEPS = 0.05, 4  # `_explore`

    def __init__(self, ctx: PolicyContext, refresh: int = 32, ctx_tolerance: float = 0.05, drain: bool = False):
        # None only in a policy built and never run (the registry's checks build one)
        self.cost = cast(CostModel, ctx.cost)
        self.drafters, self.k_max = ctx.drafters, ctx.k_max
        self._tokens = drain_tokens if drain else expected_tokens
        self.refresh, self.ctx_tolerance = refresh, ctx_tolerance
        self._ks = np.arange(1, self.k_max + 1)
        self._last: tuple | None = None  # (batch, ctx_tokens, step, strategy, sample ids)
        self.calibrate = self.observes = ctx.calibrate
        # (batch, context bucket) -> the cost model's prices, shared by the cluster's policies
        # on the same cost model (one each of 1024 instances held 160 MiB more at peak); the
        # entry keeps the cost model alive, so no other can take its id while the entry exists
        key = ("goodput_prices", id(ctx.cost), ctx.drafters, ctx.k_max, ctx_tolerance)
        self._price_cache: dict = ctx.shared.setdefault(key, (ctx.cost, {}))[1]
        # "verify" or a drafter, alone or with a batch octave -> measured / priced time
        self._scale: dict = {}
        # (key, octave) -> [log factor of each k = 0..k_max against the octave's scale, steps
        # folded for each k, the factors as an array (None: changed since)]: lists, as a step
        # updates one entry (numpy's per-element cost would be most of `observe`'s)
        self._rel: dict = {}
        self._ones = np.ones(self.k_max + 1)  # (read only)
        self._feed: dict[str, float] = {}  # drafter -> seconds to feed it one token (catch-up)
        self._priced: tuple | None = None  # (batch, verify at q = 1, verify at q = 2.., {drafter: draft at k = 1..})
        self._drain = drain
        self._trees = {d: t for d in self.drafters if (t := ctx.trees(d)) is not None}
        # each tree option's verify, as a chain's k (for the measured verify scales)
        self._tree_nodes = {d: np.minimum([s.nodes for s in t[0]], self.k_max) for d, t in self._trees.items()}
        self._ctx = ctx

    def choose(self, state: EngineState) -> Strategy:
        last = self._last
        if (
            last is not None
            and self._same_batch(last, state)
            and 0 <= state.step - last[2] < self.refresh
            and state.ctx_tokens <= last[1] * (1 + self.ctx_tolerance)
        ):  # step < last: a new rollout
            return last[3]
        best = self._decide(state)
        self._last = (state.batch, state.ctx_tokens, state.step, best, state.sample_ids)
        return best

    def _same_batch(self, last, state: EngineState) -> bool:
        return last[0] == state.batch

    def _decide(self, state: EngineState) -> Strategy:
        b = state.batch
        v1, vk, drafts = self._prices(b, state.ctx_tokens)
        sv = self._scales("verify", b)
        deferred = b * min((self._feed_price(d, b) for d in self.drafters), default=0.0)
        best, best_rate = OFF, b / (sv[0] * v1 + deferred)
        for d in self.drafters:
            tokens = self._tokens(self._acceptance(state, d), self.k_max, self._ctx.decay(d))[1:]
            rates = tokens / (self._scales(d, b)[1:] * drafts[d] + sv[1:] * vk)
            j = self._explore(b, rates, int(np.argmax(rates))) if self.calibrate else int(np.argmax(rates))
            if rates[j] > best_rate:
                best, best_rate = Strategy(d, int(self._ks[j])), float(rates[j])
            if d in self._trees:  # measured scales: the drafter's at this batch, the verify's at 1 + nodes
                options, table = self._trees[d]
                tokens = table.tokens(self._ctx.top1(d, self._acceptance(state, d)), self._drain)
                t_draft, t_verify = self._tree_prices(d, b, state.ctx_tokens)
                if self._scale:
                    rates = tokens / (self._scale_at(d, b) * t_draft + sv[self._tree_nodes[d]] * t_verify)
                else:
                    rates = tokens / (t_draft + t_verify)
                j = int(np.argmax(rates))
                if rates[j] > best_rate:
                    best, best_rate = options[j], float(rates[j])
        if self.calibrate:
            self._priced = (b, v1, vk, drafts)
        return best

    def _prices(self, b: int, ctx_tokens: int) -> tuple[float, np.ndarray, dict]:
        """The cost model's verify times (q = 1, then 2..k_max + 1) and each drafter's draft
        times (k = 1..k_max) for b rows, cached by the batch and the context a row to within
        `ctx_tolerance`, the growth over which a choice already stands. (The lookups are most
        of a decision's time, and a decision most of what `goodput` adds to a round over
        static k, which decides nothing.)"""
        if self.ctx_tolerance <= 0:  # (the oracles: every step priced at its own context)
            key = None
        else:
            key = (b, round(math.log(max(ctx_tokens / max(b, 1), 1.0)) / math.log1p(self.ctx_tolerance)))
            if (hit := self._price_cache.get(key)) is not None:
                return hit
        v = self.cost.verify_time(b, np.arange(1, self.k_max + 2), ctx_tokens)
        out = (float(v[0]), v[1:], {d: self.cost.draft_time(d, b, self._ks, ctx_tokens) for d in self.drafters})
        if key is not None:
            self._price_cache[key] = out
        return out

    def _tree_prices(self, drafter: str, b: int, ctx_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """Draft and verify seconds of each tree option of `drafter` for b rows (`tree_parts`),
        cached as `_prices`."""
        key = (
            None
            if self.ctx_tolerance <= 0
            else (
                "trees",
                drafter,
                b,
                round(math.log(max(ctx_tokens / max(b, 1), 1.0)) / math.log1p(self.ctx_tolerance)),
            )
        )
        if key is not None and (hit := self._price_cache.get(key)) is not None:
            return hit
        out = tree_parts(self.cost, drafter, self._trees[drafter][0], b, ctx_tokens)
        if key is not None:
            self._price_cache[key] = out
        return out

    def _feed_price(self, drafter: str, b: int) -> float:
        """Seconds a token for feeding `drafter` what a plain step of b rows defers: as measured,
        or the cost model's marginal price (b rows fed two tokens each against one)."""
        if drafter in self._feed:
            return self._feed[drafter]
        price = self.cost.drafter_prefill_time
        return max(0.0, (price(drafter, 2 * b, 4 * b) - price(drafter, b, b)) / b)

    def observe(self, outcome: StepOutcome) -> None:
        """(With calibrate) fold this step's measured verify and draft times into the scales,
        against the prices of the choice it ran under."""
        s, priced = outcome.strategy, self._priced  # priced only when calibrating
        if priced is None or priced[0] != outcome.batch:
            return
        _, v1, vk, drafts = priced
        b = outcome.batch
        if s.width > 1:  # a tree: its verify of 1 + nodes tokens is a chain's of k = nodes; its
            if s.nodes <= self.k_max:  # drafting (width rows a row) is no chain's
                self._fold("verify", b, s.nodes, outcome.verify_time, vk[s.nodes - 1])
            return
        self._fold("verify", b, s.k, outcome.verify_time, v1 if s.k == 0 else vk[s.k - 1])
        # a step whose drafter caught up (a joining row's prompt, the tokens of off steps) is a
        # prefill, not the drafting priced: folded, one such step after off steps would price the
        # drafter high for good, and off would never be left again
        if s.k > 0 and s.drafter is not None and s.drafter in drafts:
            if outcome.catch_up == 0:
                self._fold(s.drafter, b, s.k, outcome.draft_time, drafts[s.drafter][s.k - 1])
            else:  # what the feed cost beyond the drafting priced, a token
                extra = outcome.draft_time - self._scales(s.drafter, b)[s.k] * drafts[s.drafter][s.k - 1]
                if extra > 0:
                    self._feed[s.drafter] = log_mean(self._feed.get(s.drafter), extra / outcome.catch_up, self._DECAY)

    def _fold(self, key: str, b: int, k: int, measured: float, priced: float) -> None:
        """One step's measured / priced into the scales: over all batch sizes; for the octave of
        b; and, relative to the octave's, for k there (a slower mean)."""
        if measured <= 0 or priced <= 0:
            return
        ratio = math.log(measured / priced)
        octave = (key, b.bit_length())
        entry = self._rel.get(octave)
        if entry is None:
            entry = self._rel[octave] = [[0.0] * (self.k_max + 1), [0] * (self.k_max + 1), None]
        rel, seen = entry[0], entry[1]
        self._scale[octave] = math.exp(
            self._DECAY * math.log(self._scale_at(key, b)) + (1 - self._DECAY) * (ratio - rel[k])
        )
        self._scale[key] = log_mean(self._scale.get(key, 1.0), measured / priced, self._DECAY)
        w = max(1.0 / (seen[k] + 1), 1 - self._REL_DECAY)  # a mean over the first steps, then forgetting
        rel[k] += w * (ratio - math.log(self._scale[octave]) - rel[k])
        seen[k] += 1
        entry[2] = None

    def _explore(self, b: int, rates: np.ndarray, j: int) -> int:
        """The k at index j, or a neighbour priced within `_EXPLORE_MARGIN` of it that has run
        fewer than `_EXPLORE_STEPS` steps in this octave of batch sizes: its own factor
        (`_scales`) is then measured. Without it a k the profile overpriced would never run, so
        never be corrected: `goodput` would keep drafting the k the profile favours even where a
        neighbouring k runs faster a token."""
        entry = self._rel.get(("verify", b.bit_length()))
        seen = None if entry is None else entry[1]
        for n in (j - 1, j + 1):
            if (
                0 <= n < len(rates)
                and rates[n] >= (1 - self._EXPLORE_MARGIN) * rates[j]
                and (seen is None or seen[n + 1] < self._EXPLORE_STEPS)
            ):
                return n
        return j

    def _scale_at(self, key: str, b: int) -> float:
        """Measured / priced for `key` ("verify" or a drafter) at b rows, by octave of b: how far
        a profile is off depends on the batch (its per-step overheads, the machine's caches).
        An octave not measured yet goes by the scale over all batch sizes."""
        return self._scale.get((key, b.bit_length()), self._scale.get(key, 1.0))

    def _scales(self, key: str, b: int) -> np.ndarray:
        """`_scale_at` for k = 0..k_max (verify: q = k + 1): the octave's times each k's own
        factor where that k has run there. A profile can misprice one k against the next (its
        points are timed one by one, minutes before) by as much as the best k gains over its
        neighbours; with the factors measured in the run itself, it does not pick the k that
        noise made cheap."""
        if not self._scale:  # nothing measured (always, uncalibrated: the simulator)
            return self._ones
        entry = self._rel.get((key, b.bit_length()))
        s = self._scale_at(key, b)
        if entry is None:
            return np.full(self.k_max + 1, s)
        if entry[2] is None:
            entry[2] = np.exp(entry[0])
        return s * entry[2]

    def _acceptance(self, state: EngineState, drafter: str) -> np.ndarray:
        return state.accept_est(drafter)

    def steady_steps(self, state: EngineState, strategy: Strategy, max_growth: int) -> int:
        """Steps after this one that `choose` will answer from its cache (same batch)."""
        last = self._last
        if last is None or last[3] is not strategy:
            return 0
        by_refresh = self.refresh - 1 - (state.step - last[2])
        room = last[1] * (1 + self.ctx_tolerance) - state.ctx_tokens
        by_ctx = int(room // max_growth) - 1 if max_growth > 0 else NEVER_CHANGES
        return max(0, min(by_refresh, by_ctx))


class SeqGoodputPolicy(GoodputPolicy):
    """rlsched's rule: every sequence gets its own draft length (a ragged verify), so likely
    sequences draft long and unlikely ones short or not at all. For a given number of draft
    tokens the most expected tokens come from the largest marginal gains a_i^j, so the
    candidates are thresholds tau (k_i = how many j <= k_max have a_i^j >= tau), each also
    under every cap on the longest draft (whose drafter forwards every row waits for), plus
    the uniform k's; each is priced by the cost model (ragged drafting, verify of
    sum(k_i + 1) tokens) and the best rate against plain decoding wins."""

    name = "seqgoodput"
    _LOG_TAUS = np.log(np.geomspace(0.02, 0.98, 24))[:, None]

    def __init__(self, ctx: PolicyContext, refresh: int = 32, ctx_tolerance: float = 0.05):
        super().__init__(ctx, refresh, ctx_tolerance)
        self.calibrate = self.observes = False  # (prices per-row lengths: not calibrated yet)

    def _same_batch(self, last, state: EngineState) -> bool:
        return last[4] is state.sample_ids  # per-row lengths belong to these very rows

    def _decide(self, state: EngineState) -> Strategy:
        b, ctx = state.batch, state.ctx_tokens
        best, best_rate = OFF, b / self.cost.verify_time(b, 1, ctx)
        for d in self.drafters:
            a = np.clip(self._acceptance(state, d), 1e-6, 1 - 1e-6)
            decay = self._ctx.decay(d)
            if decay == CONSTANT:
                by_tau = np.clip(np.floor(self._LOG_TAUS / np.log(a)), 0, self.k_max).astype(np.int64)
            else:  # the marginal gains prod_{i<=j} alpha_i fall with j: count those above tau
                log_reach = np.log(reach(a, self.k_max, decay)[:, 1:])
                by_tau = (log_reach[None] >= self._LOG_TAUS[:, :, None]).sum(axis=2)
            # each threshold under every cap (the longest draft sets the drafter forwards), and the uniform k's
            capped = np.minimum(by_tau[None], self._ks[:, None, None]).reshape(-1, b)
            ks = np.concatenate((capped, np.repeat(self._ks[:, None], b, axis=1)))  # (candidates, batch)
            tokens = (chain_tokens(a, ks) if decay == CONSTANT else curve_tokens(a, ks, decay)).sum(axis=1)
            times = self.cost.draft_time_per_row(d, ks, ctx) + self.cost.verify_time(b, 1 + ks.mean(axis=1), ctx)
            rates = tokens / np.maximum(times, 1e-12)
            rates[ks.max(axis=1) == 0] = 0.0
            j = int(np.argmax(rates))
            if rates[j] > best_rate:
                best, best_rate = Strategy(d, int(ks[j].max()), k_per_row=ks[j]), float(rates[j])
        return best

    def steady_steps(self, state: EngineState, strategy: Strategy, max_growth: int) -> int:
        last = self._last
        if last is None or last[4] is not state.sample_ids:
            return 0
        return super().steady_steps(state, strategy, max_growth)
