"""Model and output folders: which folder a model spec names, what a model folder says about
itself, whether a drafter fits a target, and whether an `--out` may be written."""

from __future__ import annotations

import json
from pathlib import Path

from rlsched.errors import UserError


def resolve_model_dir(spec: str, which: str, log=None) -> Path:
    """A model folder; 'builtin' is the built-in pair's target (or drafter)."""
    if spec == "builtin":
        from rlsched.executor.model.builtin import builtin_pair

        pair = builtin_pair(log=log)
        return pair.target if which == "target" else pair.drafter
    return Path(spec)


def eos_id(folder: Path) -> int | None:
    """The end-of-sequence id from config.json (the first, when it lists several)."""
    raw = json.loads((Path(folder) / "config.json").read_text())
    eos = raw.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return eos if isinstance(eos, int) else None


def pad_id(folder: Path) -> int:
    """The padding id from config.json; else the end-of-sequence id; else 0."""
    pad = json.loads((Path(folder) / "config.json").read_text()).get("pad_token_id")
    if isinstance(pad, int):
        return pad
    eos = eos_id(folder)
    return eos if eos is not None else 0


def check_drafter_vocab(target, drafter, target_dir: Path, drafter_dir: Path) -> None:
    """A model drafter must share the target's vocabulary (size and tokenizer)."""
    tv, dv = target.config.vocab_size, drafter.config.vocab_size
    if tv != dv:
        raise UserError(
            f"drafter {drafter_dir} has a vocabulary of {dv} tokens, the target {target_dir} "
            f"{tv}; a model drafter must share the target's tokenizer"
        )
    if (
        target.tokenizer is not None
        and drafter.tokenizer is not None
        and target.tokenizer.get_vocab() != drafter.tokenizer.get_vocab()
    ):
        raise UserError(
            f"drafter {drafter_dir} has a different tokenizer vocabulary from the target "
            f"{target_dir}; a model drafter must share the target's tokenizer"
        )


def prepare_out(out: Path, marker: str = "summary.json", command: str = "generate") -> None:
    """Refuse an --out that is a file, or a non-empty folder that is not an earlier output of
    `command` (one holding `marker`, or `traces/` from a run that was killed); such an
    output is replaced only after every input has been checked."""
    if out.exists():
        if not out.is_dir():
            raise UserError(f"--out {out} is a file; give a folder")
        if any(out.iterdir()) and not (out / marker).is_file() and not (out / "traces").is_dir():
            raise UserError(
                f"--out {out} is a non-empty folder that is not an earlier {command} output; give a new or empty folder"
            )
