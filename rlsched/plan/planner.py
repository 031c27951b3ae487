"""`rlsched plan`: the screen, the search and the explanation of one plan (its record and
files: `plan/record.py`).

The winner is the search's best setup. It is compared on the same seeds with the best plain
decoding setup on its GPU count (the speedup), the screen's best on each smaller GPU count (the
Pareto front of step time against GPUs) and the workload's own setup scaled to its GPU count
(`plan/compare.py`: like with like; the setups the seeds cannot tell from it are its ties),
and explained: each knob where the two differ (placement, tp, batch limit, memory fraction,
policy, reallocation, the drafter's update schedule, vLLM's knobs) is moved alone from the own setup to the
winner's value and simulated on the same seeds; the knob that gains most is named."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from rlsched.config import SimConfig
from rlsched.errors import UserError
from rlsched.plan.compare import own_at
from rlsched.plan.feasible import engine_refusal, infeasible
from rlsched.plan.record import check_plan_out, plan_rows, summary, write_plan  # noqa: F401 (the plan's API)
from rlsched.plan.screen import Dropped, Scored, screen, screen_setups
from rlsched.plan.search import Ranked, run_seed, search
from rlsched.plan.space import Candidate, Space, candidates, to_config
from rlsched.policies.registry import parse_policy
from rlsched.sim.sizes import check_fits

KNOBS = ("placement", "tp", "max_batch", "memory", "policy", "realloc", "update_schedule", "engine")


def base_for_plan(
    cfg: SimConfig | None, from_run: Path | None, workdir: Path | None, overrides: list[str], drafters: str | None
) -> SimConfig:
    """The config a plan starts from: `cfg`, or a run's (its step costs fitted from its traces
    into `workdir`/cost.json, its lengths and acceptance); with only the `drafters` named
    (comma-separated, or none)."""
    if from_run is not None:
        from rlsched.analysis.replay import sim_config_from_run
        from rlsched.config import build_config
        from rlsched.costs.fit import fit_records, read_records

        df, source = read_records(from_run)
        assert workdir is not None  # (given with from_run)
        cost_path = workdir / "cost.json"
        cost_path.write_text(json.dumps(fit_records(df, source).to_json()))
        cfg = build_config(sim_config_from_run(from_run, cost_path, steps=1), overrides, source=f"--from {from_run}")
    assert cfg is not None  # (a config or a run)
    if drafters is not None:
        names = [n.strip() for n in drafters.split(",") if n.strip()]
        have = [d.name for d in cfg.drafters]
        if names == ["none"]:
            names = []
        unknown = [n for n in names if n not in have]
        if unknown:
            raise UserError(
                f"--drafters: {', '.join(unknown)} is not a drafter of {cfg.name} (it has "
                f"{', '.join(have) or 'none'}); give some of those, or none"
            )
        cfg = cfg.model_copy(update={"drafters": [d for d in cfg.drafters if d.name in names]})
    return cfg


def run_device_of(from_run: Path) -> dict:
    """{device, dtype} of a run folder's config (read and checked by `base_for_plan` before)."""
    import yaml

    cfg = yaml.safe_load((Path(from_run) / "config.yaml").read_text()) or {}
    return {"device": str(cfg.get("device", "cpu")), "dtype": str(cfg.get("dtype", "float32"))}


def with_knob(own: Candidate, winner: Candidate, knob: str) -> Candidate | None:
    """`own` with one knob set as the winner has it (None where that knob alone cannot be set:
    its tp does not divide the GPUs, or its policy is a table learned for the winner's setup)."""
    d: dict = {}
    if knob == "placement":
        if own.rollout_gpus == winner.rollout_gpus and own.train_gpus == winner.train_gpus:
            return None
        if winner.rollout_gpus % own.tp:
            return None
        d.update(instances=winner.rollout_gpus // own.tp, train_gpus=winner.train_gpus)
    elif knob == "tp":
        if own.tp == winner.tp or own.rollout_gpus % winner.tp:
            return None
        d.update(tp=winner.tp, instances=own.rollout_gpus // winner.tp)
    elif knob == "memory":
        if (own.memory, own.offload) == (winner.memory, winner.offload):
            return None
        d.update(memory=winner.memory, offload=winner.offload)
    elif knob == "policy":
        if (own.policy, own.drafter, own.width_max) == (winner.policy, winner.drafter, winner.width_max):
            return None
        if winner.policy.family == "table":  # a learned table belongs to the setup it was learned for
            return None
        d.update(policy=winner.policy, drafter=winner.drafter, width_max=winner.width_max)
    else:
        if getattr(own, knob) == getattr(winner, knob):
            return None
        d[knob] = getattr(winner, knob)
    return replace(own, **d)


def knob_value(c: Candidate, knob: str) -> str:
    return {
        "placement": f"{c.placement} on {c.gpus} GPUs",
        "tp": f"tp{c.tp}x{c.instances}",
        "max_batch": str(c.max_batch),
        "memory": f"{c.memory:g}" + (" offloaded" if c.offload else ""),
        "policy": c.policy_label,
        "realloc": c.realloc,
        "update_schedule": str(c.update_schedule),
        "engine": "rlsched" if c.engine is None else c.engine.label,
    }[knob]


@dataclass
class Plan:
    base: SimConfig
    objective: str
    gpus: int
    candidates: int
    scored: list[Scored]
    dropped: list[Dropped]
    ranked: list[Ranked]
    owns: dict[int, Ranked] = field(default_factory=dict)  # the workload's own setup on each GPU count
    own_reasons: dict[int, str] = field(default_factory=dict)  # why it cannot be made on a GPU count
    knobs: list[dict] = field(default_factory=list)  # one knob at a time from the own setup to the winner's
    seeds: list[int] = field(default_factory=list)
    simulations: int = 0
    screen_s: float = 0.0
    search_s: float = 0.0

    @property
    def winner(self) -> Ranked:
        return self.ranked[0]

    @property
    def baseline(self) -> Ranked | None:
        """The best plain decoding setup on the winner's GPUs that ran every seed."""
        return next(
            (
                x
                for x in self.ranked
                if x.candidate.policy.family == "off"
                and x.candidate.gpus == self.winner.candidate.gpus
                and len(x.runs) == len(self.seeds)
            ),
            None,
        )

    @property
    def own(self) -> Ranked | None:
        """The workload's own setup on the winner's GPUs (`compare.own_at`), where it ran every seed."""
        x = self.owns.get(self.winner.candidate.gpus)
        return x if x is not None and len(x.runs) == len(self.seeds) else None


def check_plan_fits(base: SimConfig, space: Space, workers: int, ray_address: str | None) -> None:
    """Refuse a plan this machine's memory cannot hold, before any work: the screen draws each
    setup's rollout and solves the two-state rule over the space's batch limits (and the
    workload's own); the search runs `workers` simulations side by side."""
    most = max(*space.max_batches, base.cluster.max_batch)
    side = workers if ray_address is None else 1
    largest = base.model_copy(update={"cluster": base.cluster.model_copy(update={"max_batch": most})})
    check_fits(largest, grid=True, workers=side, processes=side > 1)


def screened(base: SimConfig, space: Space, objective: str, expand: int = 48):
    """(scored, dropped, the scored to search, candidates): the candidates of `space` screened
    (`screen.screen_setups`: vLLM's knobs at every setting for the best `expand` setups); one
    line when none can run."""
    cands = candidates(base, space)
    if not cands:
        raise UserError(
            f"no setup to search: no --tp in {','.join(map(str, space.tps))} divides the rollout GPUs of "
            f"--gpus {space.gpus}; give a --tp of at most the GPUs that divides them (for example --tp 1,2,4)"
        )
    scored, dropped, pool = screen_setups(base, cands, objective, expand)
    if not scored:
        reasons = sorted({d.reason for d in dropped})
        raise UserError(
            f"no setup of {base.model.name} fits on {space.gpus} x {base.hardware.name}: {reasons[0]}"
            + (f" (and {len(reasons) - 1} other reasons)" if len(reasons) > 1 else "")
        )
    return scored, dropped, pool, len(cands)


def pins(base: SimConfig, scored: list[Scored], objective: str) -> tuple[list[Scored], dict[int, int], dict[int, str]]:
    """(the setups simulated on every seed whatever their rank, {GPU count: the own setup's index
    among them}, {GPU count: why the own setup cannot be made there}): on each GPU count of the
    screened setups, the best plain decoding setup, the workload's own setup scaled to it
    (`compare.own_at`) and, on the smaller ones, the screen's best (the Pareto front)."""
    counts = sorted({s.candidate.gpus for s in scored})
    pinned: list[Scored] = []
    for g in counts:
        offs = [s for s in scored if s.candidate.policy.family == "off" and s.candidate.gpus == g]
        pinned += offs[:1]
    for g in counts[:-1]:
        pinned.append(next(s for s in scored if s.candidate.gpus == g))
    owns, reasons = {}, {}
    for g in counts:
        c, reasons_g = own_at(base, g)
        if c is None:
            reasons[g] = reasons_g or ""
            continue
        owns[g] = len(pinned)
        pinned.append(screen(base, [c], objective)[0][0])
    return pinned, owns, reasons


def make_plan(
    base: SimConfig,
    space: Space,
    *,
    objective: str = "step-time",
    survivors: int = 24,
    seeds: int = 3,
    workers: int = 1,
    ray_address: str | None = None,
    explain: bool = True,
    learn_in: Path | None = None,
    on_done=None,
) -> Plan:
    """Screen every candidate of `space` for `base`, search the best `survivors` over `seeds`
    seeds (from base's), with `learn_in` a folder: learn a table for the best chain setup there
    (`learn_table`), and explain the winner against base's own setup."""
    if seeds < 1:
        raise UserError(f"--seeds must be >= 1 (got {seeds})")
    if survivors < 1:
        raise UserError(f"--survivors must be >= 1 (got {survivors})")
    refusal = engine_refusal(base)
    if refusal is not None:
        raise UserError(f"{refusal}; give the engine knobs vLLM starts with (or leave them out for its defaults)")
    check_plan_fits(base, space, workers, ray_address)
    t = time.perf_counter()
    scored, dropped, pool, n_cands = screened(base, space, objective, 2 * survivors)
    pinned, owns, own_reasons = pins(base, pool, objective)
    screen_s = time.perf_counter() - t
    t = time.perf_counter()
    seed_list = list(range(base.seed, base.seed + seeds))
    result = search(
        pool,
        objective=objective,
        survivors=survivors,
        seeds=seed_list,
        pinned=pinned,
        workers=workers,
        ray_address=ray_address,
        on_done=on_done,
    )
    plan = Plan(
        base,
        objective,
        space.gpus,
        n_cands,
        scored,
        dropped,
        result.ranked,
        {g: result.pinned[i] for g, i in owns.items()},
        own_reasons,
        seeds=seed_list,
        simulations=result.simulations,
        screen_s=screen_s,
    )
    if learn_in is not None:
        learned = learn_table(base, plan, learn_in, workers=workers, ray_address=ray_address)
        if learned is not None:
            plan.ranked = sorted(plan.ranked + [learned], key=lambda x: (-len(x.runs), x.score(objective)))
            plan.simulations += learned.evaluations + len(seed_list)
    if explain and plan.own is not None and plan.own.candidate != plan.winner.candidate:
        plan.knobs = explain_knobs(base, plan, workers=workers, ray_address=ray_address)
        plan.simulations += len(plan.knobs) * seeds
    plan.search_s = time.perf_counter() - t
    return plan


def learn_table(
    base: SimConfig, plan: Plan, folder: Path, *, workers: int = 1, ray_address: str | None = None
) -> Ranked | None:
    """The search's best chain setup with a table policy learned for it (`sim/learn.py`, on the
    seed after the plan's: held out), written to `folder`/policy.json and simulated on the
    plan's seeds; None where no chain setup drafted on every seed."""
    from rlsched.policies.policyfile import save_policy_file
    from rlsched.sim.learn import Learner, parallel_evaluator

    full = [
        x
        for x in plan.ranked
        if len(x.runs) == len(plan.seeds) and x.candidate.drafter is not None and x.candidate.width_max == 1
    ]
    if not full:
        return None
    top = min(full, key=lambda x: x.score(plan.objective))
    held_out = plan.seeds[-1] + 1
    learner = Learner(
        top.scored.config.model_copy(update={"seed": held_out}),
        [held_out],
        parallel_evaluator(workers, ray_address),
        log=lambda m: None,
    )
    pf, _ = learner.learn("table")
    path = Path(folder) / "policy.json"
    save_policy_file(path, pf)
    c = replace(top.candidate, policy=parse_policy(f"table:{path}"))
    learned = Ranked(screen(base, [c], plan.objective)[0][0])
    for seed in plan.seeds:
        run_seed([learned], seed, workers=workers, ray_address=ray_address)
    learned.evaluations = learner.evaluations
    return learned


def explain_knobs(base: SimConfig, plan: Plan, *, workers: int = 1, ray_address: str | None = None) -> list[dict]:
    """Each knob where the own setup and the winner differ, moved alone and simulated on the
    plan's seeds: [{knob, from, to, score, gain}] by gain, largest first (gain: the own
    setup's score over the moved one's, minus 1)."""
    assert plan.own is not None  # (the knobs are moved from the own setup)
    own, win = plan.own.candidate, plan.winner.candidate
    moved = []
    for knob in KNOBS:
        c = with_knob(own, win, knob)
        if c is not None and infeasible(to_config(base, c)) is None:
            moved.append((knob, c))
    if not moved:
        return []
    setups = [Ranked(s) for s in screen(base, [c for _, c in moved], plan.objective)[0]]
    for seed in plan.seeds:
        run_seed(setups, seed, workers=workers, ray_address=ray_address)
    runs = {x.candidate: x for x in setups}
    own_score = plan.own.score(plan.objective)
    out = [
        {
            "knob": k,
            "from": knob_value(own, k),
            "to": knob_value(win, k),
            "score": runs[c].score(plan.objective),
            "gain": own_score / runs[c].score(plan.objective) - 1,
        }
        for k, c in moved
    ]
    return sorted(out, key=lambda r: -r["gain"])
