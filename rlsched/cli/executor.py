"""The real executor's commands: generate, profile and run (they need the `executor` extra)."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.table import Table

from rlsched.atomic import check_writable, json_text
from rlsched.cli.common import (
    JsonOpt,
    _int_list,
    _need_executor,
    _print_unwrapped,
    app,
    err_console,
    out_console,
)
from rlsched.errors import UserError
from rlsched.policies.registry import usage as policy_usage

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


_MODEL = typer.Option("builtin", "--model", "-m", help="Target model folder, or builtin.")
_DRAFTER = typer.Option(
    None,
    "--drafter",
    "-d",
    help="Drafter: a model folder, builtin, eagle (the "
    "built-in model's EAGLE-3 head) or an EAGLE-3 head's folder, ngram, suffix "
    "or off (default: builtin with the built-in model, else ngram).",
)
_POLICY = typer.Option("goodput", "--policy", help=f"Drafting policy: {policy_usage('local')}.")
_PROMPTS = typer.Option(None, "--prompts", help="JSONL prompts file (default: built-in task prompts).")
_N = typer.Option(4, "--n", help="Samples per prompt.")
_MAX_TOKENS = typer.Option(128, "--max-tokens", help="Token budget per sample.")
_TEMPERATURE = typer.Option(1.0, "--temperature", help="Sampling temperature (0 = greedy).")
_TOP_P = typer.Option(1.0, "--top-p", help="Nucleus sampling (1 = off).")
_TOP_K = typer.Option(0, "--top-k", help="Top-k sampling (0 = off).")
_K_MAX = typer.Option(6, "--k-max", help="Longest draft a policy may choose.")
_WIDTH_MAX = typer.Option(
    1,
    "--width-max",
    help="Widest draft tree a priced policy (goodput, seqgoodput, "
    "twostate) may choose, of at most --k-max nodes (1: chains only; trees need "
    "builtin, a model folder, eagle or suffix).",
)
_MAX_BATCH = typer.Option(64, "--max-batch", help="Rows decoded at once (continuous batching).")
_KV_BUDGET = typer.Option(
    None,
    "--kv-budget",
    help="KV cache budget in tokens shared by the "
    "running rows (default: max-batch rows at their longest). Requests "
    "wait for room; one that could never fit is refused.",
)
_COST_MODEL = typer.Option("auto", "--cost-model", help="auto, or a `rlsched profile` output folder.")
_IGNORE_EOS = typer.Option(False, "--ignore-eos", help="Generate every sample to --max-tokens.")
_DEVICE = typer.Option("cpu", "--device", help="cpu or cuda[:N].")
_DTYPE = typer.Option("float32", "--dtype", help="float32 or bfloat16.")
_SEED = typer.Option(0, "--seed", help="Sampling seed.")
_THREADS = typer.Option(
    None,
    "--threads",
    help="CPU threads for torch (default: torch's; with --instances, per instance: cores / instances).",
)
_INSTANCES = typer.Option(
    1,
    "--instances",
    help="Rollout instances; more than 1 runs them as Ray actors (the distributed extra), each with --max-batch rows.",
)
_REALLOC = typer.Option("none", "--realloc", help="Sample reallocation across instances: none, rebalance, consolidate.")
_COMPILE = typer.Option(
    False,
    "--compile",
    help="Run decode and verify steps and the drafter's drafts "
    "through torch.compile'd graphs, at every batch size (fewer, fused kernels: what "
    "it gains is in docs/benchmarks.md); compiling takes minutes the first time "
    "(much less after, from inductor's disk cache).",
)
_GENERATE_OUT = typer.Option(Path("runs/generate/latest"), "--out", "-o", help="Output folder.")


@app.command(help=GENERATE_HELP)
def generate(
    model: str = _MODEL,
    drafter: str | None = _DRAFTER,
    policy: str = _POLICY,
    prompts: Path | None = _PROMPTS,
    n: int = _N,
    max_tokens: int = _MAX_TOKENS,
    temperature: float = _TEMPERATURE,
    top_p: float = _TOP_P,
    top_k: int = _TOP_K,
    k_max: int = _K_MAX,
    width_max: int = _WIDTH_MAX,
    max_batch: int = _MAX_BATCH,
    kv_budget: int | None = _KV_BUDGET,
    cost_model: str = _COST_MODEL,
    ignore_eos: bool = _IGNORE_EOS,
    device: str = _DEVICE,
    dtype: str = _DTYPE,
    seed: int = _SEED,
    threads: int | None = _THREADS,
    instances: int = _INSTANCES,
    realloc: str = _REALLOC,
    compile_: bool = _COMPILE,
    out: Path = _GENERATE_OUT,
    as_json: bool = JsonOpt,
):
    if not 0.0 <= temperature <= 100.0:  # NaN included
        raise UserError(f"--temperature: temperature must be >= 0 (0: greedy) and at most 100 (got {temperature})")
    if not 0.0 < top_p <= 1.0:
        raise UserError(f"--top-p: top_p must lie in (0, 1] (1: off; got {top_p})")
    check_writable(out, "--out")
    _need_executor("generate")
    from rlsched.executor.generate import GenerateArgs, prepare, run

    if drafter is None:
        drafter = "builtin" if model == "builtin" else "ngram"
    args = GenerateArgs(
        model=model,
        drafter=drafter,
        policy=policy,
        prompts=prompts,
        n=n,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        k_max=k_max,
        width_max=width_max,
        max_batch=max_batch,
        kv_budget=kv_budget,
        cost_model=cost_model,
        ignore_eos=ignore_eos,
        device=device,
        dtype=dtype,
        seed=seed,
        threads=threads,
        instances=instances,
        realloc=realloc,
        compile=compile_,
    )
    log = lambda msg: err_console.print(msg, highlight=False)  # noqa: E731
    setup = prepare(args, out, log)
    with err_console.status(f"generating {len(setup.prompts)} prompts x {n} samples ({policy})"):
        summary = run(setup, out, log)
    if as_json:
        print(json_text(summary))
        return
    _print_generated(summary, f"policy={policy} drafter={setup.drafter_name}", out)


def _print_generated(summary: dict, title: str, out: Path) -> None:
    t = Table(title=f"rlsched generate: {title}")
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
    drafter: list[str] = typer.Option(
        ["builtin"],
        "--drafter",
        "-d",
        help="Drafter(s) to time: a model "
        "folder, builtin, eagle or an EAGLE-3 head's folder, ngram or suffix "
        "(repeatable; 'off' for none).",
    ),
    batch_sizes: str = typer.Option("1,2,4,8,16,32,64", "--batch-sizes", help="Comma-separated batch sizes."),
    k_max: int = typer.Option(6, "--k-max", help="Draft lengths 0..k_max."),
    width_max: int = typer.Option(
        1,
        "--width-max",
        help="Also time tree drafting (the drafters that draft "
        "trees), widths 2..width-max, depths 1..k-max (1: chains only).",
    ),
    contexts: str = typer.Option(
        "64,192",
        "--contexts",
        help="Comma-separated context lengths per row: their mean "
        "(from two rows on the rows' contexts spread over 1/2-3/2 of it, as the engine's rows "
        "differ); prefill is timed on equal prompts, also midway between them.",
    ),
    repeats: int = typer.Option(12, "--repeats", help="Timed runs per point."),
    statistic: str = typer.Option(
        "median",
        "--statistic",
        help="A point's price from its runs: median (what a "
        "run typically pays on a shared machine) or min (the least disturbed run).",
    ),
    passes: int = typer.Option(
        6,
        "--passes",
        help="Sweep the grid this many times, --repeats spread over "
        "them (runs minutes apart sample the machine's spells; at most --repeats).",
    ),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda[:N]."),
    dtype: str = typer.Option("float32", "--dtype", help="float32 or bfloat16."),
    threads: int | None = typer.Option(None, "--threads", help="CPU threads for torch (default: torch's)."),
    compile_: bool = typer.Option(
        False, "--compile", help="Time the points with compiled forwards, as `generate --compile` runs them."
    ),
    out: Path = typer.Option(Path("runs/profile/latest"), "--out", "-o", help="Output folder."),
):
    """Measure verify, draft and prefill step times over batch size x draft length x context.

    Writes traces/steps/ in the step-trace format (kind = verify | draft | prefill, and feed: a
    model drafter taking in fresh prompts, its catch-up on rows that join; a tree's drafting is a
    draft record of its width) and profile.json;
    `rlsched generate --cost-model FOLDER` and the cost-model fit read it.
    """
    check_writable(out, "--out")
    _need_executor("profile")
    from rlsched.executor.profile_run import run_profile

    run_profile(
        model=model,
        drafters=drafter,
        batch_sizes=_int_list(batch_sizes, "--batch-sizes"),
        k_max=k_max,
        contexts=_int_list(contexts, "--contexts"),
        repeats=repeats,
        passes=passes,
        device=device,
        dtype=dtype,
        threads=threads,
        out=out,
        console=err_console,
        table_console=out_console,
        compile=compile_,
        statistic=statistic,
        width_max=width_max,
    )


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
    "times: bandit, goodput's calibration, the pays schedule). The same seed repeats a run's samples only "
    "where no choice reads a clock, e.g. --policy static:3 --set drafter_update.schedule=every "
    "(docs/rl.md, Reproducibility).\n\n"
    "Example: rlsched run --policy static:3 --set steps=20 --set algorithm.name=ppo --out runs/run/ppo"
)


@app.command(help=RUN_HELP)
def run(
    config: Path | None = typer.Option(None, "--config", "-c", help="Run config file (YAML or TOML)."),
    policy: str | None = typer.Option(
        None, "--policy", help=f"Drafting policy (overrides the config), on either backend: {policy_usage('local')}."
    ),
    sets: list[str] = typer.Option([], "--set", help="Override a config field: path.to.field=value."),
    out: Path = typer.Option(Path("runs/run/latest"), "--out", "-o", help="Run folder."),
    resume: bool = typer.Option(False, "--resume", help="Continue the run in --out from its last checkpoint."),
    backend: str | None = typer.Option(
        None,
        "--backend",
        help="Rollout engine (rollout.backend): local "
        "(rlsched's own) or vllm (vLLM's offline engine; see make test-vllm).",
    ),
    instances: int | None = typer.Option(
        None,
        "--instances",
        help="Rollout instances (rollout.instances); more than 1 runs them as Ray actors (the distributed extra).",
    ),
    realloc: str | None = typer.Option(
        None, "--realloc", help="Sample reallocation across instances (rollout.realloc): none, rebalance, consolidate."
    ),
    as_json: bool = JsonOpt,
):
    check_writable(out, "--out")
    _need_executor("run")
    from rlsched.executor.rl.config import load_run_config
    from rlsched.executor.rl.trainer import Trainer

    if resume:
        if config is not None or policy is not None or sets or backend or instances or realloc:
            raise UserError(
                "--resume continues a run with its own config.yaml; drop --config, --policy, --set, "
                "--backend, --instances and --realloc"
            )
        cfg = load_run_config(out / "config.yaml") if (out / "config.yaml").is_file() else None
        if cfg is None:
            raise UserError(f"--resume: {out} holds no run (no config.yaml); give the --out of an earlier run")
    else:
        flags = [  # a name as a YAML string: `static:` stays the text given, for the parser to judge
            f"{k}={json.dumps(v) if isinstance(v, str) else v}"
            for k, v in (
                ("policy", policy),
                ("rollout.backend", backend),
                ("rollout.instances", instances),
                ("rollout.realloc", realloc),
            )
            if v is not None
        ]
        cfg = load_run_config(config, list(sets) + flags)
    log = lambda msg: err_console.print(msg, highlight=False)  # noqa: E731
    trainer = Trainer(cfg, out, resume=resume, log=log)
    summary = _run_with_progress(trainer, cfg)
    if as_json:
        print(json_text(summary))
        return
    t = Table(title=f"rlsched run: {cfg.algorithm.name}, policy={cfg.policy}, drafter={trainer.drafter_name}")
    t.add_column("metric", style="bold")
    t.add_column("value", justify="right")
    t.add_row("RL steps", str(summary["steps"]))
    t.add_row("reward: first 20% -> last 20% of steps", f"{summary['reward_start']:.3f} -> {summary['reward_end']:.3f}")
    t.add_row("accepted length: first -> last", f"{summary['accept_len_start']:.2f} -> {summary['accept_len_end']:.2f}")
    t.add_row("generation tokens/s", f"{summary['tokens_per_s']:,.0f}")
    stages = summary["stage_s"]
    t.add_row(
        "seconds (gen / inf / train / drafter)",
        f"{summary['seconds']:.1f} ({stages['generation']:.1f} / "
        f"{stages['inference']:.1f} / {stages['training']:.1f} / {stages['drafter_update']:.1f})",
    )
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
                + (f" ({r['reward_failures']} rewards failed)" if r["reward_failures"] else ""),
                highlight=False,
            )
            bar.advance(task)

        summary = trainer.run(on_step)
    return _with_plots(trainer.out, summary)


def _with_plots(out: Path, summary: dict) -> dict:
    """The run's plots (from its RL-step trace) drawn under out/plots/ and listed in its summary.json."""
    from rlsched.analysis.plots import plot_run
    from rlsched.executor.rl.records import save_summary
    from rlsched.traces.reader import read_trace

    rl_steps = read_trace(out / "traces", "rl_steps").sort_values("rl_step")
    return save_summary(out, {**summary, "plots": [str(p) for p in plot_run(rl_steps, out)]})
