"""A generation stage's time without SimPy: the fluid estimate a planner screens setups with.

Each instance takes its rows as the simulator assigns them (round robin over samples, or by
prompt) and admits them first come, first served up to `max_batch`. Between two events (a row
finishing, a queued row joining) the batch is fixed, so every step of that phase costs the
same: the cost model's verify of k + 1 tokens a row plus the drafting of k, at the phase's
context; a prefill is paid when rows join. Row i emits E_i(k) = (1 - a_i^(k+1)) / (1 - a_i)
tokens a step in expectation (a_i: its own per-token acceptance, drawn as the simulator draws
the first RL step's rollout), so a phase lasts until the first row reaches its length. The
policy's k at each phase: 0 (off), K (static:K), or the k of the most tokens a second over the
phase's rows (goodput, knowing the rows' acceptance). Chains only; no KV limit (rows wait for
a batch slot only), no reallocation. The stage's time is the slowest instance's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from rlsched.config import SimConfig
from rlsched.sim.workload import sample_rollout


@dataclass(frozen=True)
class FluidStage:
    seconds: float  # the stage's time: the slowest instance's
    per_instance: np.ndarray  # each instance's busy time
    tokens: int  # response tokens


def expected_tokens_per_row(acceptance: np.ndarray, k_max: int) -> np.ndarray:
    """(rows, k_max + 1): tokens a chain step of k drafts emits in expectation, per row."""
    a = np.clip(acceptance, 0.0, 1.0 - 1e-9)[:, None]
    return (1.0 - a ** (np.arange(k_max + 1) + 1.0)) / (1.0 - a)


class StepPrices:
    """The cost model's verify (k + 1 tokens a row) and drafting (k) seconds for k = 0..k_max
    at b rows, memoised by b and the context a row to within `tolerance` (priced at the first
    context seen in its band): the setups of one tp and drafter meet the same batch sizes and
    contexts again and again."""

    def __init__(self, cost, drafter: str | None, k_max: int, tolerance: float = 0.01):
        self.cost, self.drafter, self.k_max = cost, drafter, k_max
        self._log_band = math.log1p(tolerance)
        self._memo: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}

    def __call__(self, b: int, ctx_sum: float) -> tuple[np.ndarray, np.ndarray]:
        key = (b, round(math.log(max(ctx_sum / b, 1.0)) / self._log_band))
        hit = self._memo.get(key)
        if hit is None:
            ks = np.arange(self.k_max + 1)
            verify = np.asarray(self.cost.verify_time(b, ks + 1, ctx_sum), dtype=float)
            draft = np.zeros(len(ks))
            if self.drafter is not None and self.k_max > 0:
                draft[1:] = self.cost.draft_time(self.drafter, b, ks[1:], ctx_sum)
            hit = self._memo[key] = (verify, draft)
        return hit


def _choose_k(policy: str, tokens: np.ndarray, step_s: np.ndarray) -> int:
    if policy == "off":
        return 0
    if policy.startswith("static:"):
        return int(policy.split(":")[1])
    if policy.startswith("goodput"):
        return int(np.argmax(tokens / step_s))
    raise ValueError(f"the fluid estimate prices off, static:K and goodput, not '{policy}'")


def instance_time(cost, prices: StepPrices, policy: str, prompt_len: np.ndarray, response_len: np.ndarray,
                  acceptance: np.ndarray, *, max_batch: int) -> float:
    """One instance's busy time for these rows (in their admission order): prefills priced by
    `cost`, steps by `prices`."""
    n = len(response_len)
    if n == 0:
        return 0.0
    per_step = expected_tokens_per_row(acceptance, prices.k_max) if prices.drafter is not None else np.ones((n, 1))
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
            t += float(cost.prefill_time(int(p.sum()), int((p * p).sum())))
            running[join] = True
            queued = join[-1] + 1
        rows = np.flatnonzero(running)
        if len(rows) == 0:
            return t
        b, ctx_sum = len(rows), float(ctx[rows].sum())
        verify, draft = prices(b, ctx_sum)
        tokens = per_step[rows].sum(axis=0)
        k = _choose_k(policy, tokens, verify + draft)
        gain = per_step[rows, k]
        steps = float(np.min(left[rows] / gain))  # until the first row reaches its length
        t += steps * float(verify[k] + draft[k])
        left[rows] -= steps * gain
        ctx[rows] += steps * gain
        running[rows[left[rows] <= 1e-6]] = False


def stage_time(cfg: SimConfig, policy: str, cost, seed: int | None = None, prices: StepPrices | None = None
               ) -> FluidStage:
    """The fluid estimate of the first RL step's generation stage of `cfg` under `policy`
    (off, static:K[:DRAFTER], goodput), priced by `cost` (or `prices`, step prices of this
    drafter over `cost` shared with other setups); the rows and their acceptance as the
    simulator draws them for `seed` (default: the config's)."""
    root = np.random.SeedSequence(cfg.seed if seed is None else seed)
    workload_seq, _ = root.spawn(2)  # the simulator's first RL step draws its rollout from the first
    rollout = sample_rollout(cfg.workload, cfg.drafters, {d.name: d.acceptance.mean for d in cfg.drafters},
                             np.random.default_rng(workload_seq))
    parts = policy.split(":")
    drafter = None
    if policy != "off":
        drafter = parts[2] if policy.startswith("static:") and len(parts) > 2 else rollout.drafters[0]
    j = rollout.drafters.index(drafter) if drafter is not None else 0
    k_max = cfg.speculation.k_max if drafter is not None else 0
    if prices is None or prices.drafter != drafter or prices.k_max != k_max:
        prices = StepPrices(cost, drafter, k_max)
    instances = cfg.cluster.instances
    n = rollout.n
    owner = (np.arange(n) if cfg.cluster.assignment == "round_robin" else rollout.prompt_of) % instances
    times = np.zeros(instances)
    for i in range(instances):
        mine = np.flatnonzero(owner == i)
        acc = rollout.acceptance[mine, j] if drafter is not None else np.zeros(len(mine))
        times[i] = instance_time(cost, prices, policy, rollout.prompt_len[mine], rollout.response_len[mine], acc,
                                 max_batch=cfg.cluster.max_batch)
    return FluidStage(float(times.max()), times, int(rollout.response_len.sum()))
