"""The `rlsched` command line."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from rlsched import __version__
from rlsched.errors import UserError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Adaptive speculative decoding and sample reallocation for RL rollouts: simulate, learn, run.")
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


PresetOpt = typer.Option(None, "--preset", "-p", help="A shipped job preset (see `rlsched presets`); default: 'default'.")
ConfigOpt = typer.Option(None, "--config", "-c", help="A YAML or TOML config file.")
SetOpt = typer.Option([], "--set", "-s", help="Override a config field: path.to.field=value (repeatable).")
JsonOpt = typer.Option(False, "--json", help="Print only a JSON summary on stdout; progress and logs go to stderr.")


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
    policy: Optional[str] = typer.Option(None, "--policy", help="Drafting policy: off, static:K, goodput "
                                         "(default: the config's speculation.policy)."),
    realloc: Optional[str] = typer.Option(None, "--realloc", help="Reallocation policy: none, rebalance "
                                          "(default: the config's cluster.realloc)."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Output folder (default runs/simulate/NAME-POLICY-seedN)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Random seed (overrides the config's seed)."),
    baseline: bool = typer.Option(True, "--baseline/--no-baseline", help="Also simulate `off` on the same seed "
                                  "to report the speedup."),
    set_: list[str] = SetOpt,
    as_json: bool = JsonOpt,
):
    """Simulate the generation stage (and the RL steps around it) of a config or preset.

    Writes timeline.parquet (one row per engine step), samples.parquet, rl_steps.parquet,
    summary.json and the resolved config.yaml to the output folder.
    """
    from rlsched.config import load_config
    from rlsched.policies.draft import PolicyContext, make_draft_policy
    from rlsched.policies.realloc import make_realloc_policy
    from rlsched.sim.output import run_and_write

    overrides = list(set_) + ([f"seed={seed}"] if seed is not None else [])
    if seed is not None and seed < 0:
        raise UserError(f"--seed must be >= 0 (got {seed})")
    cfg = load_config(preset, config, overrides)
    pol = policy or cfg.speculation.policy
    make_draft_policy(pol, PolicyContext(None, tuple(d.name for d in cfg.drafters), cfg.speculation.k_max))
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


def main() -> None:
    try:
        app()
    except UserError as e:
        err_console.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except KeyboardInterrupt:
        err_console.print("interrupted; nothing written")
        sys.exit(130)


if __name__ == "__main__":
    main()
