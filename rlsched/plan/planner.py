"""`rlsched plan`: the screen, the search and the explanation of one plan, and its files.

The winner is the search's best setup. It is compared on the same seeds with the best plain
decoding setup (the speedup), the screen's best on each smaller GPU count (the Pareto front of
step time against GPUs) and the workload's own setup (the config as written), and
explained: each knob where the two differ (placement, tp, batch limit, memory fraction,
policy, reallocation, the drafter's update schedule) is moved alone from the workload's setup to the winner's value and
simulated on the same seeds; the knob that gains most is named.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import yaml

from rlsched.atomic import atomic_folder
from rlsched.config import SimConfig
from rlsched.costs.choose import cost_model_for
from rlsched.errors import UserError
from rlsched.plan.feasible import infeasible
from rlsched.plan.output import run_config, verl_rollout, vllm_engine_args
from rlsched.plan.screen import Dropped, Scored, screen
from rlsched.plan.search import Ranked, run_seed, search, signature
from rlsched.plan.space import Candidate, Space, candidates, from_config, to_config
from rlsched.policies.registry import parse_policy
from rlsched.policies.vllm_plan import TABLE_FIELD
from rlsched.sim.sizes import check_fits

KNOBS = ("placement", "tp", "max_batch", "memory", "policy", "realloc", "update_schedule")


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
        "placement": c.placement,
        "tp": f"tp{c.tp}x{c.instances}",
        "max_batch": str(c.max_batch),
        "memory": f"{c.memory:g}" + (" offloaded" if c.offload else ""),
        "policy": c.policy_label,
        "realloc": c.realloc,
        "update_schedule": str(c.update_schedule),
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
    baseline: Ranked | None  # the best plain decoding setup
    own: Ranked | None  # the workload's own setup
    knobs: list[dict] = field(default_factory=list)  # one knob at a time from the own setup to the winner's
    seeds: list[int] = field(default_factory=list)
    simulations: int = 0
    screen_s: float = 0.0
    search_s: float = 0.0

    @property
    def winner(self) -> Ranked:
        return self.ranked[0]


def check_plan_fits(base: SimConfig, space: Space, workers: int, ray_address: str | None) -> None:
    """Refuse a plan this machine's memory cannot hold, before any work: the screen draws each
    setup's rollout and solves the two-state rule over the space's batch limits (and the
    workload's own); the search runs `workers` simulations side by side."""
    most = max(*space.max_batches, base.cluster.max_batch)
    side = workers if ray_address is None else 1
    largest = base.model_copy(update={"cluster": base.cluster.model_copy(update={"max_batch": most})})
    check_fits(largest, grid=True, workers=side, processes=side > 1)


def screened(base: SimConfig, space: Space, objective: str):
    """(scored, dropped): every candidate of `space` screened; one line when none can run."""
    cands = candidates(base, space)
    if not cands:
        raise UserError(
            f"no setup to search: no --tp in {','.join(map(str, space.tps))} divides the rollout GPUs of "
            f"--gpus {space.gpus}; give a --tp of at most the GPUs that divides them (for example --tp 1,2,4)"
        )
    scored, dropped = screen(base, cands, objective)
    if not scored:
        reasons = sorted({d.reason for d in dropped})
        raise UserError(
            f"no setup of {base.model.name} fits on {space.gpus} x {base.hardware.name}: {reasons[0]}"
            + (f" (and {len(reasons) - 1} other reasons)" if len(reasons) > 1 else "")
        )
    return scored, dropped


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
    check_plan_fits(base, space, workers, ray_address)
    t = time.perf_counter()
    scored, dropped = screened(base, space, objective)
    pinned = []
    offs = [s for s in scored if s.candidate.policy.family == "off"]
    if offs:
        pinned.append(offs[0])
    for g in sorted({s.candidate.gpus for s in scored})[:-1]:  # the front: the best on fewer GPUs
        pinned.append(next(s for s in scored if s.candidate.gpus == g))
    own = from_config(base)
    own_scored = None
    if own.gpus <= space.gpus and infeasible(to_config(base, own)) is None:
        own_scored = screen(base, [own], objective)[0][0]
        pinned.append(own_scored)
    screen_s = time.perf_counter() - t
    t = time.perf_counter()
    seed_list = list(range(base.seed, base.seed + seeds))
    result = search(
        scored,
        objective=objective,
        survivors=survivors,
        seeds=seed_list,
        pinned=pinned,
        workers=workers,
        ray_address=ray_address,
        on_done=on_done,
    )
    # the baseline: the best plain decoding setup simulated on every seed (the pinned one at least)
    baseline = next((x for x in result.ranked if x.candidate.policy.family == "off" and len(x.runs) == seeds), None)
    plan = Plan(
        base,
        objective,
        space.gpus,
        len(scored) + len(dropped),
        scored,
        dropped,
        result.ranked,
        baseline,
        result.pinned[pinned.index(own_scored)] if own_scored else None,
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


# ----------------------------------------------------------------------------- the record


def _row(x: Scored | Ranked, objective: str, rank: int | None) -> dict:
    s = x.scored if isinstance(x, Ranked) else x
    c = s.candidate
    row: dict[str, Any] = {
        "rank": rank,
        "setup": c.label,
        "placement": c.placement,
        "gpus": c.gpus,
        "rollout_gpus": c.rollout_gpus,
        "train_gpus": c.train_gpus,
        "tp": c.tp,
        "instances": c.instances,
        "max_batch": c.max_batch,
        "memory": c.memory,
        "offload": c.offload,
        "policy": "table" if c.policy.family == "table" else c.policy.text,
        "drafter": c.drafter,
        "width_max": c.width_max,
        "realloc": c.realloc,
        "update_schedule": c.update_schedule,
        "screen_step_s": s.step_s,
        "screen_generation_s": s.generation_s,
        "step_s": None,
        "generation_s": None,
        "seeds": 0,
        "score": s.score,
        "tokens": s.tokens,
    }
    if isinstance(x, Ranked) and x.runs:
        row.update(
            step_s=x.mean("step_s"),
            generation_s=x.mean("generation_s"),
            seeds=len(x.runs),
            step_s_by_seed={r["seed"]: r["step_s"] for r in x.runs},
            score=x.score(objective),
            tokens=x.mean("tokens"),
            split={k: float(np.mean([r["split"][k] for r in x.runs])) for k in x.runs[0]["split"]},
        )
    return row


def plan_rows(plan: Plan) -> list[dict]:
    """Every feasible candidate: the simulated ones in the search's order, each followed by the
    setups identical to it (batch limits no instance reaches: its numbers, its rank), then the
    rest by the screen."""
    twins: dict = {}
    for s in plan.scored:
        twins.setdefault(signature(s), []).append(s)
    rows, done = [], set()
    for i, x in enumerate(plan.ranked):
        for s in [x.scored] + [t for t in twins.get(signature(x.scored), []) if t.candidate != x.candidate]:
            if s.candidate not in done:
                done.add(s.candidate)
                row = _row(Ranked(s, x.runs), plan.objective, i + 1)
                if s is not x.scored:
                    row["same_as"] = x.candidate.label
                rows.append(row)
    rows += [_row(s, plan.objective, None) for s in plan.scored if s.candidate not in done]
    return rows


def summary(plan: Plan) -> dict:
    """The key numbers: the winner, its step and its split, and the comparisons."""
    w = _row(plan.winner, plan.objective, 1)
    out = {
        "model": plan.base.model.name,
        "hardware": plan.base.hardware.name,
        "gpus": plan.gpus,
        "workload": plan.base.name,
        "objective": plan.objective,
        "candidates": plan.candidates,
        "feasible": len(plan.scored),
        "dropped": len(plan.dropped),
        "simulations": plan.simulations,
        "seeds": len(plan.seeds),
        "screen_s": plan.screen_s,
        "search_s": plan.search_s,
        "winner": w["setup"],
        "winner_step_s": w["step_s"],
        "winner_gpus": w["gpus"],
        "winner_split": w.get("split"),
        "winner_tokens_per_gpu_s": w["tokens"] / (w["step_s"] * w["gpus"]),
    }
    if plan.baseline is not None:
        out.update(
            baseline=plan.baseline.candidate.label,
            baseline_step_s=plan.baseline.mean("step_s"),
            speedup_over_baseline=plan.baseline.mean("step_s") / plan.winner.mean("step_s"),
        )
    if plan.own is not None:
        out.update(
            own_setup=plan.own.candidate.label,
            own_step_s=plan.own.mean("step_s"),
            own_gpus=plan.own.candidate.gpus,
            gain_over_own=plan.own.score(plan.objective) / plan.winner.score(plan.objective) - 1,
        )
    if plan.winner.candidate.width_max > 1:
        out["engine_note"] = (
            "the winner drafts trees; vLLM drafts chains, so vllm_engine.json, run.yaml and "
            "verl_rollout.yaml set its chains (trees need an engine that drafts them: SGLang's "
            "EAGLE, or rlsched's own engine)"
        )
    if plan.knobs:
        top = plan.knobs[0]
        out["knob"] = f"{top['knob']}: {top['from']} -> {top['to']} ({top['gain']:+.1%} alone)"
    return out


def write_plan(plan: Plan, out: Path, model_path: str, drafter_path: str) -> dict:
    """Write the plan's folder (atomically: whole or not at all); returns its summary."""
    from rlsched.analysis.plots import plan_figure, save_figure

    base, win = plan.base, plan.winner
    cfg = to_config(base, win.candidate)
    cost = cost_model_for(cfg)
    engine = vllm_engine_args(cfg, win.candidate, cost, model_path, drafter_path)
    cost_file = Path(base.cost_file) if base.cost_file else None
    if cost_file is not None:  # the plan's copy, where sim.yaml names it
        cfg = cfg.model_copy(update={"cost_file": str((Path(out) / "cost.json").resolve())})
    winner, run_winner = win.candidate, win.candidate
    policy_file = Path(winner.policy.file) if winner.policy.family == "table" and winner.policy.file else None
    vllm_table = None
    if policy_file is not None:
        # sim.yaml names the plan's copy of the learned policy file; run.yaml its draft lengths by batch size in
        # vLLM's own form (the policy file holds the simulated model's and drafter's names)
        winner = replace(winner, policy=parse_policy(f"table:{(Path(out) / 'policy.json').resolve()}"))
        cfg = cfg.model_copy(update={"speculation": cfg.speculation.model_copy(update={"policy": winner.policy})})
        spec = engine.get("speculative_config", {})
        if TABLE_FIELD in spec:
            vllm_table = {TABLE_FIELD: spec[TABLE_FIELD]}
            run_policy = f"table:{(Path(out) / 'vllm_table.json').resolve()}"
        else:
            run_policy = f"static:{spec['num_speculative_tokens']}" if spec else "off"
        run_winner = replace(winner, policy=parse_policy(run_policy))
    rows = plan_rows(plan)
    record: dict[str, Any] = {
        "format": "rlsched-plan",
        "summary": summary(plan),
        "rows": rows,
        "knobs": plan.knobs,
        "dropped": [{"setup": d.candidate.label, "reason": d.reason} for d in plan.dropped],
        "seeds": plan.seeds,
        "baseline": plan.baseline.candidate.label if plan.baseline else None,
        "own": plan.own.candidate.label if plan.own else None,
    }
    with atomic_folder(out) as tmp:
        (tmp / "plan.json").write_text(json.dumps(record, indent=2))
        (tmp / "summary.json").write_text(json.dumps(record["summary"], indent=2))
        flat = [{k: v for k, v in r.items() if k not in ("split", "step_s_by_seed")} for r in rows]
        pd.DataFrame(flat + [{"setup": d["setup"], "dropped": d["reason"]} for d in record["dropped"]]).to_csv(
            tmp / "candidates.csv", index=False
        )
        (tmp / "sim.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
        (tmp / "run.yaml").write_text(
            f"# rlsched run config of the plan's winner ({win.candidate.label}) for {base.model.name}; "
            "model and drafter: your folders\n"
            + yaml.safe_dump(run_config(cfg, run_winner, cost, model_path, drafter_path), sort_keys=False)
        )
        (tmp / "vllm_engine.json").write_text(json.dumps(engine, indent=2))
        (tmp / "verl_rollout.yaml").write_text(
            "# verl rollout settings of the plan's winner (one rollout instance's vLLM engine; the speculative "
            "config passes through engine_kwargs)\n"
            + yaml.safe_dump(verl_rollout(cfg, winner, engine), sort_keys=False)
        )
        save_figure(plan_figure(record), tmp / "pareto.png")
        if cost_file is not None:
            shutil.copyfile(cost_file, tmp / "cost.json")
        if policy_file is not None:
            shutil.copyfile(policy_file, tmp / "policy.json")
        if vllm_table is not None:
            (tmp / "vllm_table.json").write_text(json.dumps(vllm_table, indent=2))
    return record["summary"]
