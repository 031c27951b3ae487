"""What every command shares: the typer app, the consoles, the common options and helpers,
and `main`, which turns a UserError into one line and exit code 2."""

from __future__ import annotations

import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

from rlsched import __version__
from rlsched.errors import UserError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Adaptive speculative decoding and sample reallocation for RL rollouts: simulate, compare "
    "and learn policies; generate, profile and train (run) with the real engine; fit, replay, plot "
    "and report from what it measured.",
)
out_console = Console()
err_console = Console(stderr=True)


def _version(value: bool):
    if value:
        print(f"rlsched {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
):
    pass


PresetOpt = typer.Option(
    None, "--preset", "-p", help="A shipped job preset (see `rlsched presets`); default: 'default'."
)
ConfigOpt = typer.Option(None, "--config", "-c", help="A YAML or TOML config file.")
SetOpt = typer.Option([], "--set", "-s", help="Override a config field: path.to.field=value (repeatable).")
JsonOpt = typer.Option(False, "--json", help="Print only a JSON summary on stdout; progress and logs go to stderr.")
CostOpt = typer.Option(
    None,
    "--cost",
    help="A fitted cost-model file (`rlsched fit`): verify, draft and prefill "
    "step times come from it instead of the analytic roofline of the config's model and hardware. "
    "They are the costs of the machine and models that were profiled, whatever those presets say; "
    "the presets still set KV capacity, KV transfer between instances and the RL step's other "
    "stages (inference, training). The config's drafters must be named as the fitted ones "
    "(e.g. 'model'). Sets the config's cost_file.",
)


def _with_cost(cfg, cost: Path | None):
    """The config with --cost applied, its cost model loaded once to check the file (one line
    on stderr says where the step costs come from)."""
    from rlsched.costs.choose import cost_model_for

    if cost is not None:
        cfg = cfg.model_copy(update={"cost_file": str(cost.resolve())})
    model = cost_model_for(cfg)
    if cfg.cost_file is not None:
        d = model.describe()
        err_console.print(
            f"step costs: fitted ({cfg.cost_file}: {d.get('model') or 'model ?'} on "
            f"{d.get('machine') or 'machine ?'}); KV capacity and transfer, inference and training: "
            f"{cfg.model.name} on {cfg.hardware.name}",
            highlight=False,
            soft_wrap=True,
        )
    return cfg


def _need_executor(command: str) -> None:
    """The executor commands need torch (the `executor` extra); say so in one line."""
    import importlib.util

    for module in ("torch", "safetensors", "tokenizers"):
        if importlib.util.find_spec(module) is None:
            raise UserError(
                f"`rlsched {command}` needs the executor extra ({module} is missing): pip install 'rlsched[executor]'"
            )


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
