"""The simulator's commands: presets, simulate, compare, plan and learn."""

from __future__ import annotations

import json
import re
from pathlib import Path

import typer
from rich.table import Table

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
from rlsched.policies.registry import usage as policy_usage


@app.command()
def presets(
    show: str | None = typer.Option(None, "--show", help="Print the full, resolved config of a job preset."),
    kind: str = typer.Option("jobs", "--kind", help="jobs, hardware or models."),
):
    """List the shipped presets (one line each), or print one in full."""
    from rlsched.config import load_config, load_preset_data, preset_names

    if kind not in ("jobs", "hardware", "models"):
        raise UserError(f"--kind '{kind}' is not one of jobs, hardware, models")
    if show:
        if kind == "jobs":
            cfg = load_config(preset=show)
            data = cfg.model_dump(mode="json")
        else:
            try:
                data = load_preset_data(kind, show)
            except ValueError as e:
                raise UserError(f"--show: {e}") from None
        import yaml

        print(yaml.safe_dump(data, sort_keys=False), end="")
        return
    names = preset_names(kind)
    width = max(len(n) for n in names)
    for name in names:  # one plain line each, easy to grep
        print(f"{name:<{width}}  {load_preset_data(kind, name).get('description', '')}")


def _default_out(name: str, policy: str, seed: int) -> Path:
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{name}-{policy}-seed{seed}")
    return Path("runs") / "simulate" / slug


@app.command()
def simulate(
    preset: str | None = PresetOpt,
    config: Path | None = ConfigOpt,
    policy: str | None = typer.Option(
        None,
        "--policy",
        help=f"Drafting policy: {policy_usage('simulator')} (default: the config's speculation.policy).",
    ),
    realloc: str | None = typer.Option(
        None,
        "--realloc",
        help="Reallocation policy: none, rebalance, consolidate (default: the config's cluster.realloc).",
    ),
    out: Path | None = typer.Option(
        None, "--out", "-o", help="Output folder (default runs/simulate/NAME-POLICY-seedN)."
    ),
    seed: int | None = typer.Option(None, "--seed", help="Random seed (overrides the config's seed)."),
    baseline: bool = typer.Option(
        True, "--baseline/--no-baseline", help="Also simulate `off` on the same seed to report the speedup."
    ),
    set_: list[str] = SetOpt,
    cost: Path | None = CostOpt,
    as_json: bool = JsonOpt,
):
    """Simulate the generation stage (and the RL steps around it) of a config or preset.

    Writes timeline.parquet (one row per engine step), samples.parquet, rl_steps.parquet,
    summary.json and the resolved config.yaml to the output folder.
    """
    from rlsched.config import load_config
    from rlsched.policies.realloc import make_realloc_policy
    from rlsched.policies.registry import make_draft_policy, parse_policy
    from rlsched.sim.output import run_and_write
    from rlsched.sim.simulate import policy_context

    overrides = list(set_) + ([f"seed={seed}"] if seed is not None else [])
    if seed is not None and seed < 0:
        raise UserError(f"--seed must be >= 0 (got {seed})")
    cfg = _with_cost(load_config(preset, config, overrides), cost)
    pol = parse_policy(policy) if policy else cfg.speculation.policy
    make_draft_policy(pol, policy_context(cfg, true_acceptance=lambda d, ids: None))
    make_realloc_policy(realloc or cfg.cluster.realloc)
    out = out or _default_out(cfg.name, pol.text, cfg.seed)
    summary = run_and_write(cfg, pol, realloc, out, baseline, err_console)
    if as_json:
        print(json.dumps(summary, indent=2))
    else:
        _print_summary(summary)


def _print_summary(s: dict) -> None:
    t = Table(title=f"rlsched simulate: {s['name']}  policy={s['policy']}  realloc={s['realloc']}  seed={s['seed']}")
    t.add_column("metric", style="bold")
    t.add_column("value", justify="right")
    add = t.add_row
    add("RL steps x samples", f"{s['rl_steps']} x {s['samples_per_step']} on {s['instances']} instance(s)")
    add("generation stage (s)", f"{s['generation_s']:.2f}")
    if "speedup_vs_off" in s:
        add("speedup vs off (same seed)", f"{s['speedup_vs_off']:.3f}x")
    add("tokens/s (generation)", f"{s['tokens_per_s']:,.0f}")
    add("mean accepted length (SD steps)", f"{s.get('mean_accept_len', float('nan')):.2f}")
    add("SD step fraction", f"{s.get('sd_step_fraction', 0):.2f}")
    idle = s["idle_fraction"]
    add("idle fraction (mean / max instance)", f"{sum(idle) / len(idle):.3f} / {max(idle):.3f}")
    split = s["time_split"]
    add("RL step time (s)", f"{s['rl_step_s']:.2f}")
    add(
        "time split gen/infer/train/draft-upd",
        " / ".join(f"{split[k]:.0%}" for k in ("generation", "inference", "training", "drafter_update")),
    )
    add("engine steps", f"{s['engine_steps']:,}")
    add("preemptions / migrated sequences", f"{s['preemptions']} / {s['migrations']}")
    add("output", s.get("out", ""))
    out_console.print(t)


COMPARE_HELP = (
    "Simulate several policies side by side on the same seeds and print one table.\n\n"
    "Every (policy, realloc, seed) combination is simulated. Ratios are formed per seed, then averaged: "
    "'x off' is off's generation-stage time / the policy's (same seed and realloc); 'x best static' is the "
    "fastest static:K policy's time on that seed (chosen after the fact among the static:K policies listed) "
    "/ the policy's. Above 1 is faster. `off` is added as the baseline when it is not listed.\n\n"
    "Runs go to --workers processes (default: one per CPU); --workers 1 runs them one after the other in this "
    "process; --ray sends them to a Ray cluster. The numbers are the same either way.\n\n"
    "Example: rlsched compare -p longtail-grpo --policies off,static:2,static:4,goodput --seeds 3 "
    "--plot compare.png --out runs/compare/longtail"
)


@app.command(help=COMPARE_HELP)
def compare(
    preset: str | None = PresetOpt,
    config: Path | None = ConfigOpt,
    set_: list[str] = SetOpt,
    policies: str = typer.Option(
        "off,static:2,static:4,goodput",
        "--policies",
        "-P",
        help="Comma-separated drafting policies, e.g. off,static:2,static:4,goodput "
        "(any name `simulate --policy` takes; only commas separate names).",
    ),
    realloc: str | None = typer.Option(
        None,
        "--realloc",
        help="Comma-separated reallocation policies, e.g. none,rebalance (default: the config's cluster.realloc).",
    ),
    seeds: int = typer.Option(3, "--seeds", help="Number of seeds; every policy runs on each."),
    first_seed: int | None = typer.Option(
        None, "--first-seed", help="First seed (default: the config's seed); seeds are FIRST..FIRST+N-1."
    ),
    plot: Path | None = typer.Option(
        None,
        "--plot",
        help="Write a figure (.png or .pdf): speedup over off per "
        "policy, and batch size and k over time for the adaptive policies.",
    ),
    out: Path | None = typer.Option(
        None,
        "--out",
        "-o",
        help="Write compare.json (every run's summary and the "
        "aggregate) and compare.parquet (one row per run) to this folder.",
    ),
    workers: int | None = typer.Option(
        None, "--workers", "-j", help="Worker processes (default: the number of CPUs); 1 runs serially in this process."
    ),
    ray: str | None = typer.Option(
        None,
        "--ray",
        help="Run on a Ray cluster at this address ('auto': the running "
        "local cluster; 'local': start a private one); needs pip install "
        "'rlsched\\[distributed]' on this machine and the same rlsched on "
        "every node; --workers is then ignored.",
    ),
    cost: Path | None = CostOpt,
    as_json: bool = JsonOpt,
):
    from rlsched.config import load_config
    from rlsched.sim import compare as cmp
    from rlsched.sim.runs import default_workers, run_jobs

    if workers is not None and workers < 1:
        raise UserError(f"--workers must be >= 1 (got {workers})")
    if seeds < 1:
        raise UserError(f"--seeds must be >= 1 (got {seeds})")
    cmp.check_out_path(out, plot)
    if ray is not None:
        if not ray.strip():
            raise UserError("--ray needs an address (host:port) or 'auto'")
        import_ray("--ray")
    cfg = _with_cost(load_config(preset, config, list(set_)), cost)
    plan = cmp.make_plan(cfg, policies, realloc, seeds, first_seed, trace_instance=0 if plot else None)
    jobs = plan.jobs()
    n_workers = workers or default_workers()

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    where = (
        f"Ray at {ray}"
        if ray is not None
        else ("1 process" if n_workers == 1 or len(jobs) == 1 else f"{min(n_workers, len(jobs))} processes")
    )
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("runs"),
        TimeElapsedColumn(),
        console=err_console,
        transient=True,
        disable=not err_console.is_terminal,
    ) as bar:  # a pipe would get a stray blank line
        task = bar.add_task(
            f"comparing {len(plan.policies)} policies x {len(plan.reallocs)} realloc x "
            f"{len(plan.seeds)} seeds on {where}",
            total=len(jobs),
        )
        results = run_jobs(cfg, jobs, n_workers, ray, on_done=lambda r: bar.advance(task))
    report = cmp.aggregate(cfg, plan, results)
    if out is not None:
        cmp.write_report(report, out)
    if plot is not None:
        from rlsched.analysis.plots import plot_compare

        plot_compare(report, cmp.traces_for_plot(plan, results), plot)
    table = cmp.rich_table(report)
    if as_json:
        _print_unwrapped(err_console, table)
        print(json.dumps(report, indent=2))
    else:
        _print_unwrapped(out_console, table)
        for label, path in (("output", out), ("plot", plot)):
            if path is not None:
                out_console.print(f"{label}: {path}", highlight=False)


PLAN_HELP = (
    "The best rollout setup for a model, a GPU budget and a workload, searched in the simulator and written out as "
    "configs people run.\n\n"
    "Candidates: placement (colocated on all or half the GPUs, or split with a quarter for training), rollout "
    "instances x tp, batch limit (max_num_seqs), drafter and policy (off, static:K, goodput over chains and, where "
    "the workload drafts trees, trees, the solved twostate, and a table learned for the best chain setup), "
    "reallocation (none, rebalance), the drafter's update schedule; the memory fraction is the largest that fits "
    "beside training, or with training's states offloaded. Setups that cannot run are dropped with the reason. "
    "Every other one is priced by an analytic screen, and the best --survivors are simulated with successive "
    "halving over --seeds seeds. The winner is compared on the same seeds with the best plain decoding setup and "
    "with the workload's own setup, and the knob that moved most is named.\n\n"
    "Writes to --out: plan.json, candidates.csv, summary.json, pareto.png (step time against GPUs), sim.yaml "
    "(rlsched simulate --config), run.yaml (rlsched run --config), vllm_engine.json (vllm.LLM arguments of one "
    "instance) and verl_rollout.yaml; `rlsched report OUT` makes its page.\n\n"
    "Example: rlsched plan --workload respec-qwen2.5-7b --gpus 16 --out runs/plan/qwen7b"
)


@app.command(help=PLAN_HELP)
def plan(
    workload: str | None = typer.Option(
        None,
        "--workload",
        "-w",
        help="A job preset whose workload, drafters "
        "and RL step are planned for (default: 'default'); its own setup is "
        "the comparison.",
    ),
    config: Path | None = ConfigOpt,
    from_run: Path | None = typer.Option(
        None,
        "--from",
        help="Plan from a `rlsched run` folder: its step costs (fitted from its traces), its lengths and acceptance.",
    ),
    model: str | None = typer.Option(
        None, "--model", help="A model preset (see `rlsched presets`; default: the workload's)."
    ),
    hardware: str | None = typer.Option(None, "--hardware", help="A hardware preset (default: the workload's)."),
    gpus: int | None = typer.Option(None, "--gpus", help="The GPU budget (default: the workload's)."),
    drafters: str | None = typer.Option(
        None, "--drafters", help="Comma-separated drafters of the workload to consider, or none (default: all)."
    ),
    objective: str = typer.Option(
        "step-time",
        "--objective",
        help="step-time (the fastest RL step) or tokens-per-gpu-s (the most response tokens a GPU-second).",
    ),
    tps: str | None = typer.Option(None, "--tp", help="Comma-separated tensor-parallel sizes (default 1,2,4,8)."),
    max_batches: str | None = typer.Option(
        None, "--max-batch", help="Comma-separated batch limits (default 64,256,1024)."
    ),
    seeds: int = typer.Option(3, "--seeds", help="Seeds of the successive halving (rounds)."),
    survivors: int = typer.Option(24, "--survivors", help="Setups the screen hands to the simulator."),
    explain: bool = typer.Option(
        True,
        "--explain/--no-explain",
        help="Simulate each knob where the workload's own "
        "setup and the winner differ, moved alone, and name the one that moved most.",
    ),
    learn: bool = typer.Option(
        True,
        "--learn/--no-learn",
        help="Learn a table policy in the simulator for the "
        "best chain setup (on a held-out seed) and rank it with the others.",
    ),
    workers: int | None = typer.Option(None, "--workers", "-j", help="Worker processes (default: the number of CPUs)."),
    ray: str | None = typer.Option(None, "--ray", help="Simulate on a Ray cluster at this address, as compare does."),
    model_path: str | None = typer.Option(
        None,
        "--model-path",
        help="The actor's folder (or HF id) written into run.yaml and vllm_engine.json (default: the model's name).",
    ),
    drafter_path: str | None = typer.Option(
        None, "--drafter-path", help="The drafter's folder written there (default: the drafter's name)."
    ),
    out: Path | None = typer.Option(None, "--out", "-o", help="Output folder (default runs/plan/NAME-NgNAME)."),
    set_: list[str] = SetOpt,
    as_json: bool = JsonOpt,
):
    import tempfile
    from dataclasses import replace

    from rlsched.config import load_config
    from rlsched.plan.planner import base_for_plan, make_plan, plan_rows, write_plan
    from rlsched.plan.screen import OBJECTIVES
    from rlsched.plan.space import Space
    from rlsched.sim.runs import default_workers

    if gpus is not None and gpus < 1:
        raise UserError(f"--gpus must be >= 1 (got {gpus}); give the GPUs the job may use")
    if objective not in OBJECTIVES:
        raise UserError(f"--objective must be one of {', '.join(OBJECTIVES)} (got '{objective}')")
    if workers is not None and workers < 1:
        raise UserError(f"--workers must be >= 1 (got {workers})")
    if from_run is not None and (workload or config):
        raise UserError("--from plans from a run's own workload; drop --workload and --config")
    if ray is not None:
        if not ray.strip():
            raise UserError("--ray needs an address (host:port) or 'auto'")
        import_ray("--ray")
    overrides = [f"model={model}"] * (model is not None) + [f"hardware={hardware}"] * (hardware is not None)
    overrides += list(set_) + ["record_timeline=false"]
    with tempfile.TemporaryDirectory() as work:
        if from_run is not None:
            base = base_for_plan(None, from_run, Path(work), overrides, drafters)
        else:
            base = base_for_plan(load_config(workload, config, overrides), None, None, [], drafters)
        budget = gpus if gpus is not None else base.cluster.instances * base.cluster.tp + (base.rl.train_gpus or 0)
        space = Space(budget)
        if from_run is not None:  # the run's machine: its fitted costs are of one device, tp 1
            space = Space(budget, tps=(1,), colocated=(1.0,), split=())
        if tps is not None:
            space = replace(space, tps=tuple(_int_list(tps, "--tp")))
        if max_batches is not None:
            space = replace(space, max_batches=tuple(_int_list(max_batches, "--max-batch")))
        out = out or Path("runs/plan") / f"{base.name}-{budget}g{base.hardware.name}"
        n_workers = workers or default_workers()
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
                workers=n_workers,
                ray_address=ray,
                explain=explain,
                learn_in=Path(work) if learn else None,
                on_done=tick,
            )
            summary = write_plan(
                result, out, model_path or base.model.name, drafter_path or (result.winner.candidate.drafter or "off")
            )
    summary["out"] = str(out)
    if as_json:
        print(json.dumps(summary, indent=2))
        return
    t = Table(
        title=f"rlsched plan: {base.model.name} on {budget} x {base.hardware.name}, {base.name} "
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
    if "baseline" in summary:
        lines.append(f"over the best plain decoding ({summary['baseline']}): {summary['speedup_over_baseline']:.2f}x")
    if "own_setup" in summary:
        lines.append(
            f"over the workload's own setup ({summary['own_setup']}, {summary['own_step_s']:.2f} s): "
            f"{summary['gain_over_own']:+.1%}"
            + (f"; the knob that moved most: {summary['knob']}" if "knob" in summary else "")
        )
    if "engine_note" in summary:
        lines.append(f"note: {summary['engine_note']}")
    lines.append(f"output: {out} (rlsched report {out} for its page)")
    for line in lines:
        out_console.print(line, highlight=False, soft_wrap=True)


@app.command()
def learn(
    preset: str | None = PresetOpt,
    config: Path | None = ConfigOpt,
    set_: list[str] = SetOpt,
    out: Path = typer.Option(..., "--out", "-o", help="Where to write the policy file (JSON)."),
    kind: str = typer.Option(
        "table",
        "--kind",
        help="table (batch x context x acceptance buckets -> k) or twostate "
        "(ReSpec: off above a batch threshold, one k below).",
    ),
    seeds: int = typer.Option(1, "--seeds", help="Learning seeds (every candidate is scored on each)."),
    vllm_table: Path | None = typer.Option(
        None,
        "--vllm-table",
        help="Also write the learned draft length by "
        "batch size as vLLM's num_speculative_tokens_per_batch_size (JSON).",
    ),
    workers: int | None = typer.Option(
        None, "--workers", "-j", help="Worker processes (default: the number of CPUs); 1 runs serially in this process."
    ),
    ray: str | None = typer.Option(
        None,
        "--ray",
        help="Score candidates on a Ray cluster at this address "
        "('auto': the running local cluster; 'local': start a private one).",
    ),
    cost: Path | None = CostOpt,
    as_json: bool = JsonOpt,
):
    """Learn a drafting policy (and reallocation threshold) in the simulator; write a policy file.

    Starts from the cost model's analytic answer and improves it by simulating candidates on the
    config's workload: coordinate descent over the table's cells, keeping a change only if it
    cuts the stage time by 0.25% (smaller gains are the learning seed's luck), or a grid over the
    two-state threshold and k; then a sweep of cluster.realloc_threshold when the config
    reallocates. Use the file with `--policy table:FILE` (or twostate) in simulate, compare and
    the executor.
    """
    from rlsched.config import load_config
    from rlsched.policies.policyfile import save_policy_file
    from rlsched.sim.learn import Learner, parallel_evaluator
    from rlsched.sim.learn import vllm_table as to_vllm

    if kind not in ("table", "twostate"):
        raise UserError(f"--kind '{kind}' is not one of table, twostate")
    if seeds < 1:
        raise UserError(f"--seeds must be >= 1 (got {seeds})")
    if workers is not None and workers < 1:
        raise UserError(f"--workers must be >= 1 (got {workers})")
    for path, opt in ((out, "--out"), (vllm_table, "--vllm-table")):
        if path is not None and path.suffix != ".json":
            raise UserError(f"{opt} '{path}' must end in .json")
    if ray is not None:
        import_ray("--ray")
    cfg = _with_cost(load_config(preset, config, list(set_)), cost)
    if not cfg.drafters:
        raise UserError("learn needs at least one drafter in the config (drafters: [...])")
    if vllm_table is not None and cfg.speculation.width_max > 1:
        raise UserError(
            "--vllm-table: vLLM's table holds chain lengths, and this config lets the policy draft trees "
            "(speculation.width_max > 1); add --set speculation.width_max=1"
        )
    from rlsched.sim.runs import default_workers

    n_workers = workers or default_workers()

    first = cfg.seed
    learner = Learner(
        cfg,
        list(range(first, first + seeds)),
        parallel_evaluator(n_workers, ray),
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
        vllm_table.parent.mkdir(parents=True, exist_ok=True)
        vllm_table.write_text(json.dumps(table, indent=2))
        summary["vllm_table"] = str(vllm_table)
        summary["num_speculative_tokens_per_batch_size"] = table["num_speculative_tokens_per_batch_size"]
    if as_json:
        print(json.dumps(summary, indent=2))
    else:
        out_console.print(f"learned {kind} policy: {json.dumps(pf.params)}", highlight=False)
        out_console.print(
            f"realloc: {pf.realloc.policy} threshold {pf.realloc.threshold}; "
            f"{learner.evaluations} simulations; mean generation stage {score:.2f} s",
            highlight=False,
        )
        out_console.print(
            f"policy file: {out}" + (f"\nvLLM table: {vllm_table}" if vllm_table else ""), highlight=False
        )
