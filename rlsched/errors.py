"""One exception type for bad user input, and its one-line rendering.

Every command turns a `UserError` (and pydantic's ValidationError) into a single line on
stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a type only: the engine runs where pydantic is not installed (the GPU image)
    from pydantic import ValidationError


def printable(text: str) -> str:
    """`text` with every character that does not print (a newline, a control character, a lone
    surrogate) written as its escape, so that a name taken from the user stays on one line."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape", "backslashreplace").decode() for c in text)


class UserError(Exception):
    """Bad input from the user: a config, a CLI value, a file. The message names the field
    and the fix, in one line (whatever the user's names hold, see `printable`)."""

    def __init__(self, message: str = ""):
        super().__init__(printable(str(message)))


def _loc(loc: tuple, data=None) -> str:
    """The dotted path of a field as the user spells it (--set takes it): without pydantic's
    validator names, and, where the data is given, without the tags of a union (a length's
    `lognormal`), which are no keys of the data."""
    parts = []
    node = data
    for i, p in enumerate(loc):
        if isinstance(p, str) and p.startswith("function-"):
            continue
        if isinstance(node, dict):
            if p not in node and i < len(loc) - 1:
                continue  # a union's tag (a missing field is the last part)
            node = node.get(p)
        elif isinstance(node, list) and isinstance(p, int) and 0 <= p < len(node):
            node = node[p]
        else:
            node = None
        parts.append(str(p))
    return ".".join(parts)


def describe_validation_error(err: ValidationError, prefix: str = "", data=None) -> str:
    """The first problem of a pydantic error as one line: field, what is wrong, the value.
    `data` (what was validated) lets the field be named as the user spells it."""
    first = err.errors()[0]
    loc = tuple(first["loc"])
    if prefix:
        loc = tuple(prefix.split(".")) + loc
        data = None
    where = _loc(loc, data)
    if first["type"] == "extra_forbidden":
        return f"unknown field '{where}'; check its spelling (`rlsched presets --show NAME` prints a full config)"
    if first["type"] == "missing":
        return f"missing field '{where}'; add it to the config or pass --set {where}=VALUE"
    msg = first["msg"]
    for lead in ("Value error, ", "Assertion failed, "):
        msg = msg.removeprefix(lead)
    if first["type"] == "finite_number":
        msg = "give a finite number (NaN and infinity have no meaning here)"
    value = first.get("input")
    shown = "" if isinstance(value, (dict, list)) or value is None else f" (got {value!r})"
    more = len(err.errors()) - 1
    tail = f"; {more} more problem(s) after this one" if more > 0 else ""
    return f"invalid field '{where}': {msg}{shown}{tail}"
