"""A plan's record and folder: every candidate's row, the summary (the winner, its ties and
comparisons, like with like: `plan/compare.py`), and the files written (`plan/output.py`)."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import yaml

from rlsched.atomic import atomic_folder
from rlsched.costs.choose import cost_model_for
from rlsched.errors import UserError
from rlsched.plan.compare import comparisons
from rlsched.plan.output import default_drafter_path, run_config, verl_rollout, vllm_engine_args
from rlsched.plan.screen import Scored
from rlsched.plan.search import Ranked, signature
from rlsched.plan.space import to_config
from rlsched.policies.engine_args import EAGLE_PLACEHOLDER, engine_files
from rlsched.policies.registry import parse_policy

if TYPE_CHECKING:
    from rlsched.plan.planner import Plan

FORMAT = "rlsched-plan"


def check_plan_out(out: Path) -> None:
    """Refuse an --out that a plan would not be written to whole: a file, or a folder holding
    files that are not an earlier plan's (a plan replaces its folder)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out '{out}' is a file; give a folder (or a new name)")
    if out.is_dir() and any(out.iterdir()) and not (out / "plan.json").is_file():
        raise UserError(
            f"--out '{out}' is a folder holding files that are not an earlier plan's, which writing the plan "
            "would replace; give a new or empty folder"
        )


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
        **comparisons(plan),
    }
    if plan.winner.candidate.width_max > 1:
        out["engine_note"] = (
            "the winner drafts trees; vLLM drafts chains, so run.yaml and the engine's files "
            "(vllm_engine.json, vllm_serve.sh, verl_rollout.yaml, openrlhf_launch.py) run its policy "
            "over chains (trees need an engine that drafts them: SGLang's EAGLE, or rlsched's own engine)"
        )
    if plan.knobs:
        top = plan.knobs[0]
        out["knob"] = f"{top['knob']}: {top['from']} -> {top['to']} ({top['gain']:+.1%} alone)"
    return out


def _policy_files(plan: Plan, out: Path, cfg):
    """(the winner as the files name it, sim.yaml's config, the learned policy file to copy): a
    learned table's winner names the plan's copy of its policy file, in sim.yaml, run.yaml and
    the engine's files alike (rlsched's scheduler runs it in vLLM)."""
    winner = plan.winner.candidate
    if winner.policy.family != "table" or not winner.policy.file:
        return winner, cfg, None
    policy_file = Path(winner.policy.file)
    winner = replace(winner, policy=parse_policy(f"table:{(Path(out) / 'policy.json').resolve()}"))
    cfg = cfg.model_copy(update={"speculation": cfg.speculation.model_copy(update={"policy": winner.policy})})
    return winner, cfg, policy_file


def trace_dir(out: Path) -> Path:
    """Where the plan's engines write their traces: `OUT-traces` beside the plan's folder (an
    engine-core trace folder, which a later plan in OUT leaves alone)."""
    out = Path(out).resolve()
    return out.parent / f"{out.name}-traces"


def _notes(record: dict, base, drafter: str, engine: dict) -> str:
    """The summary's notes on placeholders the files hold; the files' line on the folders."""
    folders = "model and drafter: your folders"
    if drafter == EAGLE_PLACEHOLDER.format(model=base.model.name):
        record["summary"]["drafter_note"] = (
            f"the winner drafts with an EAGLE-3 head: run.yaml and the engine's files (vllm_engine.json, "
            f"vllm_serve.sh, verl_rollout.yaml, openrlhf_launch.py) name it {drafter}, a placeholder: replace it "
            f"with the folder of an EAGLE-3 head for {base.model.name} (or give --drafter-path)"
        )
        folders = f"model: your folder; drafter: {drafter} is a placeholder: replace it with an EAGLE-3 head's folder"
    cost = engine["additional_config"]["rlsched"].get("cost_model", "")
    if cost.startswith("REPLACE-ME/"):
        record["summary"]["cost_note"] = (
            f"the winner's policy prices its steps and hardware {base.hardware.name} is not a preset: the engine's "
            f"files name {cost} as its cost_model, a placeholder: replace it with a `rlsched fit` file of the "
            f"served model's traces on that hardware"
        )
    return folders


def write_plan(
    plan: Plan, out: Path, model_path: str, drafter_path: str | None = None, device: dict | None = None
) -> dict:
    """Write the plan's folder (atomically: whole or not at all); returns its summary.
    `drafter_path` None: `output.default_drafter_path`; `device`: run.yaml's {device, dtype}
    (default: the GPU's, `output.run_device`). The engine's files run the winner's policy in
    rlsched's scheduler inside vLLM, its traces in `trace_dir(out)`."""
    from rlsched.analysis.plots import plan_figure, save_figure

    base, win = plan.base, plan.winner
    cfg = to_config(base, win.candidate)
    cost = cost_model_for(cfg)
    drafter = drafter_path or default_drafter_path(cfg, win.candidate)
    cost_file = Path(base.cost_file) if base.cost_file else None
    if cost_file is not None:  # the plan's copy, where sim.yaml and the engine's files name it
        cfg = cfg.model_copy(update={"cost_file": str((Path(out) / "cost.json").resolve())})
    winner, sim_cfg, policy_file = _policy_files(plan, out, cfg)
    engine = vllm_engine_args(
        cfg,
        win.candidate,
        cost,
        model_path,
        drafter,
        policy=winner.policy.text if policy_file is not None else None,
        trace_dir=str(trace_dir(out)),
        dtype=device["dtype"] if device else None,
    )
    rows = plan_rows(plan)
    record: dict[str, Any] = {
        "format": FORMAT,
        "summary": summary(plan),
        "rows": rows,
        "knobs": plan.knobs,
        "dropped": [{"setup": d.candidate.label, "reason": d.reason} for d in plan.dropped],
        "seeds": plan.seeds,
        "baseline": plan.baseline.candidate.label if plan.baseline else None,
        "own": plan.own.candidate.label if plan.own else None,
    }
    folders = _notes(record, base, drafter, engine)
    run = run_config(sim_cfg, winner, cost, model_path, drafter, device)
    title = f"the plan's winner ({win.candidate.label}) for {base.model.name} in vLLM; {folders}"
    files = engine_files(engine, title=title)
    files["verl_rollout.yaml"] = (
        "# verl rollout settings of the plan's winner (one rollout instance's vLLM engine; rlsched's scheduler "
        f"and the speculative config pass through engine_kwargs.vllm)\n# {folders}\n"
        + yaml.safe_dump(verl_rollout(cfg, winner, engine), sort_keys=False, width=120)
    )
    with atomic_folder(out) as tmp:
        (tmp / "plan.json").write_text(json.dumps(record, indent=2))
        (tmp / "summary.json").write_text(json.dumps(record["summary"], indent=2))
        flat = [{k: v for k, v in r.items() if k not in ("split", "step_s_by_seed")} for r in rows]
        pd.DataFrame(flat + [{"setup": d["setup"], "dropped": d["reason"]} for d in record["dropped"]]).to_csv(
            tmp / "candidates.csv", index=False
        )
        (tmp / "sim.yaml").write_text(yaml.safe_dump(sim_cfg.model_dump(mode="json"), sort_keys=False))
        (tmp / "run.yaml").write_text(
            f"# rlsched run config of the plan's winner ({win.candidate.label}) for {base.model.name}\n"
            f"# {folders}\n" + yaml.safe_dump(run, sort_keys=False)
        )
        for name, text in files.items():
            (tmp / name).write_text(text)
        save_figure(plan_figure(record), tmp / "pareto.png")
        if cost_file is not None:
            shutil.copyfile(cost_file, tmp / "cost.json")
        if policy_file is not None:
            shutil.copyfile(policy_file, tmp / "policy.json")
    return record["summary"]
