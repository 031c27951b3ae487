"""Policy files: versioned JSON that `rlsched learn` writes and every engine reads.

A file holds the policy's kind and parameters, the reallocation settings learned with it,
what it was learned on (model, hardware, drafters, cost model, workload) and how. Files of
another format version, or learned for another model, hardware or drafter, are refused with
the reason, never half-applied.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from rlsched.atomic import write_text_atomic
from rlsched.errors import UserError, describe_validation_error
from rlsched.policies.tree import max_nodes

FORMAT: Final = "rlsched-policy"
PolicyKind = Literal["table", "twostate"]  # the policies a file holds
VERSION = 1
IDENTITY_KEYS = ("model", "hardware", "tp")
SHAPE_KEYS = ("hidden", "layers", "heads", "kv_heads", "vocab")  # a model's architecture, for the executor


class ReallocSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    policy: str = "none"
    threshold: int = 16


class PolicyFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: Literal["rlsched-policy"]
    version: int
    kind: PolicyKind
    drafter: str
    params: dict
    realloc: ReallocSettings = ReallocSettings()
    learned_on: dict = {}
    created: dict = {}

    @field_validator("drafter")
    @classmethod
    def _printable(cls, v: str) -> str:
        if not v or not v.isprintable():
            raise ValueError("the drafter's name must be printable text on one line")
        return v

    @model_validator(mode="after")
    def _params(self):
        p = self.params
        if self.kind == "twostate":
            if not (_whole(p.get("max_batch_on"), 0) and _whole(p.get("k"), 1, 32)):
                raise ValueError("twostate params need whole numbers max_batch_on >= 0 and k in 1..32")
            tree = "width" in p or "nodes" in p
            if tree and not (_whole(p.get("width"), 2, 16) and _tree_nodes(p["k"], p["width"], p.get("nodes"))):
                raise ValueError(
                    "a twostate tree needs whole numbers width in 2..16 and nodes in k..256, "
                    "at most the full tree's (width + width^2 + ... + width^k)"
                )
        else:
            be, ae, k = p.get("batch_edges"), p.get("accept_edges"), p.get("k")
            if not (
                isinstance(be, list)
                and be
                and all(_whole(b, 1) for b in be)
                and be[0] == 1
                and all(b < c for b, c in zip(be, be[1:]))
            ):
                raise ValueError("table params.batch_edges must be whole numbers rising strictly from 1")
            if not (
                isinstance(ae, list)
                and len(ae) >= 2
                and all(_number(a) for a in ae)
                and ae[0] == 0
                and ae[-1] == 1
                and all(a < b for a, b in zip(ae, ae[1:]))
            ):
                raise ValueError("table params.accept_edges must be numbers rising strictly from 0 to 1")
            ce = p.get("ctx_edges")
            if ce is None:  # one context bucket: k is acceptance x batch
                if not (
                    isinstance(k, list)
                    and len(k) == len(ae) - 1
                    and all(isinstance(r, list) and len(r) == len(be) for r in k)
                    and all(_cell(x) for r in k for x in r)
                ):
                    raise ValueError(
                        f"table params.k must be {len(ae) - 1} rows of {len(be)} cells: whole numbers "
                        "in 0..32 (a chain's k) or [k, width, nodes] (a tree, nodes at most the full tree's)"
                    )
            else:
                if not (
                    isinstance(ce, list)
                    and ce
                    and all(_whole(c, 0) for c in ce)
                    and ce[0] == 0
                    and all(a < b for a, b in zip(ce, ce[1:]))
                ):
                    raise ValueError("table params.ctx_edges must be whole numbers rising strictly from 0")
                if not (
                    isinstance(k, list)
                    and len(k) == len(ae) - 1
                    and all(isinstance(pl, list) and len(pl) == len(ce) for pl in k)
                    and all(isinstance(r, list) and len(r) == len(be) for pl in k for r in pl)
                    and all(_cell(x) for pl in k for r in pl for x in r)
                ):
                    raise ValueError(
                        f"table params.k must be {len(ae) - 1} x {len(ce)} rows of {len(be)} "
                        "cells (acceptance x context x batch): whole numbers in 0..32 (a chain's k) "
                        "or [k, width, nodes] (a tree, nodes at most the full tree's)"
                    )
        return self


_FIELDS = {"": PolicyFile.model_fields, "realloc.": ReallocSettings.model_fields}


def _cell(x) -> bool:
    """A table cell: a chain's k (0: off) or a tree [k, width, nodes]."""
    if isinstance(x, list):
        return len(x) == 3 and _whole(x[0], 1, 32) and _whole(x[1], 2, 16) and _tree_nodes(x[0], x[1], x[2])
    return _whole(x, 0, 32)


def _tree_nodes(k: int, width: int, nodes) -> bool:
    """Whether a tree k deep and width wide can verify `nodes` drafts (k up to the full tree's, at most 256)."""
    return _whole(nodes, k, min(256, max_nodes(k, width)))


def _whole(x, lo: int, hi: int | None = None) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= lo and (hi is None or x <= hi)


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def save_policy_file(path: Path, pf: PolicyFile) -> None:
    """Write atomically: the file is whole or absent."""
    write_text_atomic(Path(path), pf.model_dump_json(indent=2))


def load_policy_file(path, identity: dict | None = None, kinds=("table", "twostate")) -> PolicyFile:
    """Read and check a policy file; `identity` (model, hardware, tp, drafters) of the config
    it will run on, when known."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"policy file '{path}' does not exist; write one with `rlsched learn --out {path}`")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        why = "nested too deep" if isinstance(e, RecursionError) else str(e)
        raise UserError(f"policy file '{path}' is not valid JSON ({why}); re-create it with `rlsched learn`") from None
    except OSError as e:
        raise UserError(f"policy file '{path}' cannot be read ({e.strerror or e}); check its permissions") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise UserError(f'policy file \'{path}\' is not an rlsched policy file (no "format": "{FORMAT}")')
    if data.get("version") != VERSION:
        raise UserError(
            f"policy file '{path}' has format version {data.get('version')!r}, this rlsched reads "
            f"version {VERSION}; re-learn it with `rlsched learn`"
        )
    for fields, where in ((data, ""), (data.get("realloc"), "realloc.")):
        unknown = [k for k in fields if k not in _FIELDS[where]] if isinstance(fields, dict) else []
        if unknown:
            name = f"{where}{unknown[0]}"
            name = f"'{name}'" if name.isprintable() else repr(name)
            raise UserError(f"policy file '{path}' has an unknown field {name}; re-create it with `rlsched learn`")
    try:
        pf = PolicyFile.model_validate(data)
    except ValidationError as e:
        raise UserError(f"policy file '{path}': {describe_validation_error(e)}") from None
    if pf.kind not in kinds:
        raise UserError(f"policy file '{path}' holds a '{pf.kind}' policy, expected {' or '.join(kinds)}")
    if identity:
        mine = {k: identity.get(k) for k in IDENTITY_KEYS if identity.get(k) is not None}
        theirs = {k: pf.learned_on.get(k) for k in mine}
        if mine != theirs:
            raise UserError(
                f"policy file '{path}' was learned for {_describe(theirs)}, but this config runs "
                f"{_describe(mine)}; re-learn it with `rlsched learn` on this config"
            )
        drafters = identity.get("drafters")
        if drafters is not None and pf.drafter not in drafters:
            raise UserError(
                f"policy file '{path}' drafts with '{pf.drafter}', which this config lacks "
                f"(drafters: {', '.join(drafters) or 'none'})"
            )
    return pf


def learned_shape(pf: PolicyFile) -> dict | None:
    """The architecture of the model a policy file was learned for: with a fitted cost model,
    the one it was measured on (a profile or a run records it), else the simulated model's;
    None where the file does not say."""
    cost = pf.learned_on.get("cost_model")
    if isinstance(cost, dict) and cost.get("kind") == "fitted":
        shape = cost.get("model_shape")
    else:
        shape = pf.learned_on.get("model_shape")
    return {k: shape.get(k) for k in SHAPE_KEYS} if isinstance(shape, dict) else None


def check_model_shape(pf: PolicyFile, path, shape: dict, model: str) -> None:
    """Refuse a policy file learned for a model of another architecture than `model` (a
    folder the executor runs, of architecture `shape`); files that record none pass."""
    theirs = learned_shape(pf)
    mine = {k: shape.get(k) for k in SHAPE_KEYS}
    if theirs is not None and theirs != mine:
        name = pf.learned_on.get("model")
        raise UserError(
            f"policy file '{path}' was learned for another model ({_shape(theirs)}"
            f"{f', {_shown(name)}' if name else ''}) than {model} ({_shape(mine)}); re-learn it with "
            "`rlsched learn --cost` on costs fitted to this model (`rlsched fit`)"
        )


def _shown(value) -> str:
    """A value read from a file, for a one-line message: printable text as it is, else its repr."""
    return value if isinstance(value, str) and value.isprintable() else repr(value)


def _shape(shape: dict) -> str:
    return " ".join(f"{k} {_shown(shape.get(k))}" for k in SHAPE_KEYS)


def _describe(ident: dict) -> str:
    return ", ".join(f"{k} {_shown(ident.get(k))}" for k in IDENTITY_KEYS if k in ident)
