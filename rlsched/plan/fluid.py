"""A generation stage's time without SimPy: the fluid estimate a planner screens setups with.

Each instance takes its rows as the simulator assigns them (round robin over samples, or by
prompt) and admits them first come, first served up to its batch limit: `max_batch`, or fewer
where the KV cache holds fewer rows (its capacity over a row's mean footprint halfway through
its response). Between two events (a row finishing, a queued row joining) the batch is fixed,
so every step of that phase costs the same: the cost model's price of the phase's strategy
(a chain of k drafts, verified as k + 1 tokens a row, or a tree) at the phase's context; a
prefill is paid when rows join. Row i emits E_i tokens a step in expectation: (1 - a_i^(k+1)) /
(1 - a_i) for a chain (a_i: its own per-token acceptance, drawn as the simulator draws the first
RL step's rollout), and 1 + the tree model's expected accepted drafts for a tree
(`policies/tree.py`); a phase lasts until the first row reaches its length. The strategy of a
phase: none (off), a chain of K (static:K), the solved two-state rule (K up to a batch size, off
above), or the most tokens a second over the phase's rows among chains and, where the config
allows trees, trees (goodput and every other adaptive policy, knowing the rows' acceptance: an
optimistic price of a per-step choice).

The stage's time is the slowest instance's; with many instances only the critical ones are
run: those with the most work, and those whose rows end last in a first-come-first-served
queue of steps. Reallocation is not modelled: `balanced_s` is what the stage would take with
the work spread evenly (an optimistic price of rebalancing).

Under vLLM's engine model (`engine.kind: vllm`) the fluid prices vLLM's knobs too: a step
serves at most `max_num_batched_tokens` of its rows' tokens (so a short budget stretches a
phase over more, smaller steps, each still drafting for every row), runs at the next CUDA-graph
capture size of the tokens it serves (above the largest, at its own count), and prompts are
prefilled in steps of at most the budget: cut anywhere with chunked prefill, whole prompts
packed into the budget without it. With prefix caching a row whose prompt another row of the
instance has prefilled computes only its last block. Prefill steps are priced apart from the
decode steps they would share in vLLM (mixed steps): an upper bound of a few weight reads a
rollout. Async scheduling and preemption are left to the simulator.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np

from rlsched.config import SimConfig
from rlsched.policies.draft import tree_parts
from rlsched.policies.position import CONSTANT, reach
from rlsched.policies.registry import PolicySpec, as_spec, make_draft_policy
from rlsched.policies.tree import GRID, chain_tokens
from rlsched.sim.cluster import kv_capacity
from rlsched.sim.simulate import policy_context
from rlsched.sim.workload import sample_rollout

CRITICAL = 2  # with more instances, those with the most work and those whose rows end last (each this many)


@dataclass(frozen=True)
class FluidStage:
    seconds: float  # the stage's time: the slowest instance's
    balanced_s: float  # the stage's time with the work spread evenly over the instances
    tokens: int  # response tokens
    prompt_tokens: int


def expected_tokens_per_row(acceptance: np.ndarray, k_max: int, decay: float = CONSTANT) -> np.ndarray:
    """(rows, k_max + 1): tokens a chain step of k drafts emits in expectation, per row, at
    first-token acceptance `acceptance` falling by `decay` a draft position."""
    if decay != CONSTANT:
        return np.cumsum(reach(np.clip(acceptance, 0.0, 1.0), k_max, decay), axis=-1)
    a = np.clip(acceptance, 0.0, 1.0 - 1e-9)[:, None]
    return chain_tokens(a, np.arange(k_max + 1))


class Strategies:
    """The strategies a setup's steps choose among, as columns: chains of k = 0..k_max drafts,
    then the config's tree options (none with width_max 1); each column's tokens a step per row
    and its seconds a step at b rows, memoised by b and the context a row to within
    `tolerance` (priced at the first context seen in its band): the setups of one tp and
    drafter meet the same batch sizes and contexts again and again."""

    def __init__(self, cfg: SimConfig, cost, drafter: str | None, tolerance: float = 0.01, engine=None):
        self.cost, self.drafter, self.engine = cost, drafter, engine
        self.k_max = cfg.speculation.k_max if drafter is not None else 0
        self.trees: list = []  # the tree options, as Strategies
        self.table, self.top1, self.decay = None, 1.0, CONSTANT
        if drafter is not None:
            ctx = policy_context(cfg, cost)
            self.decay = ctx.decay(drafter)
            trees = ctx.trees(drafter)
            if trees is not None:
                self.trees, self.table = trees
                self.top1 = ctx.tree_top1.get(drafter, 1.0)
        self._log_band = math.log1p(tolerance)
        self._memo: dict[tuple[int, int], np.ndarray] = {}

    @property
    def key(self) -> tuple:
        return self.drafter, self.k_max, tuple((s.k, s.width, s.nodes) for s in self.trees)

    def tokens(self, acceptance: np.ndarray) -> np.ndarray:
        """(rows, columns): tokens a step of each strategy emits per row, in expectation."""
        chains = expected_tokens_per_row(acceptance, self.k_max, self.decay)
        if self.table is None:
            return chains
        level = np.rint(np.clip(acceptance * self.top1, 0.0, 1.0) * (len(GRID) - 1)).astype(np.int64)
        return np.hstack([chains, 1.0 + self.table.accepted[:, level].T])

    def seconds(self, b: int, ctx_sum: float) -> np.ndarray:
        key = (b, round(math.log(max(ctx_sum / b, 1.0)) / self._log_band))
        hit = self._memo.get(key)
        if hit is None:
            ks = np.arange(self.k_max + 1)
            hit, share = engine_step(self.cost, self.engine, b, ks + 1, ctx_sum)
            if self.k_max > 0:
                hit[1:] += self.cost.draft_time(self.drafter, b, ks[1:], ctx_sum)
            hit = hit / share
            if self.trees:
                assert self.drafter is not None  # (trees are a drafter's)
                draft, verify = tree_parts(self.cost, self.drafter, self.trees, b, ctx_sum)
                share = np.ones(len(self.trees))
                if self.engine is not None:
                    verify, share = engine_step(self.cost, self.engine, b, [1 + t.nodes for t in self.trees], ctx_sum)
                hit = np.concatenate([hit, (draft + verify) / share])
            self._memo[key] = hit
        return hit


def engine_step(cost, engine, b: int, q, ctx_sum: float) -> tuple[np.ndarray, np.ndarray]:
    """(seconds of a verify step of `b` rows of `q` tokens each (an array), the share of those
    tokens it serves): all of them on rlsched's engine; under vLLM's (`engine`, resolved), at
    most the token budget, run at the next capture size of the tokens served."""
    q = np.asarray(q, dtype=float)
    if engine is None:
        return np.asarray(cost.verify_time(b, q, ctx_sum), dtype=float), np.ones_like(q)
    tokens = b * q
    served = np.minimum(tokens, engine.max_num_batched_tokens)
    sizes = np.asarray(engine.capture_sizes, dtype=float)
    run = served
    if len(sizes):
        i = np.searchsorted(sizes, served)
        run = np.where(i < len(sizes), sizes[np.minimum(i, len(sizes) - 1)], served)
    return np.asarray(cost.verify_time(b, run / b, ctx_sum), dtype=float), served / tokens


def prefill_s(cost, engine, p: np.ndarray, computed: np.ndarray | None = None) -> float:
    """Seconds to prefill prompts of lengths `p`, of which `computed` tokens each (default: all;
    fewer where the prefix cache holds the rest): one forward on rlsched's engine; under vLLM's,
    steps of at most the token budget (whole prompts packed without chunked prefill)."""
    c = p if computed is None else computed
    total, sq = int(c.sum()), int((c * p).sum())
    if engine is None or total == 0:
        return float(cost.prefill_time(total, sq))
    budget = engine.max_num_batched_tokens
    if engine.chunked_prefill:
        n = math.ceil(total / budget)
    else:
        n = math.ceil(len(p) / max(1, budget // max(int(c.max()), 1)))
    return n * float(cost.prefill_time(math.ceil(total / n), sq // n))


def _rule(policy: PolicySpec, cfg: SimConfig, cost):
    """The column a step of b rows takes under `policy`: a number (off: 0, static:K: K), a
    function of b (twostate: solved as the simulator solves it, a chain of K up to its batch
    size, off above), or None (choose the most tokens a second)."""
    if policy.family == "off":
        return 0
    if policy.family == "static":
        return policy.k
    if policy.family == "twostate":
        two = make_draft_policy(policy, policy_context(cfg, cost))
        if two.on.width > 1:
            raise ValueError("the fluid estimate prices a two-state policy's chains, not its trees")
        return lambda b: two.k if b <= two.max_batch_on else 0
    return None


def instance_time(
    cost,
    strategies: Strategies,
    rule,
    prompt_len: np.ndarray,
    response_len: np.ndarray,
    acceptance: np.ndarray,
    *,
    max_batch: int,
    prompt_of: np.ndarray | None = None,
) -> float:
    """One instance's busy time for these rows (in their admission order) under a policy's
    `rule` (`_rule`): prefills priced by `cost`, steps by `strategies` (and its vLLM engine:
    `prompt_of`, the rows' prompts, for its prefix cache)."""
    engine = strategies.engine
    cached = prompt_of is not None and engine is not None and engine.prefix_caching
    seen: set[int] = set()
    n = len(response_len)
    if n == 0:
        return 0.0
    per_step = strategies.tokens(acceptance) if rule != 0 else np.ones((n, 1))
    left = response_len.astype(float)
    ctx = prompt_len.astype(float)
    running = np.zeros(n, dtype=bool)
    queued = 0  # rows [queued:] have not joined yet
    t = 0.0
    while True:
        room = max_batch - int(running.sum())
        if room > 0 and queued < n:
            join = np.arange(queued, min(n, queued + room))
            p = prompt_len[join].astype(np.int64)
            computed = None
            if cached:
                assert prompt_of is not None and engine is not None  # (cached says so)
                bs, computed = engine.block_size, p.copy()
                for i, g in enumerate(prompt_of[join].tolist()):
                    if g in seen:  # its prompt's full blocks are cached: its last block is computed
                        computed[i] = p[i] - (p[i] - 1) // bs * bs
                    seen.add(g)
            t += prefill_s(cost, engine, p, computed)
            running[join] = True
            queued = join[-1] + 1
        rows = np.flatnonzero(running)
        if len(rows) == 0:
            return t
        b, ctx_sum = len(rows), float(ctx[rows].sum())
        j = rule(b) if callable(rule) else rule
        if j == 0:
            verify, share = engine_step(cost, engine, b, [1.0], ctx_sum)
            step_s = float(verify[0] / share[0])
        else:
            seconds = strategies.seconds(b, ctx_sum)
            if j is None:
                j = int(np.argmax(per_step[rows].sum(axis=0) / seconds))
            step_s = float(seconds[j])
        gain = per_step[rows, j]
        steps = float(np.min(left[rows] / gain))  # until the first row reaches its length
        t += steps * step_s
        left[rows] -= steps * gain
        ctx[rows] += steps * gain
        running[rows[left[rows] <= 1e-6]] = False


def _makespan(steps: np.ndarray, slots: int) -> float:
    """When the last row finishes, in steps, with `slots` rows running at once, each taking the
    next queued row when it frees (first come, first served)."""
    if len(steps) <= slots:
        return float(steps.max(initial=0.0))
    free = list(steps[:slots])
    heapq.heapify(free)
    for d in steps[slots:]:
        heapq.heappush(free, heapq.heappop(free) + d)
    return max(free)


def batch_limit(cfg: SimConfig, capacity: int, prompt_len: np.ndarray, response_len: np.ndarray) -> int:
    """`max_batch`, or the rows the KV cache holds at their mean footprint halfway through their
    responses, whichever is fewer (at least 1)."""
    footprint = float(np.mean(prompt_len + response_len / 2.0))
    return max(1, min(cfg.cluster.max_batch, int(0.99 * capacity / footprint)))


def resolved_engine(cfg: SimConfig):
    """The vLLM engine's settings an instance of `cfg` runs (None: rlsched's engine)."""
    if cfg.engine.kind != "vllm":
        return None
    hw, host = cfg.hardware, any(d.kind == "ngram" for d in cfg.drafters)
    return cfg.engine.resolve(hw.memory_gib, hw.name, cfg.cluster.max_batch, host)


def stage_time(
    cfg: SimConfig, policy: PolicySpec | str, cost, seed: int | None = None, strategies: Strategies | None = None
) -> FluidStage:
    """The fluid estimate of the first RL step's generation stage of `cfg` under `policy`
    (off, static:K[:DRAFTER], or any adaptive policy), priced by `cost` (or `strategies`, the
    step prices of this drafter over `cost` shared with other setups); the rows and their
    acceptance as the simulator draws them for `seed` (default: the config's)."""
    root = np.random.SeedSequence(cfg.seed if seed is None else seed)
    workload_seq, _ = root.spawn(2)  # the simulator's first RL step draws its rollout from the first
    rollout = sample_rollout(
        cfg.workload,
        cfg.drafters,
        {d.name: d.acceptance.mean for d in cfg.drafters},
        np.random.default_rng(workload_seq),
    )
    policy = as_spec(policy)
    drafter = None
    if policy.family != "off":
        drafter = (policy.family == "static" and policy.drafter) or rollout.drafters[0]
    engine = resolved_engine(cfg)
    if strategies is None or strategies.drafter != drafter or strategies.engine != engine:
        strategies = Strategies(cfg, cost, drafter, engine=engine)
    rule = _rule(policy, cfg, cost)
    j = rollout.drafters.index(drafter) if drafter is not None else 0
    instances = cfg.cluster.instances
    owner = (np.arange(rollout.n) if cfg.cluster.assignment == "round_robin" else rollout.prompt_of) % instances
    limit = batch_limit(cfg, kv_capacity(cfg, cost), rollout.prompt_len, rollout.response_len)
    # each row's steps at a middling chain's tokens a step; an instance's work (their sum) and its
    # makespan in steps with `limit` slots taken first come, first served
    rate = (
        expected_tokens_per_row(rollout.acceptance[:, j], 2, strategies.decay)[:, -1]
        if drafter is not None
        else np.ones(rollout.n)
    )
    steps = rollout.response_len / rate
    work = np.bincount(owner, steps, minlength=instances)
    critical = np.arange(instances)
    if instances > CRITICAL:
        makespan = np.array([_makespan(steps[owner == i], limit) for i in range(instances)])
        critical = np.unique(np.concatenate([np.argsort(-work)[:CRITICAL], np.argsort(-makespan)[:CRITICAL]]))
    times: dict = {}  # critical instance -> its seconds
    for i in critical:
        mine = np.flatnonzero(owner == i)
        acc = rollout.acceptance[mine, j] if drafter is not None else np.zeros(len(mine))
        times[i] = instance_time(
            cost,
            strategies,
            rule,
            rollout.prompt_len[mine],
            rollout.response_len[mine],
            acc,
            max_batch=limit,
            prompt_of=rollout.prompt_of[mine],
        )
    slowest = max(times, key=times.__getitem__)
    seconds = times[slowest]
    balanced = seconds * float(work.mean() / work[slowest]) if work[slowest] > 0 else seconds
    return FluidStage(seconds, min(seconds, balanced), int(rollout.response_len.sum()), int(rollout.prompt_len.sum()))
