"""One exception type for bad user input, and its one-line rendering.

Every command turns a `UserError` (and pydantic's ValidationError) into a single line on
stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a type only: the engine runs where pydantic is not installed (the GPU image)
    from pydantic import ValidationError


class UserError(Exception):
    """Bad input from the user: a config, a CLI value, a file. The message names the field
    and the fix, in one line."""


def _loc(loc: tuple) -> str:
    return ".".join(str(p) for p in loc if not (isinstance(p, str) and p.startswith("function-")))


def describe_validation_error(err: ValidationError, prefix: str = "") -> str:
    """The first problem of a pydantic error as one line: field, what is wrong, the value."""
    first = err.errors()[0]
    loc = _loc(tuple(prefix.split(".")) + tuple(first["loc"]) if prefix else tuple(first["loc"]))
    if first["type"] == "extra_forbidden":
        return f"unknown field '{loc}'; check its spelling (`rlsched presets --show NAME` prints a full config)"
    if first["type"] == "missing":
        return f"missing field '{loc}'; add it to the config or pass --set {loc}=VALUE"
    msg = first["msg"]
    for lead in ("Value error, ", "Assertion failed, "):
        msg = msg.removeprefix(lead)
    value = first.get("input")
    shown = "" if isinstance(value, (dict, list)) or value is None else f" (got {value!r})"
    more = len(err.errors()) - 1
    tail = f"; {more} more problem(s) after this one" if more > 0 else ""
    return f"invalid field '{loc}': {msg}{shown}{tail}"
