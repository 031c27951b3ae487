"""Model and output folders: which folder a model spec names, what a model folder says about
itself, whether a drafter fits a target, whether an `--out` may be written, the temporaries a
killed write left in it, and writes that fail for want of room."""

from __future__ import annotations

import errno
import glob
import json
import os
import re
import shutil
from contextlib import contextmanager
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


# --- what a killed write leaves ----------------------------------------------------------------

# rlsched.atomic's temporaries: files `.NAME.XXXXXXXX.tmp` (atomic_path), folders
# `.NAME.tmp-XXXXXXXX` (atomic_folder's new folder) and `.NAME.old-XXXXXXXX` (the folder it replaces)
_TMP_FILE = re.compile(r"^\.(?P<name>.+)\.[a-z0-9_]{8}\.tmp$")
_TMP_FOLDER = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-[a-z0-9_]{8}$")


def is_leftover(path: Path, of: str | None = None) -> bool:
    """Whether `path` is a temporary of rlsched.atomic (what a write killed mid-way leaves), of
    the file or folder named `of` when given."""
    if path.is_symlink():
        return False
    m = _TMP_FILE.match(path.name) if path.is_file() else None
    if path.is_dir():
        m = _TMP_FOLDER.match(path.name)
    return m is not None and (of is None or m["name"] == of)


def _clear(path: Path) -> None:
    """Remove a leftover; a replaced folder (`.NAME.old-*`) whose successor never arrived is
    put back as NAME instead."""
    m = _TMP_FOLDER.match(path.name)
    if m is not None and m["kind"] == "old" and not (path.parent / m["name"]).exists():
        path.rename(path.parent / m["name"])
    elif path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def remove_leftovers(out: Path, siblings: bool = False) -> list[Path]:
    """Remove the temporaries killed writes left anywhere inside the folder `out` (and, with
    `siblings`, those of `out` itself beside it: `.OUT.tmp-*`); the folder's lock must be held,
    so that no live writer owns them. Returns what was removed."""
    out = Path(out)
    found = []
    if siblings and out.parent.is_dir():
        found += [p for p in out.parent.glob(f".{glob.escape(out.name)}.*") if is_leftover(p, out.name)]
    if out.is_dir():
        for dirpath, dirnames, filenames in os.walk(out):
            here = Path(dirpath)
            for name in list(dirnames):
                if is_leftover(here / name):
                    found.append(here / name)
                    dirnames.remove(name)
            found += [here / name for name in filenames if is_leftover(here / name)]
    for p in found:
        _clear(p)
    return found


# --- a write that fails for want of room or permission -----------------------------------------

NO_ROOM = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}  # a full disk, a quota, a file-size limit
READ_ONLY = {errno.EROFS, errno.EACCES, errno.EPERM}


class WriteFailed(Exception):
    """A write to `path` failed for want of room (`no_room`) or of permission; `reason` says
    which, in a few words."""

    def __init__(self, path: Path, reason: str, no_room: bool):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason, self.no_room = Path(path), reason, no_room

    @property
    def fix(self) -> str:
        """What the user does about it."""
        return "free space on its disk" if self.no_room else "make it writable"


def write_failure(e: BaseException) -> tuple[str, bool] | None:
    """(reason, whether for want of room) when `e` is a write that failed for want of room or
    permission, else None. torch's checkpoint writer turns the OSError of a failed write into a
    RuntimeError of its stream writer, whose cause it no longer knows: counted as no room."""
    if isinstance(e, OSError):
        code = e.errno
        if code is None:  # pyarrow's errors carry the errno in their message only
            code = next((c for c in NO_ROOM | READ_ONLY if os.strerror(c) in str(e)), None)
        if code in NO_ROOM | READ_ONLY:
            return os.strerror(code), code in NO_ROOM
        return None
    text = str(e)
    if isinstance(e, RuntimeError) and ("PytorchStreamWriter" in text or "unexpected pos" in text):
        return "torch could not write all of it: a full disk or a file-size limit", True
    return None


@contextmanager
def writing(path: Path):
    """Turn a write that fails for want of room or permission into WriteFailed naming the file
    (the OSError's own, else `path`); any other error passes through."""
    try:
        yield
    except WriteFailed:
        raise
    except (OSError, RuntimeError) as e:
        why = write_failure(e)
        if why is None:
            raise
        named = e.filename if isinstance(e, OSError) and e.filename else path
        raise WriteFailed(Path(os.fsdecode(named)), *why) from e
