"""A run's state and its checkpoints: what a checkpoint holds, written whole or not at all,
and resuming from it (a run killed at any moment continues from the last complete one).

A checkpoint holds the config, the next step, the TrainState (actor, critic, model drafter,
their optimizers, the replay buffer, the drafter schedule, the random states) and the rollout
backend's `policy_state()` (its draft policy, acceptance estimates and n-gram history, per
instance for a pool). On resume, records of steps past the checkpoint are dropped from the
traces and rollouts first.
"""

from __future__ import annotations

import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from rlsched.errors import UserError

CHECKPOINT = "checkpoint.pt"
SUMMARY = "summary.json"  # a finished run's summary
VERSION = 2


@dataclass
class TrainState:
    """What training changes, besides what the rollout backend learns."""

    actor: torch.nn.Module
    actor_opt: torch.optim.Optimizer
    critic: torch.nn.Module | None  # PPO's
    critic_opt: torch.optim.Optimizer | None
    drafter_model: torch.nn.Module | None  # a model drafter's
    drafter_opt: torch.optim.Optimizer | None
    buffer: Any  # distill.ReplayBuffer
    schedule: Any  # policies.drafter_schedule.DrafterSchedule
    generator: torch.Generator  # the rollouts' sampling

    def state_dict(self, config: dict, next_step: int, backend_state) -> dict:
        def sd(x):
            return None if x is None else x.state_dict()

        return dict(
            version=VERSION,
            next_step=next_step,
            config=config,
            actor=sd(self.actor),
            actor_opt=sd(self.actor_opt),
            critic=sd(self.critic),
            critic_opt=sd(self.critic_opt),
            drafter=sd(self.drafter_model),
            drafter_opt=sd(self.drafter_opt),
            backend=backend_state,
            buffer=self.buffer.state(),
            drafter_schedule=self.schedule.state(),
            rng=dict(torch=torch.get_rng_state(), generator=self.generator.get_state()),
        )

    def load_state_dict(self, s: dict) -> None:
        self.actor.load_state_dict(s["actor"])
        self.actor_opt.load_state_dict(s["actor_opt"])
        if self.critic is not None:
            self.critic.load_state_dict(s["critic"])
            self.critic_opt.load_state_dict(s["critic_opt"])
        if self.drafter_model is not None:
            self.drafter_model.load_state_dict(s["drafter"])
            self.drafter_opt.load_state_dict(s["drafter_opt"])
        self.schedule.load(s.get("drafter_schedule"))
        self.buffer.load(s["buffer"])
        torch.set_rng_state(s["rng"]["torch"])
        self.generator.set_state(s["rng"]["generator"])


def save_checkpoint(path: Path, state: dict) -> None:
    """torch.save to a temporary sibling, fsync, then rename over `path`."""
    from rlsched.atomic import atomic_file

    with atomic_file(path, "wb", fsync=True) as f:
        torch.save(state, f)


# what torch.load raises on a file that is not a whole checkpoint (truncated, overwritten, foreign)
_UNREADABLE = (
    pickle.UnpicklingError,
    RuntimeError,  # a damaged zip archive
    EOFError,
    ValueError,
    OSError,
    MemoryError,  # a garbage length field
    ImportError,  # a pickle of classes this install lacks
    AttributeError,
    KeyError,
    IndexError,
    TypeError,
    OverflowError,
)
_START_AGAIN = "delete it to restart the run from step 0 with --resume, or start a new run with another --out"


def _reason(e: BaseException) -> str:
    text = (str(e).strip().splitlines() or [""])[0].split(". ")[0]
    return f"{type(e).__name__}: {text[:120]}" if text else type(e).__name__


def load_checkpoint(path: Path) -> dict:
    """The checkpoint's state (it holds pickled policy objects: load only your own runs)."""
    try:
        state = torch.load(Path(path), weights_only=False)
    except _UNREADABLE as e:  # a foreign or damaged file: say which and why
        raise UserError(f"checkpoint {path} cannot be read ({_reason(e)}); {_START_AGAIN}") from None
    if not isinstance(state, dict):
        raise UserError(f"checkpoint {path} holds a {type(state).__name__}, not a run's state; {_START_AGAIN}")
    return state


def restore(out: Path, config: dict, state: TrainState) -> tuple[int, Any]:
    """Load `out`'s checkpoint into `state`: (the step to resume at, the backend's policy
    state). (0, None) when the run wrote none yet."""
    path = Path(out) / CHECKPOINT
    if not path.is_file():
        return 0, None
    s = load_checkpoint(path)
    if s.get("version") != VERSION:
        raise UserError(
            f"--resume: {path} was written by another version of rlsched (checkpoint version "
            f"{s.get('version')}, this one reads {VERSION}); start a new run with another --out"
        )
    if s.get("config") != config:
        raise UserError(
            f"--resume: {path} was written with another config; resume with "
            "the run's own config.yaml (no --config, --policy or --set)"
        )
    try:
        state.load_state_dict(s)
        next_step = int(s["next_step"])
    except (KeyError, TypeError, ValueError, RuntimeError) as e:  # a hand-made or damaged state
        raise UserError(f"--resume: {path} is not a whole run state ({_reason(e)}); {_START_AGAIN}") from None
    return next_step, s.get("backend")


def rewind_out(out: Path, next_step: int) -> None:
    """Drop what a killed run wrote past its checkpoint: trace records and rollouts of steps
    from `next_step` on, and the summary. A trace that cannot be read is one UserError naming
    its file, raised before any trace or rollout is rewritten or removed."""
    out = Path(out)
    truncate_traces(out / "traces", next_step)
    for f in (out / "rollouts").glob("step-*.parquet"):
        number = f.stem.split("-", 1)[1]
        if number.isdigit() and int(number) >= next_step:
            f.unlink()
    (out / SUMMARY).unlink(missing_ok=True)


KINDS = ("steps", "samples", "rl_steps")


def truncate_traces(root: Path, next_step: int) -> None:
    """Keep only the records of steps before `next_step` (those the checkpoint covers): one
    part per kind, swapped in as a whole folder (a crash mid-way is repaired on the next call).
    Every kind is read before any is rewritten."""
    from rlsched.traces.reader import read_trace
    from rlsched.traces.writer import to_table, write_table

    if not root.is_dir():
        return
    kept = {}
    for kind in KINDS:
        folder, new, old = root / kind, root / f".{kind}.new", root / f".{kind}.old"
        if not folder.exists() and new.exists():  # a crash between the two renames below
            new.rename(folder)
        shutil.rmtree(old, ignore_errors=True)
        shutil.rmtree(new, ignore_errors=True)
        if folder.is_dir():
            df = read_trace(folder, kind) if any(folder.iterdir()) else pd.DataFrame()
            kept[kind] = df[df["rl_step"] < next_step] if len(df) else df
    for kind, keep in kept.items():
        folder, new, old = root / kind, root / f".{kind}.new", root / f".{kind}.old"
        new.mkdir()
        if len(keep):
            write_table(new / "part-000000.parquet", to_table(kind, keep.reset_index(drop=True)))
        folder.rename(old)
        new.rename(folder)
        shutil.rmtree(old, ignore_errors=True)
