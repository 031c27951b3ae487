"""The commands that search the simulator: plan (the best rollout setup) and learn (a policy file)."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.table import Table

from rlsched.atomic import check_writable, json_text, write_text_atomic
from rlsched.cli.common import (
    ConfigOpt,
    CostOpt,
    JsonOpt,
    PresetOpt,
    SetOpt,
    _int_list,
    _print_unwrapped,
    _with_cost,
    app,
    err_console,
    out_console,
)
from rlsched.distributed import import_ray
from rlsched.errors import UserError

PLAN_HELP = (
    "The best rollout setup for a model, a GPU budget and a workload, searched in the simulator and written out as "
    "configs people run.\n\n"
    "Candidates: placement (colocated on all or half the GPUs, or split with a quarter for training), rollout "
    "instances x tp, batch limit (max_num_seqs), drafter and policy (off, static:K, goodput over chains and, where "
    "the workload drafts trees, trees, the solved twostate, and a table learned for the best chain setup), "
    "reallocation (none, rebalance), the drafter's update schedule; the memory fraction is the largest that fits "
    "beside training, or with training's states offloaded; under the simulator's model of vLLM's engine "
    "(--set engine.kind=vllm) also vLLM's own knobs where they change the result: max_num_batched_tokens, "
    "chunked prefill and the CUDA-graph capture sizes. Setups that cannot run are dropped with the reason. "
    "Every other one is priced by an analytic screen, and the best --survivors are simulated with successive "
    "halving over --seeds seeds. The winner is compared on the same seeds with the best plain decoding setup and "
    "with the workload's own setup, and the knob that moved most is named.\n\n"
    "Writes to --out: plan.json, candidates.csv, summary.json, pareto.png (step time against GPUs), sim.yaml "
    "(rlsched simulate --config), run.yaml (rlsched run --config), vllm_engine.json (vllm.LLM arguments of one "
    "instance, the winner's policy in rlsched's vLLM scheduler), vllm_serve.sh, verl_rollout.yaml and "
    "openrlhf_launch.py; `rlsched report OUT` makes its page.\n\n"
    "Example: rlsched plan --workload respec-qwen2.5-7b --gpus 16 --out runs/plan/qwen7b"
)


_WORKLOAD = typer.Option(
    None,
    "--workload",
    "-w",
    help="A job preset whose workload, drafters "
    "and RL step are planned for (default: 'default'); its own setup is "
    "the comparison.",
)
_FROM = typer.Option(
    None,
    "--from",
    help="Plan from a `rlsched run` folder: its step costs (fitted from its traces), its lengths and acceptance.",
)
_MODEL = typer.Option(None, "--model", help="A model preset (see `rlsched presets`; default: the workload's).")
_HARDWARE = typer.Option(None, "--hardware", help="A hardware preset (default: the workload's).")
_GPUS = typer.Option(None, "--gpus", help="The GPU budget (default: the workload's).")
_DRAFTERS = typer.Option(
    None, "--drafters", help="Comma-separated drafters of the workload to consider, or none (default: all)."
)
_OBJECTIVE = typer.Option(
    "step-time",
    "--objective",
    help="step-time (the fastest RL step) or tokens-per-gpu-s (the most response tokens a GPU-second).",
)
_TPS = typer.Option(None, "--tp", help="Comma-separated tensor-parallel sizes (default 1,2,4,8).")
_MAX_BATCHES = typer.Option(None, "--max-batch", help="Comma-separated batch limits (default 64,256,1024).")
_PLAN_SEEDS = typer.Option(3, "--seeds", help="Seeds of the successive halving (rounds).")
_SURVIVORS = typer.Option(24, "--survivors", help="Setups the screen hands to the simulator.")
_EXPLAIN = typer.Option(
    True,
    "--explain/--no-explain",
    help="Simulate each knob where the workload's own "
    "setup and the winner differ, moved alone, and name the one that moved most.",
)
_LEARN = typer.Option(
    True,
    "--learn/--no-learn",
    help="Learn a table policy in the simulator for the "
    "best chain setup (on a held-out seed) and rank it with the others.",
)
_PLAN_WORKERS = typer.Option(None, "--workers", "-j", help="Worker processes (default: the number of CPUs).")
_PLAN_RAY = typer.Option(None, "--ray", help="Simulate on a Ray cluster at this address, as compare does.")
_MODEL_PATH = typer.Option(
    None,
    "--model-path",
    help="The actor's folder (or HF id) written into run.yaml and vllm_engine.json (default: the model's name).",
)
_DRAFTER_PATH = typer.Option(
    None, "--drafter-path", help="The drafter's folder written there (default: the drafter's name)."
)
_PLAN_OUT = typer.Option(None, "--out", "-o", help="Output folder (default runs/plan/NAME-NgNAME).")


@app.command(help=PLAN_HELP)
def plan(
    workload: str | None = _WORKLOAD,
    config: Path | None = ConfigOpt,
    from_run: Path | None = _FROM,
    model: str | None = _MODEL,
    hardware: str | None = _HARDWARE,
    gpus: int | None = _GPUS,
    drafters: str | None = _DRAFTERS,
    objective: str = _OBJECTIVE,
    tps: str | None = _TPS,
    max_batches: str | None = _MAX_BATCHES,
    seeds: int = _PLAN_SEEDS,
    survivors: int = _SURVIVORS,
    explain: bool = _EXPLAIN,
    learn: bool = _LEARN,
    workers: int | None = _PLAN_WORKERS,
    ray: str | None = _PLAN_RAY,
    model_path: str | None = _MODEL_PATH,
    drafter_path: str | None = _DRAFTER_PATH,
    out: Path | None = _PLAN_OUT,
    set_: list[str] = SetOpt,
    as_json: bool = JsonOpt,
):
    import tempfile

    from rlsched.config import load_config
    from rlsched.plan.planner import base_for_plan, check_plan_out, make_plan, run_device_of, write_plan
    from rlsched.sim.runs import default_workers

    _check_plan_options(gpus, objective, workers, from_run is not None and bool(workload or config), ray)
    if drafter_path == "eagle" and model_path != "builtin":
        raise UserError(
            "--drafter-path eagle is the built-in actor's EAGLE-3 head; with another --model-path give the folder "
            "of an EAGLE-3 head for that model (or leave --drafter-path out for a marked placeholder)"
        )
    if out is not None:  # before a run folder is fitted (the default place needs the workload's name)
        check_plan_out(out)
        check_writable(out, "--out")
    overrides = [f"model={model}"] * (model is not None) + [f"hardware={hardware}"] * (hardware is not None)
    overrides += list(set_) + ["record_timeline=false"]
    with tempfile.TemporaryDirectory() as work:
        if from_run is not None:
            base = base_for_plan(None, from_run, Path(work), overrides, drafters)
        else:
            base = base_for_plan(load_config(workload, config, overrides), None, None, [], drafters)
        budget, space = _plan_space(base, gpus, from_run is not None, tps, max_batches)
        out = out or Path("runs/plan") / f"{base.name}-{budget}g{base.hardware.name}"
        check_plan_out(out)
        check_writable(out, "--out")
        done = [0]

        with err_console.status(f"planning {base.model.name} on {budget} x {base.hardware.name}") as status:

            def tick(_):
                done[0] += 1
                status.update(f"planning {base.model.name} on {budget} x {base.hardware.name}: {done[0]} simulations")

            result = make_plan(
                base,
                space,
                objective=objective,
                survivors=survivors,
                seeds=seeds,
                workers=workers or default_workers(),
                ray_address=ray,
                explain=explain,
                learn_in=Path(work) if learn else None,
                on_done=tick,
            )
            device = run_device_of(from_run) if from_run is not None else None
            summary = write_plan(result, out, model_path or base.model.name, drafter_path, device)
    summary["out"] = str(out)
    if as_json:
        print(json_text(summary))
        return
    _print_plan(result, summary, f"{base.model.name} on {budget} x {base.hardware.name}, {base.name}", objective, out)


def _check_plan_options(gpus: int | None, objective: str, workers: int | None, from_and_workload: bool, ray) -> None:
    from rlsched.plan.screen import OBJECTIVES

    if gpus is not None and gpus < 1:
        raise UserError(f"--gpus must be >= 1 (got {gpus}); give the GPUs the job may use")
    if objective not in OBJECTIVES:
        raise UserError(f"--objective must be one of {', '.join(OBJECTIVES)} (got '{objective}')")
    if workers is not None and workers < 1:
        raise UserError(f"--workers must be >= 1 (got {workers})")
    if from_and_workload:
        raise UserError("--from plans from a run's own workload; drop --workload and --config")
    if ray is not None:
        if not ray.strip():
            raise UserError("--ray needs an address (host:port) or 'auto'")
        import_ray("--ray")


def _plan_space(base, gpus: int | None, from_run: bool, tps: str | None, max_batches: str | None):
    """(the GPU budget, the space of setups) for the options."""
    from dataclasses import replace

    from rlsched.plan.space import Space

    budget = gpus if gpus is not None else base.cluster.instances * base.cluster.tp + (base.rl.train_gpus or 0)
    space = Space(budget)
    if from_run:  # the run's machine: its fitted costs are of one device, tp 1
        space = Space(budget, tps=(1,), colocated=(1.0,), split=())
    if tps is not None:
        space = replace(space, tps=tuple(_int_list(tps, "--tp")))
    if max_batches is not None:
        space = replace(space, max_batches=tuple(_int_list(max_batches, "--max-batch")))
    return budget, space


def _print_plan(result, summary: dict, title: str, objective: str, out: Path) -> None:
    """The plan's ten best setups as a table, then the winner and what it gains."""
    from rlsched.plan.planner import plan_rows

    t = Table(
        title=f"rlsched plan: {title} "
        f"({summary['candidates']} setups, {summary['dropped']} cannot run, {summary['simulations']} "
        f"simulations; {objective})"
    )
    for col, just in (
        ("#", "right"),
        ("setup", "left"),
        ("GPUs", "right"),
        ("step s (sim)", "right"),
        ("screen s", "right"),
        ("seeds", "right"),
        ("generation", "right"),
    ):
        t.add_column(col, justify=just)
    for r in [r for r in plan_rows(result) if r["step_s"] is not None][:10]:
        t.add_row(
            str(r["rank"]),
            r["setup"],
            str(r["gpus"]),
            f"{r['step_s']:.2f}",
            f"{r['screen_step_s']:.2f}",
            str(r["seeds"]),
            f"{r['split']['generation']:.0%}",
        )
    _print_unwrapped(out_console, t)
    split = " / ".join(f"{k.replace('_', ' ')} {v:.0%}" for k, v in summary["winner_split"].items())
    lines = [f"winner: {summary['winner']}, {summary['winner_step_s']:.2f} s a step ({split})"]
    lines += _plan_comparisons(summary)
    for note in ("engine_note", "drafter_note", "cost_note"):
        if note in summary:
            lines.append(f"note: {summary[note]}")
    lines.append(f"output: {out} (rlsched report {out} for its page)")
    for line in lines:
        out_console.print(line, highlight=False, soft_wrap=True)


def _plan_comparisons(summary: dict) -> list[str]:
    """The winner's ties and comparisons as lines, each on the winner's GPU count or saying why not."""
    lines = []
    ties = summary["ties"]
    if ties:
        shown = ", ".join(f"{t['setup']} ({t['gap']:+.1%})" for t in ties[:3])
        more = f" and {len(ties) - 3} more" if len(ties) > 3 else ""
        lines.append(
            f"a tie: over {summary['seeds']} seeds the winner is not told apart from {shown}{more} "
            "(as good on a seed, or a gap within the seeds' spread)"
        )
    tie = " (a tie within the seeds' spread)"
    if "baseline" in summary:
        lines.append(
            f"over the best plain decoding on {summary['baseline_gpus']} GPUs ({summary['baseline']}): "
            f"{summary['speedup_over_baseline']:.2f}x" + (tie if summary["baseline_tie"] else "")
        )
    else:
        lines.append(f"note: {summary['baseline_note']}")
    if "own_setup" in summary:
        lines.append(
            f"over the workload's own setup on {summary['own_gpus']} GPUs ({summary['own_setup']}, "
            f"{summary['own_step_s']:.2f} s): {summary['gain_over_own']:+.1%}"
            + (tie if summary["own_tie"] else "")
            + (f"; the knob that moved most: {summary['knob']}" if "knob" in summary else "")
        )
    if "own_note" in summary:
        lines.append(f"note: {summary['own_note']}")
    return lines


_LEARN_OUT = typer.Option(..., "--out", "-o", help="Where to write the policy file (JSON).")
_KIND = typer.Option(
    "table",
    "--kind",
    help="table (batch x context x acceptance buckets -> k) or twostate "
    "(ReSpec: off above a batch threshold, one k below).",
)
_LEARN_SEEDS = typer.Option(1, "--seeds", help="Learning seeds (every candidate is scored on each).")
_VLLM_TABLE = typer.Option(
    None,
    "--vllm-table",
    help="Also write the learned draft length by batch size as vLLM's num_speculative_tokens_per_batch_size (JSON).",
)
_LEARN_WORKERS = typer.Option(
    None, "--workers", "-j", help="Worker processes (default: the number of CPUs); 1 runs serially in this process."
)
_LEARN_MODEL_PATH = typer.Option(
    None, "--model-path", help="The target's folder (or HF id) in the framework files (default: the model's name)."
)
_LEARN_DRAFTER_PATH = typer.Option(
    None,
    "--drafter-path",
    help="The drafter's folder in the framework files (default: a draft model's name; a marked placeholder for "
    "an EAGLE-3 head).",
)
_LEARN_TRACE_DIR = typer.Option(
    None,
    "--trace-dir",
    help="Where the engines running the policy write their traces, as the framework files say "
    "(default: STEM-traces in OUT's folder).",
)
_LEARN_RAY = typer.Option(
    None,
    "--ray",
    help="Score candidates on a Ray cluster at this address "
    "('auto': the running local cluster; 'local': start a private one).",
)


@app.command()
def learn(
    preset: str | None = PresetOpt,
    config: Path | None = ConfigOpt,
    set_: list[str] = SetOpt,
    out: Path = _LEARN_OUT,
    kind: str = _KIND,
    seeds: int = _LEARN_SEEDS,
    vllm_table: Path | None = _VLLM_TABLE,
    workers: int | None = _LEARN_WORKERS,
    ray: str | None = _LEARN_RAY,
    cost: Path | None = CostOpt,
    model_path: str | None = _LEARN_MODEL_PATH,
    drafter_path: str | None = _LEARN_DRAFTER_PATH,
    trace_dir: Path | None = _LEARN_TRACE_DIR,
    as_json: bool = JsonOpt,
):
    """Learn a drafting policy (and reallocation threshold) in the simulator; write a policy file.

    Scores the uniform tables (every static setting, off included) and the cost model's analytic
    table on the learning seeds, refines the faster one by coordinate descent over its cells (a
    change kept only if it cuts the stage time by 0.25%), and keeps a table of several settings
    only if it beats the best uniform one by 1% on every learning seed and on two validation
    seeds; or a grid over the two-state threshold and k; then a sweep of cluster.realloc_threshold when the config
    reallocates. Use the file with `--policy table:FILE` (or twostate) in simulate, compare and
    the executor. Beside OUT, for a chain policy, the files that run it inside vLLM's scheduler:
    STEM.vllm_engine.json (vllm.LLM's arguments), STEM.vllm_serve.sh, STEM.verl_rollout.yaml
    (verl's actor_rollout_ref.rollout) and STEM.openrlhf_launch.py (OpenRLHF's trainer).
    """
    from rlsched.config import load_config
    from rlsched.policies.policyfile import save_policy_file
    from rlsched.sim.learn import Learner, parallel_evaluator
    from rlsched.sim.learn import vllm_table as to_vllm
    from rlsched.sim.runs import default_workers

    _check_learn_options(kind, seeds, workers, out, vllm_table, ray)
    cfg = _with_cost(load_config(preset, config, list(set_)), cost)
    if not cfg.drafters:
        raise UserError("learn needs at least one drafter in the config (drafters: [...])")
    if vllm_table is not None and cfg.speculation.width_max > 1:
        raise UserError(
            "--vllm-table: vLLM's table holds chain lengths, and this config lets the policy draft trees "
            "(speculation.width_max > 1); add --set speculation.width_max=1"
        )
    facts = _framework_facts(cfg, model_path, drafter_path)
    learner = Learner(
        cfg,
        list(range(cfg.seed, cfg.seed + seeds)),
        parallel_evaluator(workers or default_workers(), ray),
        log=lambda m: err_console.print(m, highlight=False),
    )
    pf, score = learner.learn(kind)
    save_policy_file(out, pf)
    summary = {
        "policy_file": str(out),
        "kind": kind,
        "params": pf.params,
        "realloc": pf.realloc.model_dump(),
        "generation_s": score,
        "evaluations": learner.evaluations,
        "seeds": learner.seeds,
    }
    if vllm_table is not None:
        table = to_vllm(pf, cfg.cluster.max_batch, cfg.drafters[0].acceptance.mean, learner.ctx.typical_ctx)
        write_text_atomic(vllm_table, json_text(table) + "\n")
        summary["vllm_table"] = str(vllm_table)
        summary["num_speculative_tokens_per_batch_size"] = table["num_speculative_tokens_per_batch_size"]
    summary.update(_write_frameworks(facts, kind, out, trace_dir))
    if as_json:
        print(json_text(summary))
        return
    _print_learned(summary, vllm_table)


def _print_learned(summary: dict, vllm_table: Path | None) -> None:
    out_console.print(f"learned {summary['kind']} policy: {json.dumps(summary['params'])}", highlight=False)
    out_console.print(
        f"realloc: {summary['realloc']['policy']} threshold {summary['realloc']['threshold']}; "
        f"{summary['evaluations']} simulations; mean generation stage {summary['generation_s']:.2f} s",
        highlight=False,
    )
    out = summary["policy_file"]
    out_console.print(f"policy file: {out}" + (f"\nvLLM table: {vllm_table}" if vllm_table else ""), highlight=False)
    if "frameworks" in summary:
        files = ", ".join(summary["frameworks"])
        out_console.print(f"vLLM, verl and OpenRLHF: {files}", highlight=False, soft_wrap=True)
    else:
        out_console.print(f"note: {summary['frameworks_note']}", highlight=False, soft_wrap=True)


def _write_frameworks(facts, kind: str, out: Path, trace_dir: Path | None) -> dict:
    """The framework files beside the policy file (`sim.learn.framework_snippets`), as summary fields."""
    from rlsched.sim.learn import default_trace_dir, framework_snippets

    if facts is None:
        return {
            "frameworks_note": "no vLLM, verl or OpenRLHF files: the policy may draft trees and vLLM drafts "
            "chains (learn with --set speculation.width_max=1 for them)"
        }
    snippets = framework_snippets(facts, kind, out, trace_dir or default_trace_dir(out))
    for path, text in snippets.items():
        write_text_atomic(path, text)
    return {"frameworks": [str(p) for p in snippets]}


def _framework_facts(cfg, model_path: str | None, drafter_path: str | None):
    """The engine the learned policy runs in, its files checked before learning; None where the
    config lets the policy draft trees (vLLM drafts chains)."""
    from rlsched.policies.engine_args import HookSettings, vllm_engine_kwargs
    from rlsched.sim.learn import engine_facts

    if cfg.speculation.width_max > 1:
        return None
    facts = engine_facts(cfg, model_path, drafter_path)
    vllm_engine_kwargs(facts, HookSettings("off"))  # UserError for a field the files cannot hold
    return facts


def _check_learn_options(kind: str, seeds: int, workers: int | None, out: Path, vllm_table: Path | None, ray) -> None:
    if kind not in ("table", "twostate"):
        raise UserError(f"--kind '{kind}' is not one of table, twostate")
    if seeds < 1:
        raise UserError(f"--seeds must be >= 1 (got {seeds})")
    if workers is not None and workers < 1:
        raise UserError(f"--workers must be >= 1 (got {workers})")
    for path, opt in ((out, "--out"), (vllm_table, "--vllm-table")):
        if path is not None and path.suffix != ".json":
            raise UserError(f"{opt} '{path}' must end in .json")
        if path is not None:
            check_writable(path, opt, folder=False)
    engine = out.with_name(f"{out.stem}.vllm_engine.json")
    if vllm_table is not None and vllm_table.resolve() == engine.resolve():
        raise UserError(f"--vllm-table '{vllm_table}' is where learn writes vLLM's engine arguments; name another file")
    if ray is not None:
        import_ray("--ray")
