"""The planner's search: the screen's best setups simulated, with successive halving over seeds.

Round r simulates every setup still in the race on seed r (the workload's rows and acceptance
drawn anew, the engine's draws too), ranks them by their mean score over the seeds they ran,
and keeps the better half for the next round; the last round's setups have run every seed.
Setups the screen cannot tell apart (batch limits above what any instance ever holds) are
simulated once. Pinned setups (the best plain decoding, the workload's own setup) run every
seed whatever their rank, so the winner is compared with them on the same seeds. Simulations
run in worker processes or on a Ray cluster (`sim/runs.run_jobs`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from rlsched.config import SimConfig
from rlsched.plan.screen import Scored, score
from rlsched.plan.space import Candidate
from rlsched.sim.runs import Job, run_jobs


@dataclass
class Ranked:
    scored: Scored
    runs: list[dict] = field(default_factory=list)  # per seed: step_s, generation_s, tokens, time split, seed
    evaluations: int = 0  # simulations spent finding its policy (a learned table's)

    @property
    def candidate(self) -> Candidate:
        return self.scored.candidate

    def mean(self, key: str) -> float:
        return float(np.mean([r[key] for r in self.runs]))

    def score(self, objective: str) -> float:
        return score(objective, self.mean("step_s"), self.candidate.gpus, self.mean("tokens"))


def step_record(summary: dict) -> dict:
    """What the planner keeps of a simulation's summary, per RL step."""
    n = summary["rl_steps"]
    return dict(
        seed=summary["seed"],
        step_s=summary["rl_step_s"] / n,
        generation_s=summary["generation_s"] / n,
        tokens=summary["response_tokens"] / n,
        split=summary["time_split"],
    )


def rows_per_instance(cfg: SimConfig) -> int:
    """The most rows an instance is given at the start of a rollout."""
    w, c = cfg.workload, cfg.cluster
    if c.assignment == "round_robin":
        return math.ceil(w.prompts * w.samples_per_prompt / c.instances)
    return math.ceil(w.prompts / c.instances) * w.samples_per_prompt


def signature(s: Scored) -> Candidate:
    """The candidate with a batch limit no instance reaches cut to what it does reach: rebalance
    sends rows only to an instance below its threshold, and no more than a donor holds."""
    c = s.candidate
    most = rows_per_instance(s.config)
    if c.realloc == "rebalance":
        most += s.config.cluster.realloc_threshold
    elif c.realloc != "none":  # consolidate gathers rows: no bound below all of them
        return c
    return replace(c, max_batch=min(c.max_batch, most))


def run_seed(
    setups: list[Ranked], seed: int, *, workers: int = 1, ray_address: str | None = None, on_done=None
) -> None:
    """Simulate every setup on `seed`; each keeps its record."""
    jobs: list[Job] = [(x.candidate.policy, x.candidate.realloc, seed, None) for x in setups]
    results = run_jobs(
        [x.scored.config for x in setups], jobs, workers=workers, ray_address=ray_address, on_done=on_done
    )
    for x, res in zip(setups, results):
        x.runs.append(step_record(res["summary"]))


@dataclass
class SearchResult:
    ranked: list[Ranked]  # every simulated setup, the pinned too: best first, those out in an earlier round after
    pinned: list[Ranked]  # the pinned setups, in the order given
    simulations: int


def search(
    scored: list[Scored],
    *,
    objective: str = "step-time",
    survivors: int = 24,
    seeds: Sequence[int] = (0, 1, 2),
    pinned: Sequence[Scored] = (),
    workers: int = 1,
    ray_address: str | None = None,
    on_done=None,
) -> SearchResult:
    """Successive halving over `seeds` of the first `survivors` distinct setups of `scored`
    (the screen's order), with `pinned` run on every seed."""
    race: list[Ranked] = []
    seen = set()
    for s in scored:
        sig = signature(s)
        if sig not in seen:
            seen.add(sig)
            race.append(Ranked(s))
        if len(race) == survivors:
            break
    by_signature = {signature(x.scored): x for x in race}
    pins = []  # a setup pinned twice (or also in the race) is one, simulated once a seed
    for p in pinned:
        pins.append(by_signature.setdefault(signature(p), Ranked(p)))
    extra = list({id(p): p for p in pins}.values())
    out: list[Ranked] = []  # dropped in earlier rounds, the latest first
    simulations = 0
    for r, seed in enumerate(seeds):
        runs = race + [p for p in extra if not any(p is x for x in race)]
        run_seed(runs, seed, workers=workers, ray_address=ray_address, on_done=on_done)
        simulations += len(runs)
        race.sort(key=lambda x: x.score(objective))
        if r + 1 < len(seeds):
            keep = max(1, math.ceil(len(race) / 2))
            out = race[keep:] + out
            race = race[:keep]
    ranked = race + out + [p for p in extra if not any(p is x for x in race + out)]
    ranked.sort(key=lambda x: (-len(x.runs), x.score(objective)))  # every seed first; then by the mean
    return SearchResult(ranked, pins, simulations)
