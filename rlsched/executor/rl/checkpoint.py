"""Checkpoints written whole or not at all: a run killed at any moment resumes from the last
complete one."""

from __future__ import annotations

from pathlib import Path

import torch

from rlsched.errors import UserError


def save_checkpoint(path: Path, state: dict) -> None:
    """torch.save to a temporary sibling, fsync, then rename over `path`."""
    from rlsched.traces.writer import atomic_file

    with atomic_file(path, "wb", fsync=True) as f:
        torch.save(state, f)


def load_checkpoint(path: Path) -> dict:
    """The checkpoint's state (it holds pickled policy objects: load only your own runs)."""
    try:
        return torch.load(Path(path), weights_only=False)
    except Exception as e:  # a foreign or damaged file: say which and why
        raise UserError(f"checkpoint {path} cannot be read ({type(e).__name__}: {str(e).splitlines()[0]}); "
                        "start a new run with another --out") from None
