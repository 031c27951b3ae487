"""What every command shares: the typer app, the consoles, the common options and helpers,
and `main`, which turns a UserError into one line and exit code 2."""

from __future__ import annotations

import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.text import Text

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
# what is printed is plain text: a policy such as twostate:a:b or a path with [brackets] is shown
# as written, never read as an emoji code or as markup
out_console = Console(emoji=False, markup=False)
err_console = Console(stderr=True, emoji=False, markup=False)


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


def _os_error_line(e: OSError) -> str:
    """A file that could not be written or read, in one line: the path, why, what to do."""
    import errno

    from rlsched.atomic import NO_ROOM

    path = e.filename
    why = e.strerror or str(e)
    if e.errno in NO_ROOM:
        fix = "free disk space, or give an --out on a disk with room"
    elif e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        fix = "check its permissions, or give an --out in a folder you may write to"
    elif e.errno in (errno.ENOENT, errno.ENOTDIR):
        fix = "check that the path and every folder above it exist (and are folders)"
    elif e.errno == errno.EISDIR:
        fix = "it is a folder; give a file"
    else:
        fix = "check the path, or give another --out"
    return f"cannot use '{path}': {why}; {fix}"


def _error(message: str) -> None:
    err_console.print(Text.assemble(("error:", "bold red"), " ", message), highlight=False, soft_wrap=True)


def main() -> None:
    """Run the command; bad input (a UserError) and a file that cannot be written or read (an
    OSError naming it) end as one line on stderr and exit code 2. Anything else is a bug and
    keeps its traceback."""
    try:
        app()
    except UserError as e:
        _error(str(e))
        sys.exit(2)
    except OSError as e:
        if e.filename is None:
            raise
        _error(_os_error_line(e))
        sys.exit(2)
    except KeyboardInterrupt:
        err_console.print("interrupted; nothing written")
        sys.exit(130)
