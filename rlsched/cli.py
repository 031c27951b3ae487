"""The `rlsched` command line."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from rlsched import __version__
from rlsched.distributed import import_ray
from rlsched.errors import UserError
from rlsched.policies.registry import usage as policy_usage

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Adaptive speculative decoding and sample reallocation for RL rollouts: simulate, compare "
                       "and learn policies; generate, profile and train (run) with the real engine; fit, replay, plot "
                       "and report from what it measured.")
out_console = Console()
err_console = Console(stderr=True)


def _version(value: bool):
    if value:
        print(f"rlsched {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")):
    pass


PresetOpt = typer.Option(None, "--preset", "-p",
                         help="A shipped job preset (see `rlsched presets`); default: 'default'.")
ConfigOpt = typer.Option(None, "--config", "-c", help="A YAML or TOML config file.")
SetOpt = typer.Option([], "--set", "-s", help="Override a config field: path.to.field=value (repeatable).")
JsonOpt = typer.Option(False, "--json", help="Print only a JSON summary on stdout; progress and logs go to stderr.")
CostOpt = typer.Option(None, "--cost", help="A fitted cost-model file (`rlsched fit`): verify, draft and prefill "
                       "step times come from it instead of the analytic roofline of the config's model and hardware. "
                       "They are the costs of the machine and models that were profiled, whatever those presets say; "
                       "the presets still set KV capacity, KV transfer between instances and the RL step's other "
                       "stages (inference, training). The config's drafters must be named as the fitted ones "
                       "(e.g. 'model'). Sets the config's cost_file.")


def _with_cost(cfg, cost: Optional[Path]):
    """The config with --cost applied, its cost model loaded once to check the file (one line
    on stderr says where the step costs come from)."""
    from rlsched.costs.choose import cost_model_for

    if cost is not None:
        cfg = cfg.model_copy(update={"cost_file": str(cost.resolve())})
    model = cost_model_for(cfg)
    if cfg.cost_file is not None:
        d = model.describe()
        err_console.print(f"step costs: fitted ({cfg.cost_file}: {d.get('model') or 'model ?'} on "
                          f"{d.get('machine') or 'machine ?'}); KV capacity and transfer, inference and training: "
                          f"{cfg.model.name} on {cfg.hardware.name}", highlight=False, soft_wrap=True)
    return cfg


@app.command()
def presets(show: Optional[str] = typer.Option(None, "--show", help="Print the full, resolved config of a job preset."),
            kind: str = typer.Option("jobs", "--kind", help="jobs, hardware or models.")):
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
    preset: Optional[str] = PresetOpt,
    config: Optional[Path] = ConfigOpt,
    policy: Optional[str] = typer.Option(None, "--policy", help=f"Drafting policy: {policy_usage('simulator')} "
                                         "(default: the config's speculation.policy)."),
    realloc: Optional[str] = typer.Option(None, "--realloc", help="Reallocation policy: none, rebalance, consolidate "
                                          "(default: the config's cluster.realloc)."),
    out: Optional[Path] = typer.Option(None, "--out", "-o",
                                       help="Output folder (default runs/simulate/NAME-POLICY-seedN)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Random seed (overrides the config's seed)."),
    baseline: bool = typer.Option(True, "--baseline/--no-baseline", help="Also simulate `off` on the same seed "
                                  "to report the speedup."),
    set_: list[str] = SetOpt,
    cost: Optional[Path] = CostOpt,
    as_json: bool = JsonOpt,
):
    """Simulate the generation stage (and the RL steps around it) of a config or preset.

    Writes timeline.parquet (one row per engine step), samples.parquet, rl_steps.parquet,
    summary.json and the resolved config.yaml to the output folder.
    """
    from rlsched.config import load_config
    from rlsched.policies.registry import make_draft_policy
    from rlsched.policies.realloc import make_realloc_policy
    from rlsched.sim.output import run_and_write
    from rlsched.sim.simulate import policy_context

    overrides = list(set_) + ([f"seed={seed}"] if seed is not None else [])
    if seed is not None and seed < 0:
        raise UserError(f"--seed must be >= 0 (got {seed})")
    cfg = _with_cost(load_config(preset, config, overrides), cost)
    pol = policy or cfg.speculation.policy
    make_draft_policy(pol, policy_context(cfg, true_acceptance=lambda d, ids: None))
    make_realloc_policy(realloc or cfg.cluster.realloc)
    out = out or _default_out(cfg.name, pol, cfg.seed)
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
    add("time split gen/infer/train/draft-upd",
        " / ".join(f"{split[k]:.0%}" for k in ("generation", "inference", "training", "drafter_update")))
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
    preset: Optional[str] = PresetOpt,
    config: Optional[Path] = ConfigOpt,
    set_: list[str] = SetOpt,
    policies: str = typer.Option("off,static:2,static:4,goodput", "--policies", "-P",
                                 help="Comma-separated drafting policies, e.g. off,static:2,static:4,goodput "
                                 "(any name `simulate --policy` takes; only commas separate names)."),
    realloc: Optional[str] = typer.Option(None, "--realloc", help="Comma-separated reallocation policies, e.g. "
                                          "none,rebalance (default: the config's cluster.realloc)."),
    seeds: int = typer.Option(3, "--seeds", help="Number of seeds; every policy runs on each."),
    first_seed: Optional[int] = typer.Option(None, "--first-seed", help="First seed (default: the config's seed); "
                                             "seeds are FIRST..FIRST+N-1."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Write a figure (.png or .pdf): speedup over off per "
                                        "policy, and batch size and k over time for the adaptive policies."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Write compare.json (every run's summary and the "
                                       "aggregate) and compare.parquet (one row per run) to this folder."),
    workers: Optional[int] = typer.Option(None, "--workers", "-j", help="Worker processes (default: the number of "
                                          "CPUs); 1 runs serially in this process."),
    ray: Optional[str] = typer.Option(None, "--ray", help="Run on a Ray cluster at this address ('auto': the running "
                                      "local cluster; 'local': start a private one); needs pip install "
                                      "'rlsched\\[distributed]' on this machine and the same rlsched on "
                                      "every node; --workers is then ignored."),
    cost: Optional[Path] = CostOpt,
    as_json: bool = JsonOpt,
):
    from rlsched.config import load_config
    from rlsched.sim import compare as cmp

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
    n_workers = workers or cmp.default_workers()

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    where = f"Ray at {ray}" if ray is not None else ("1 process" if n_workers == 1 or len(jobs) == 1
                                                    else f"{min(n_workers, len(jobs))} processes")
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("runs"), TimeElapsedColumn(), console=err_console, transient=True,
                  disable=not err_console.is_terminal) as bar:  # a pipe would get a stray blank line
        task = bar.add_task(f"comparing {len(plan.policies)} policies x {len(plan.reallocs)} realloc x "
                            f"{len(plan.seeds)} seeds on {where}", total=len(jobs))
        results = cmp.run_jobs(cfg, jobs, n_workers, ray, on_done=lambda r: bar.advance(task))
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
    workload: Optional[str] = typer.Option(None, "--workload", "-w", help="A job preset whose workload, drafters "
                                           "and RL step are planned for (default: 'default'); its own setup is "
                                           "the comparison."),
    config: Optional[Path] = ConfigOpt,
    from_run: Optional[Path] = typer.Option(None, "--from", help="Plan from a `rlsched run` folder: its step costs "
                                            "(fitted from its traces), its lengths and acceptance."),
    model: Optional[str] = typer.Option(None, "--model", help="A model preset (see `rlsched presets`; default: "
                                        "the workload's)."),
    hardware: Optional[str] = typer.Option(None, "--hardware", help="A hardware preset (default: the workload's)."),
    gpus: Optional[int] = typer.Option(None, "--gpus", help="The GPU budget (default: the workload's)."),
    drafters: Optional[str] = typer.Option(None, "--drafters", help="Comma-separated drafters of the workload to "
                                           "consider, or none (default: all)."),
    objective: str = typer.Option("step-time", "--objective", help="step-time (the fastest RL step) or "
                                  "tokens-per-gpu-s (the most response tokens a GPU-second)."),
    tps: Optional[str] = typer.Option(None, "--tp", help="Comma-separated tensor-parallel sizes (default 1,2,4,8)."),
    max_batches: Optional[str] = typer.Option(None, "--max-batch", help="Comma-separated batch limits "
                                              "(default 64,256,1024)."),
    seeds: int = typer.Option(3, "--seeds", help="Seeds of the successive halving (rounds)."),
    survivors: int = typer.Option(24, "--survivors", help="Setups the screen hands to the simulator."),
    explain: bool = typer.Option(True, "--explain/--no-explain", help="Simulate each knob where the workload's own "
                                 "setup and the winner differ, moved alone, and name the one that moved most."),
    learn: bool = typer.Option(True, "--learn/--no-learn", help="Learn a table policy in the simulator for the "
                               "best chain setup (on a held-out seed) and rank it with the others."),
    workers: Optional[int] = typer.Option(None, "--workers", "-j", help="Worker processes (default: the number of "
                                          "CPUs)."),
    ray: Optional[str] = typer.Option(None, "--ray", help="Simulate on a Ray cluster at this address, as compare "
                                      "does."),
    model_path: Optional[str] = typer.Option(None, "--model-path", help="The actor's folder (or HF id) written into "
                                             "run.yaml and vllm_engine.json (default: the model's name)."),
    drafter_path: Optional[str] = typer.Option(None, "--drafter-path", help="The drafter's folder written there "
                                               "(default: the drafter's name)."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Output folder (default runs/plan/NAME-NgNAME)."),
    set_: list[str] = SetOpt,
    as_json: bool = JsonOpt,
):
    import tempfile
    from dataclasses import replace

    from rlsched.config import load_config
    from rlsched.plan.planner import base_for_plan, make_plan, plan_rows, write_plan
    from rlsched.plan.screen import OBJECTIVES
    from rlsched.plan.space import Space
    from rlsched.sim.compare import default_workers

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
            result = make_plan(base, space, objective=objective, survivors=survivors, seeds=seeds,
                               workers=n_workers, ray_address=ray, explain=explain,
                               learn_in=Path(work) if learn else None, on_done=tick)
            summary = write_plan(result, out, model_path or base.model.name,
                                 drafter_path or (result.winner.candidate.drafter or "off"))
    summary["out"] = str(out)
    if as_json:
        print(json.dumps(summary, indent=2))
        return
    t = Table(title=f"rlsched plan: {base.model.name} on {budget} x {base.hardware.name}, {base.name} "
                    f"({summary['candidates']} setups, {summary['dropped']} cannot run, {summary['simulations']} "
                    f"simulations; {objective})")
    for col, just in (("#", "right"), ("setup", "left"), ("GPUs", "right"), ("step s (sim)", "right"),
                      ("screen s", "right"), ("seeds", "right"), ("generation", "right")):
        t.add_column(col, justify=just)
    for r in [r for r in plan_rows(result) if r["step_s"] is not None][:10]:
        t.add_row(str(r["rank"]), r["setup"], str(r["gpus"]), f"{r['step_s']:.2f}", f"{r['screen_step_s']:.2f}",
                  str(r["seeds"]), f"{r['split']['generation']:.0%}")
    _print_unwrapped(out_console, t)
    split = " / ".join(f"{k.replace('_', ' ')} {v:.0%}" for k, v in summary["winner_split"].items())
    lines = [f"winner: {summary['winner']}, {summary['winner_step_s']:.2f} s a step ({split})"]
    if "baseline" in summary:
        lines.append(f"over the best plain decoding ({summary['baseline']}): {summary['speedup_over_baseline']:.2f}x")
    if "own_setup" in summary:
        lines.append(f"over the workload's own setup ({summary['own_setup']}, {summary['own_step_s']:.2f} s): "
                     f"{summary['gain_over_own']:+.1%}" + (f"; the knob that moved most: {summary['knob']}"
                                                           if "knob" in summary else ""))
    if "engine_note" in summary:
        lines.append(f"note: {summary['engine_note']}")
    lines.append(f"output: {out} (rlsched report {out} for its page)")
    for line in lines:
        out_console.print(line, highlight=False, soft_wrap=True)


@app.command()
def learn(
    preset: Optional[str] = PresetOpt,
    config: Optional[Path] = ConfigOpt,
    set_: list[str] = SetOpt,
    out: Path = typer.Option(..., "--out", "-o", help="Where to write the policy file (JSON)."),
    kind: str = typer.Option("table", "--kind", help="table (batch x context x acceptance buckets -> k) or twostate "
                             "(ReSpec: off above a batch threshold, one k below)."),
    seeds: int = typer.Option(1, "--seeds", help="Learning seeds (every candidate is scored on each)."),
    vllm_table: Optional[Path] = typer.Option(None, "--vllm-table", help="Also write the learned draft length by "
                                              "batch size as vLLM's num_speculative_tokens_per_batch_size (JSON)."),
    workers: Optional[int] = typer.Option(None, "--workers", "-j", help="Worker processes (default: the number of "
                                          "CPUs); 1 runs serially in this process."),
    ray: Optional[str] = typer.Option(None, "--ray", help="Score candidates on a Ray cluster at this address "
                                      "('auto': the running local cluster; 'local': start a private one)."),
    cost: Optional[Path] = CostOpt,
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
    from rlsched.sim import compare as cmp
    from rlsched.sim.learn import Learner, parallel_evaluator, vllm_table as to_vllm

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
        raise UserError("--vllm-table: vLLM's table holds chain lengths, and this config lets the policy draft trees "
                        "(speculation.width_max > 1); add --set speculation.width_max=1")
    n_workers = workers or cmp.default_workers()

    first = cfg.seed
    learner = Learner(cfg, list(range(first, first + seeds)), parallel_evaluator(n_workers, ray),
                      log=lambda m: err_console.print(m, highlight=False))
    pf, score = learner.learn(kind)
    save_policy_file(out, pf)
    summary = {"policy_file": str(out), "kind": kind, "params": pf.params, "realloc": pf.realloc.model_dump(),
               "generation_s": score, "evaluations": learner.evaluations, "seeds": learner.seeds}
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
        out_console.print(f"realloc: {pf.realloc.policy} threshold {pf.realloc.threshold}; "
                          f"{learner.evaluations} simulations; mean generation stage {score:.2f} s", highlight=False)
        out_console.print(f"policy file: {out}" + (f"\nvLLM table: {vllm_table}" if vllm_table else ""),
                          highlight=False)


def _need_executor(command: str) -> None:
    """The executor commands need torch (the `executor` extra); say so in one line."""
    import importlib.util

    for module in ("torch", "safetensors", "tokenizers"):
        if importlib.util.find_spec(module) is None:
            raise UserError(f"`rlsched {command}` needs the executor extra ({module} is missing): "
                            "pip install 'rlsched[executor]'")


GENERATE_HELP = (
    "Batched speculative rollouts of a prompts file with the rollout engine.\n\n"
    "--model and --drafter take a local HF folder (config.json, *.safetensors, tokenizer.json); 'builtin' is "
    "the built-in tiny pair (trained on first use, then cached). --drafter also takes ngram (matches in the "
    "prompt and earlier samples of the same prompt), suffix (what most often followed the same context in earlier "
    "samples of the prompt, drafted while confident) or off. --prompts is a JSONL file with a 'prompt' string "
    "(and optional 'id', 'answer') per line; without it, 32 built-in task prompts. Policies that price steps "
    "(goodput, seqgoodput, twostate) use --cost-model: 'auto' profiles this machine for a few seconds first, "
    "or give a `rlsched profile` folder.\n\n"
    "Writes samples.parquet (per sample: prompt id, token ids, text, per-token log-probs), traces/ (step and "
    "sample records, flushed every step) and summary.json to --out.\n\n"
    "Example: rlsched generate --policy static:4 --n 4 --max-tokens 64 --out runs/generate/demo"
)


@app.command(help=GENERATE_HELP)
def generate(
    model: str = typer.Option("builtin", "--model", "-m", help="Target model folder, or builtin."),
    drafter: Optional[str] = typer.Option(None, "--drafter", "-d", help="Drafter: a model folder, builtin, eagle (the "
                                          "built-in model's EAGLE-3 head) or an EAGLE-3 head's folder, ngram, suffix "
                                          "or off (default: builtin with the built-in model, else ngram)."),
    policy: str = typer.Option("goodput", "--policy", help=f"Drafting policy: {policy_usage('local')}."),
    prompts: Optional[Path] = typer.Option(None, "--prompts",
                                           help="JSONL prompts file (default: built-in task prompts)."),
    n: int = typer.Option(4, "--n", help="Samples per prompt."),
    max_tokens: int = typer.Option(128, "--max-tokens", help="Token budget per sample."),
    temperature: float = typer.Option(1.0, "--temperature", help="Sampling temperature (0 = greedy)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling (1 = off)."),
    top_k: int = typer.Option(0, "--top-k", help="Top-k sampling (0 = off)."),
    k_max: int = typer.Option(6, "--k-max", help="Longest draft a policy may choose."),
    width_max: int = typer.Option(1, "--width-max", help="Widest draft tree a priced policy (goodput, seqgoodput, "
                                  "twostate) may choose, of at most --k-max nodes (1: chains only; trees need "
                                  "builtin, a model folder, eagle or suffix)."),
    max_batch: int = typer.Option(64, "--max-batch", help="Rows decoded at once (continuous batching)."),
    kv_budget: Optional[int] = typer.Option(None, "--kv-budget", help="KV cache budget in tokens shared by the "
                                            "running rows (default: max-batch rows at their longest). Requests "
                                            "wait for room; one that could never fit is refused."),
    cost_model: str = typer.Option("auto", "--cost-model", help="auto, or a `rlsched profile` output folder."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Generate every sample to --max-tokens."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda[:N]."),
    dtype: str = typer.Option("float32", "--dtype", help="float32 or bfloat16."),
    seed: int = typer.Option(0, "--seed", help="Sampling seed."),
    threads: Optional[int] = typer.Option(None, "--threads", help="CPU threads for torch (default: torch's; "
                                          "with --instances, per instance: cores / instances)."),
    instances: int = typer.Option(1, "--instances", help="Rollout instances; more than 1 runs them as Ray actors "
                                  "(the distributed extra), each with --max-batch rows."),
    realloc: str = typer.Option("none", "--realloc", help="Sample reallocation across instances: none, rebalance, "
                                "consolidate."),
    compile_: bool = typer.Option(False, "--compile", help="Run decode and verify steps and the drafter's drafts "
                                  "through torch.compile'd graphs, at every batch size (fewer, fused kernels: what "
                                  "it gains is in docs/benchmarks.md); compiling takes minutes the first time "
                                  "(much less after, from inductor's disk cache)."),
    out: Path = typer.Option(Path("runs/generate/latest"), "--out", "-o", help="Output folder."),
    as_json: bool = JsonOpt,
):
    _need_executor("generate")
    from rlsched.executor.generate import GenerateArgs, prepare, run

    if drafter is None:
        drafter = "builtin" if model == "builtin" else "ngram"
    args = GenerateArgs(model=model, drafter=drafter, policy=policy, prompts=prompts, n=n, max_tokens=max_tokens,
                        temperature=temperature, top_p=top_p, top_k=top_k, k_max=k_max, width_max=width_max,
                        max_batch=max_batch,
                        kv_budget=kv_budget, cost_model=cost_model, ignore_eos=ignore_eos, device=device,
                        dtype=dtype, seed=seed, threads=threads, instances=instances, realloc=realloc,
                        compile=compile_)
    log = lambda msg: err_console.print(msg, highlight=False)  # noqa: E731
    setup = prepare(args, out, log)
    with err_console.status(f"generating {len(setup.prompts)} prompts x {n} samples ({policy})"):
        summary = run(setup, out, log)
    if as_json:
        print(json.dumps(summary, indent=2))
        return
    t = Table(title=f"rlsched generate: policy={policy} drafter={setup.drafter_name}")
    t.add_column("metric", style="bold")
    t.add_column("value", justify="right")
    t.add_row("samples x tokens", f"{summary['samples']} x {summary['tokens'] / max(1, summary['samples']):.1f} (mean)")
    t.add_row("tokens/s", f"{summary['tokens_per_s']:,.0f}")
    t.add_row("seconds", f"{summary['seconds']:.2f}")
    t.add_row("engine steps", f"{summary['steps']:,}")
    t.add_row("mean accepted length (SD steps)", f"{summary['mean_accept_len']:.2f}")
    if summary.get("accuracy") is not None:
        t.add_row("exact-match accuracy", f"{summary['accuracy']:.2f}")
    t.add_row("output", str(out))
    _print_unwrapped(out_console, t)


@app.command()
def profile(
    model: str = typer.Option("builtin", "--model", "-m", help="Target model folder, or builtin."),
    drafter: list[str] = typer.Option(["builtin"], "--drafter", "-d", help="Drafter(s) to time: a model "
                                      "folder, builtin, eagle or an EAGLE-3 head's folder, ngram or suffix "
                                      "(repeatable; 'off' for none)."),
    batch_sizes: str = typer.Option("1,2,4,8,16,32,64", "--batch-sizes", help="Comma-separated batch sizes."),
    k_max: int = typer.Option(6, "--k-max", help="Draft lengths 0..k_max."),
    width_max: int = typer.Option(1, "--width-max", help="Also time tree drafting (the drafters that draft "
                                  "trees), widths 2..width-max, depths 1..k-max (1: chains only)."),
    contexts: str = typer.Option("64,192", "--contexts", help="Comma-separated context lengths per row: their mean "
                                 "(from two rows on the rows' contexts spread over 1/2-3/2 of it, as the engine's rows "
                                 "differ); prefill is timed on equal prompts, also midway between them."),
    repeats: int = typer.Option(12, "--repeats", help="Timed runs per point."),
    statistic: str = typer.Option("median", "--statistic", help="A point's price from its runs: median (what a "
                                  "run typically pays on a shared machine) or min (the least disturbed run)."),
    passes: int = typer.Option(6, "--passes", help="Sweep the grid this many times, --repeats spread over "
                               "them (runs minutes apart sample the machine's spells; at most --repeats)."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda[:N]."),
    dtype: str = typer.Option("float32", "--dtype", help="float32 or bfloat16."),
    threads: Optional[int] = typer.Option(None, "--threads", help="CPU threads for torch (default: torch's)."),
    compile_: bool = typer.Option(False, "--compile", help="Time the points with compiled forwards, as "
                                  "`generate --compile` runs them."),
    out: Path = typer.Option(Path("runs/profile/latest"), "--out", "-o", help="Output folder."),
):
    """Measure verify, draft and prefill step times over batch size x draft length x context.

    Writes traces/steps/ in the step-trace format (kind = verify | draft | prefill, and feed: a
    model drafter taking in fresh prompts, its catch-up on rows that join; a tree's drafting is a
    draft record of its width) and profile.json;
    `rlsched generate --cost-model FOLDER` and the cost-model fit read it.
    """
    _need_executor("profile")
    from rlsched.executor.profiler import run_profile

    run_profile(model=model, drafters=drafter, batch_sizes=_int_list(batch_sizes, "--batch-sizes"), k_max=k_max,
                contexts=_int_list(contexts, "--contexts"), repeats=repeats, passes=passes, device=device, dtype=dtype,
                threads=threads, out=out, console=err_console, table_console=out_console, compile=compile_,
                statistic=statistic, width_max=width_max)


FIT_HELP = (
    "Fit the cost model to measured step times and write a cost-model file for --cost.\n\n"
    "PROFILE_OR_RUNDIR is a `rlsched profile` folder or a run folder (`generate`, `run`): anything holding "
    "traces/steps/. Verify, prefill and each drafter's draft time (and a model drafter's feed, where "
    "profiled) are fitted as functions of batch size, tokens per row and context per row (roofline-shaped "
    "forms, rlsched/costs/costfile.py) with scipy. Quality is "
    "R^2 and MAPE; held-out MAPE comes from a fit without every other batch size (or without a random 25% of a "
    "run's steps). An op whose held-out MAPE is above --max-mape, where interpolation over the measured grid "
    "does better, is priced by that interpolation instead (the table and the file say so).\n\n"
    "The file holds the costs of the profiled machine and models; `simulate`, `compare` and `learn --cost FILE` "
    "use them whatever the config's model and hardware presets are.\n\n"
    "Example: rlsched profile --out runs/profile/builtin && rlsched fit runs/profile/builtin --out costmodel.json "
    "--plot fit.png"
)


@app.command(help=FIT_HELP)
def fit(
    profile_or_rundir: Path = typer.Argument(..., metavar="PROFILE_OR_RUNDIR", help="A `rlsched profile` folder or "
                                             "a run folder (holding traces/steps/).", show_default=False),
    out: Path = typer.Option(..., "--out", "-o", help="Where to write the cost-model file (.json)."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Also draw measured points against the fit per batch "
                                        "size and k, with residuals (.png or .pdf)."),
    max_mape: float = typer.Option(5.0, "--max-mape", help="Held-out MAPE (%) above which an op falls back to "
                                   "interpolation over the measured grid (where that does better)."),
    as_json: bool = JsonOpt,
):
    from rlsched.costs.fit import fit_path
    from rlsched.atomic import write_text_atomic

    if out.suffix != ".json":
        raise UserError(f"--out '{out}' must end in .json")
    if out.is_dir():
        raise UserError(f"--out '{out}' is a folder; give a file name ending in .json")
    if plot is not None and plot.suffix.lower() not in (".png", ".pdf"):
        raise UserError(f"--plot '{plot}' must end in .png or .pdf")
    if not max_mape > 0:
        raise UserError(f"--max-mape must be > 0 (a percentage; got {max_mape})")
    with err_console.status(f"fitting {profile_or_rundir}"):
        result = fit_path(profile_or_rundir, max_mape / 100)
        figure = None
        if plot is not None:
            from rlsched.analysis.plots import fit_figure

            figure = fit_figure(result)
    write_text_atomic(out, json.dumps(result.to_json(), indent=2) + "\n")
    if figure is not None:
        from rlsched.analysis.plots import save_figure

        save_figure(figure, plot)
    table = _fit_table(result, out)
    console = err_console if as_json else out_console
    _print_unwrapped(console, table)
    for note in result.notes:
        console.print(f"note: {note}", highlight=False, soft_wrap=True)
    if plot is not None:
        console.print(f"plot: {plot}", highlight=False)
    if as_json:
        print(json.dumps({"out": str(out), "plot": str(plot) if plot else None, **result.summary()}, indent=2))


def _fit_table(result, out: Path) -> Table:
    pct = lambda v: "-" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    t = Table(title=f"rlsched fit: {result.source.get('path')} -> {out}")
    for col in ("op", "priced by", "R^2", "MAPE", "MAPE train", "MAPE held-out", "interp. held-out", "points",
                "held out"):
        t.add_column(col, justify="left" if col in ("op", "priced by", "held out") else "right")
    for key, f in result.ops.items():
        q = f.quality
        t.add_row(key, "fitted form" if f.used == "parametric" else "interpolation", f"{q['r2']:.4f}", pct(q["mape"]),
                  pct(q["mape_train"]), pct(q["mape_heldout"]), pct(q["interp_mape_heldout"]),
                  str(q["points"]), f"{q['heldout_points']}: {q['heldout']}" if q["heldout_points"] else q["heldout"])
    return t


PLOT_HELP = (
    "Draw the figures a folder's data supports, as PNG and PDF, and print the files written.\n\n"
    "FOLDER is a `rlsched run`, `generate`, `profile`, `simulate` or `compare --out` folder. Figures: fit (the "
    "cost-model fit of the folder's profile, or of --cost's file over the folder's steps), speedup (of each k over "
    "plain decoding against batch size, predicted from measured step costs at the measured acceptance, and "
    "measured from the run's own steps where they allow), acceptance (over RL steps), batch_k (batch size and "
    "chosen k over time per instance, one RL step), stages (seconds per stage of each RL step), learning_curve "
    "(a run's), compare (a compare folder's speedups). Those the data does not support are listed on stderr.\n\n"
    "Example: rlsched plot runs/run/latest && rlsched plot runs/profile/builtin --out figs"
)


@app.command(help=PLOT_HELP)
def plot(
    folder: Path = typer.Argument(..., metavar="FOLDER", help="A run, generate, profile, simulate or compare output "
                                  "folder.", show_default=False),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Folder for the figures (default FOLDER/plots)."),
    cost: Optional[Path] = typer.Option(None, "--cost", help="A cost-model file (`rlsched fit`): draw its fit over "
                                        "the folder's step times, and price the speedup figure with it where the "
                                        "folder holds no profile."),
    rl_step: Optional[int] = typer.Option(None, "--rl-step", help="The RL step of the batch-size and k figure "
                                          "(default: the first)."),
    acceptance: Optional[float] = typer.Option(None, "--acceptance", help="Per-token acceptance for the predicted "
                                               "speedups (default: measured from the folder's speculative steps; "
                                               "0.7 where it has none, e.g. a profile)."),
    as_json: bool = JsonOpt,
):
    if out is not None and out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: exists and is not a folder")
    if acceptance is not None and not 0 < acceptance < 1:
        raise UserError(f"--acceptance must be between 0 and 1 (got {acceptance})")
    from rlsched.analysis.folder import figures_for, load_folder, write_figures

    cost_data = _read_cost(cost)
    with err_console.status(f"drawing {folder}"):
        data = load_folder(folder)
        figs, skipped = figures_for(data, cost_data, cost, rl_step, acceptance)
        if not figs:
            raise UserError(f"'{folder}' has nothing to plot: " + "; ".join(f"{k}: {v}" for k, v in skipped.items()))
        out = out if out is not None else folder / "plots"
        paths = write_figures(figs, out)
    for name, why in skipped.items():
        err_console.print(f"not drawn: {name} ({why})", highlight=False, soft_wrap=True)
    if as_json:
        print(json.dumps({"folder": str(folder), "kind": data.kind, "out": str(out), "files": [str(p) for p in paths],
                          "figures": list(figs), "skipped": skipped}, indent=2))
    else:
        for p in paths:
            print(p)


def _read_cost(cost: Optional[Path]):
    from rlsched.costs.costfile import read_cost_file

    return read_cost_file(cost) if cost is not None else None


REPORT_HELP = (
    "Write one self-contained HTML page of a run: its key numbers (reward first -> last, generation tokens/s, "
    "mean accepted length, acceptance rate, stage split, policy, drafter, algorithm, steps) and every figure "
    "`rlsched plot` draws for it, embedded as PNG (the page is one file, no scripts).\n\n"
    "RUNDIR is a `rlsched run` folder (other folders `rlsched plot` takes work too, with their summary's numbers, "
    "and an `rlsched plan` folder).\n\n"
    "Example: rlsched report runs/run/latest --out report.html"
)


@app.command(help=REPORT_HELP)
def report(
    rundir: Path = typer.Argument(..., metavar="RUNDIR", help="A `rlsched run` output folder.", show_default=False),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="The page to write (.html; default "
                                       "RUNDIR/report.html)."),
    cost: Optional[Path] = typer.Option(None, "--cost",
                                        help="A cost-model file (`rlsched fit`), as for `rlsched plot`."),
    as_json: bool = JsonOpt,
):
    if out is not None and (out.suffix.lower() not in (".html", ".htm") or out.is_dir()):
        raise UserError(f"--out {out}: give a file name ending in .html")
    from rlsched.analysis.report import build_report
    from rlsched.atomic import write_text_atomic

    cost_data = _read_cost(cost)
    with err_console.status(f"writing the report of {rundir}"):
        page, info = build_report(rundir, cost_data, cost)
        out = out if out is not None else rundir / "report.html"
        write_text_atomic(out, page)
    info["out"] = str(out)
    if as_json:
        print(json.dumps(info, indent=2))
    else:
        print(f"report: {out} ({len(info['figures'])} figures: {', '.join(info['figures'])})")


RUN_HELP = (
    "RL training (GRPO or PPO) whose rollouts use the engine's adaptive speculative decoding, with a drafter "
    "kept fresh by distillation from the actor: by default once its staleness has cost the rollouts what an update "
    "costs (drafter_update.schedule=pays; 'every' updates each drafter_update.every steps).\n\n"
    "With no arguments: a fixed set of 64 built-in task prompts (count, repeat; exact-match reward) with the built-in "
    "tiny pair on CPU, 40 RL steps (a few minutes). --config takes a YAML/TOML file of RunConfig fields "
    "(rlsched/executor/rl/config.py); --set path.to.field=value overrides one (repeatable).\n\n"
    "Writes to --out: traces/ (engine steps, samples, one rl_steps record per RL step: stage times, tokens, "
    "acceptance, rewards), rollouts/ (every sample's text and reward), checkpoint.pt (every "
    "checkpoint_every steps, atomically), plots/learning_curve.png and summary.json. A killed run continues "
    "with --resume (same --out) from its last checkpoint (the same numbers unless choices read wall-clock "
    "times: bandit, goodput's calibration, the pays schedule).\n\n"
    "Example: rlsched run --policy static:3 --set steps=20 --set algorithm.name=ppo --out runs/run/ppo"
)


@app.command(help=RUN_HELP)
def run(
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="Run config file (YAML or TOML)."),
    policy: Optional[str] = typer.Option(None, "--policy", help=f"Drafting policy (overrides the config), on "
                                         f"either backend: {policy_usage('local')}."),
    sets: list[str] = typer.Option([], "--set", help="Override a config field: path.to.field=value."),
    out: Path = typer.Option(Path("runs/run/latest"), "--out", "-o", help="Run folder."),
    resume: bool = typer.Option(False, "--resume", help="Continue the run in --out from its last checkpoint."),
    backend: Optional[str] = typer.Option(None, "--backend", help="Rollout engine (rollout.backend): local "
                                          "(rlsched's own) or vllm (vLLM's offline engine; see make test-vllm)."),
    instances: Optional[int] = typer.Option(None, "--instances", help="Rollout instances (rollout.instances); "
                                            "more than 1 runs them as Ray actors (the distributed extra)."),
    realloc: Optional[str] = typer.Option(None, "--realloc", help="Sample reallocation across instances "
                                          "(rollout.realloc): none, rebalance, consolidate."),
    as_json: bool = JsonOpt,
):
    _need_executor("run")
    from rlsched.executor.rl.config import load_run_config
    from rlsched.executor.rl.trainer import Trainer

    if resume:
        if config is not None or policy is not None or sets or backend or instances or realloc:
            raise UserError("--resume continues a run with its own config.yaml; drop --config, --policy, --set, "
                            "--backend, --instances and --realloc")
        cfg = load_run_config(out / "config.yaml") if (out / "config.yaml").is_file() else None
        if cfg is None:
            raise UserError(f"--resume: {out} holds no run (no config.yaml); give the --out of an earlier run")
    else:
        flags = [f"{k}={v}" for k, v in (("policy", policy), ("rollout.backend", backend),
                                          ("rollout.instances", instances), ("rollout.realloc", realloc))
                 if v is not None]
        cfg = load_run_config(config, list(sets) + flags)
    log = lambda msg: err_console.print(msg, highlight=False)  # noqa: E731
    trainer = Trainer(cfg, out, resume=resume, log=log)
    summary = _run_with_progress(trainer, cfg)
    if as_json:
        print(json.dumps(summary, indent=2))
        return
    t = Table(title=f"rlsched run: {cfg.algorithm.name}, policy={cfg.policy}, drafter={trainer.drafter_name}")
    t.add_column("metric", style="bold")
    t.add_column("value", justify="right")
    t.add_row("RL steps", str(summary["steps"]))
    t.add_row("reward: first 20% -> last 20% of steps", f"{summary['reward_start']:.3f} -> {summary['reward_end']:.3f}")
    t.add_row("accepted length: first -> last", f"{summary['accept_len_start']:.2f} -> {summary['accept_len_end']:.2f}")
    t.add_row("generation tokens/s", f"{summary['tokens_per_s']:,.0f}")
    stages = summary["stage_s"]
    t.add_row("seconds (gen / inf / train / drafter)", f"{summary['seconds']:.1f} ({stages['generation']:.1f} / "
              f"{stages['inference']:.1f} / {stages['training']:.1f} / {stages['drafter_update']:.1f})")
    t.add_row("traces", summary["traces"])
    t.add_row("plot", summary["plots"][0] if summary["plots"] else "-")
    _print_unwrapped(out_console, t)


def _run_with_progress(trainer, cfg) -> dict:
    """The trainer's steps under a progress bar, one line per RL step (on stderr)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("RL steps"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=err_console, transient=True) as bar:
        task = bar.add_task("run", total=cfg.steps, completed=trainer.start_step)

        def on_step(r: dict) -> None:
            bar.console.print(
                f"step {r['rl_step']:>3} reward {r['reward_mean']:.3f} {r['tokens_per_s']:5,.0f} tok/s "
                f"acc {r['mean_accept_len']:.2f} | s: gen {r['generation_s']:.2f} inf {r['inference_s']:.2f} "
                f"train {r['training_s']:.2f} dr {r['drafter_update_s']:.2f}"
                + (f" ({r['reward_failures']} rewards failed)" if r["reward_failures"] else ""), highlight=False)
            bar.advance(task)

        return trainer.run(on_step)


REPLAY_HELP = (
    "Replay a `rlsched run` in the simulator: each RL step's rollout is rebuilt from the run's traces (prompt "
    "and response lengths, each sample's acceptance) and its generation stage simulated with the run's policy, "
    "batch limit and k_max; predicted against measured seconds per step (MAPE, worst step), and the predicted "
    "speedup of the run's SD over SD off.\n\n"
    "Step costs: --cost (a `rlsched fit` file), or fitted from the run's own step records; the executor's time "
    "between steps is charged per step as measured in the run. --baseline RUNDIR (the same run with SD off) adds "
    "the measured speedup beside the predicted one.\n\n"
    "Example: rlsched replay runs/run/latest --plot replay.png"
)


@app.command(help=REPLAY_HELP)
def replay(
    rundir: Path = typer.Argument(..., metavar="RUNDIR", help="A `rlsched run` output folder."),
    cost: Optional[Path] = typer.Option(None, "--cost", help="Cost-model file from `rlsched fit` (default: fit "
                                        "the run's own step records)."),
    policy: Optional[str] = typer.Option(None, "--policy", help="Replay with another drafting policy (what-if)."),
    baseline: Optional[Path] = typer.Option(None, "--baseline", help="The same run with SD off: measured speedup."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Figure of measured and predicted time per step "
                                        "(.png or .pdf)."),
    as_json: bool = JsonOpt,
):
    from rlsched.analysis.replay import read_run, replay_figure, replay_run

    if plot is not None and plot.suffix.lower() not in (".png", ".pdf"):
        raise UserError(f"--plot {plot}: the file name must end in .png or .pdf")
    result = replay_run(rundir, cost, policy)
    summary = result.summary()
    if baseline is not None:
        _, base_rl, _, _ = read_run(baseline)
        measured = float(base_rl["generation_s"].sum() / result.steps["measured_s"].sum())
        summary.update(measured_sd_speedup=measured, baseline=str(baseline),
                       speedup_error_pct=(summary["predicted_sd_speedup"] / measured - 1) * 100)
    if plot is not None:
        from rlsched.analysis.plots import save_figure

        save_figure(replay_figure(result), plot)
        summary["plot"] = str(plot)
    if as_json:
        print(json.dumps(summary, indent=2))
        return
    t = Table(title=f"rlsched replay {rundir}: policy={result.policy} drafter={result.drafter or 'off'}")
    t.add_column("metric", style="bold")
    t.add_column("value", justify="right")
    t.add_row("RL steps", str(summary["rl_steps"]))
    t.add_row("generation s: measured / predicted", f"{summary['measured_generation_s']:.2f} / "
              f"{summary['predicted_generation_s']:.2f}")
    t.add_row("per-step MAPE", f"{summary['mape_pct']:.1f}%")
    t.add_row("worst step", f"{summary['worst_step']} ({summary['worst_error_pct']:+.1f}%)")
    t.add_row("predicted SD speedup over off", f"{summary['predicted_sd_speedup']:.3f}x")
    if baseline is not None:
        t.add_row("measured SD speedup (baseline run)", f"{summary['measured_sd_speedup']:.3f}x "
                  f"({summary['speedup_error_pct']:+.1f}% off)")
    t.add_row("executor time between steps", f"{summary['overhead_ms_per_step']:.2f} ms per step")
    if plot is not None:
        t.add_row("plot", str(plot))
    _print_unwrapped(out_console, t)
    for note in result.notes:
        err_console.print(f"note: {note}", highlight=False)


IMPORT_VLLM_HELP = (
    "Import vLLM's speculative-decoding metrics as step traces that `rlsched fit DIR` reads.\n\n"
    "METRICS is a sequence of vLLM metric snapshots: LLM.get_metrics() as JSON (bench/peers/vllm_spec_metrics.py "
    "writes one after each generate call) or Prometheus text from /metrics (scrapes separated by '# rlsched-snapshot "
    "{...}' lines). Each interval between snapshots becomes a decode record (counter deltas; plain engines also a "
    "prefill record) in DIR/traces/steps/, and DIR/vllm.json holds the intervals, acceptance per draft position and "
    "what is exact and what approximate. vLLM does not separate draft time from verify time: fit prices verify from "
    "the plain (k = 0) steps and prefill, and no drafter (rlsched/traces/vllm_metrics.py says more)."
)


@app.command("import-vllm", help=IMPORT_VLLM_HELP)
def import_vllm(
    metrics: Path = typer.Argument(..., metavar="METRICS", help="METRICS.json or Prometheus text (.prom).",
                                   show_default=False),
    out: Path = typer.Option(..., "--out", "-o", help="Output folder (traces/steps/ and vllm.json)."),
    k: Optional[int] = typer.Option(None, "--k", help="Draft length (num_speculative_tokens) where the file does "
                                    "not say it."),
    drafter: Optional[str] = typer.Option(None, "--drafter", help="Drafter name of the speculative records "
                                          "(default: the file's, else 'vllm')."),
    as_json: bool = JsonOpt,
):
    from rlsched.traces.vllm_metrics import import_vllm as run_import, report

    summary = run_import(metrics, out, k, drafter)
    if as_json:
        print(json.dumps(summary, indent=2))
        return
    cols, rows, lines = report(summary)
    t = Table(title=f"rlsched import-vllm: {metrics} -> {out}")
    for c in cols:
        t.add_column(c, justify="left" if c in ("interval", "drafter") else "right")
    for r in rows:
        t.add_row(*r)
    _print_unwrapped(out_console, t)
    for line in lines:
        out_console.print(line, highlight=False, soft_wrap=True)


def _int_list(text: str, option: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise UserError(f"{option} must be comma-separated whole numbers >= 1 (got {text!r})")
    return values


def _print_unwrapped(console: Console, renderable) -> None:
    """Print; into a pipe or file (no terminal width to respect) at the table's natural width."""
    if not console.is_terminal:
        width = console.measure(renderable, options=console.options.update_width(1000)).maximum
        if width > console.width:
            console = Console(file=console.file, width=width)
    console.print(renderable)


def main() -> None:
    try:
        app()
    except UserError as e:
        err_console.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except KeyboardInterrupt:
        err_console.print("interrupted; nothing written")
        sys.exit(130)


if __name__ == "__main__":
    main()
