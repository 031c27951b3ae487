"""Files and folders written whole or not at all: a temporary sibling, renamed into place.

Every writer of rlsched's outputs (traces, summaries, policy files, figures, model folders,
checkpoints) goes through these, so a killed process never leaves a half-written file.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

from rlsched.errors import UserError

# a write that failed for want of room: the disk, the quota, or the process's file-size limit
NO_ROOM = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def json_text(data, indent: int | None = 2) -> str:
    """`data` as JSON text; a NaN or infinity in it is an error (JSON has neither), never
    written."""
    return json.dumps(data, indent=indent, allow_nan=False)


def _nearest_existing(path: Path) -> Path:
    while not os.path.lexists(path) and path != path.parent:
        path = path.parent
    return path


def check_writable(path: Path, option: str = "--out", folder: bool = True) -> None:
    """Refuse, before any work, an output place that cannot be written: `path` (a folder, or a
    file where `folder` is False) is written next to itself, so its nearest existing ancestor
    must be a folder this process may create files in. One UserError line naming `option`, the
    path and the fix."""
    path = Path(path)
    if path.exists() and path.is_dir() != folder:
        what = "a folder; give a file name" if path.is_dir() else "a file; give a folder (or a new name)"
        raise UserError(f"{option} '{path}' is {what}")
    place = _nearest_existing(path.absolute().parent)
    if not place.is_dir():
        raise UserError(
            f"{option} '{path}': '{place}' is a file, not a folder; give an {option} whose parent is a folder"
        )
    try:
        fd, probe = tempfile.mkstemp(dir=place, prefix=".rlsched-probe-")
    except OSError as e:
        raise UserError(
            f"{option} '{path}': cannot write in '{place}' ({e.strerror}); "
            f"give an {option} in a folder you may write to"
        ) from None
    os.close(fd)
    os.unlink(probe)


def _make_parents(folder: Path) -> list[Path]:
    """Create `folder` and its missing ancestors; return the ones created, deepest first."""
    missing = []
    cur = folder.absolute()
    while not os.path.lexists(cur) and cur != cur.parent:
        missing.append(cur)
        cur = cur.parent
    folder.mkdir(parents=True, exist_ok=True)
    return missing


def _remove_created(created: list[Path]) -> None:
    for d in created:  # deepest first; one that something else filled meanwhile stays
        try:
            d.rmdir()
        except OSError:
            break


def _raise_named(e: OSError, path: Path, tmp: Path | str | None = None) -> NoReturn:
    """Raise `e` naming the output: a write error that names no file (a full disk, a failed
    flush) named after `path`, one that names the temporary `tmp` (or a file in it) after the
    place under `path` it was to have, so that what reports it can say where."""
    name = e.filename
    if name is None and e.errno is not None:
        raise OSError(e.errno, os.strerror(e.errno), str(path)) from e
    if tmp is not None and isinstance(name, str) and (name == str(tmp) or name.startswith(f"{tmp}{os.sep}")):
        raise OSError(e.errno, e.strerror, str(path) + name[len(str(tmp)) :]) from e
    raise e


@contextmanager
def atomic_path(path: Path, fsync: bool = False):
    """Yield a temporary sibling path of `path` for any writer to fill (pyarrow, matplotlib,
    torch); when the block ends it replaces `path` whole, on any error it vanishes. `fsync`
    also survives power loss."""
    path = Path(path)
    created = _make_parents(path.parent)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        _remove_created(created)
        raise OSError(e.errno, e.strerror, str(path)) from e
    os.close(fd)
    try:
        yield Path(tmp)
        if fsync:
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; outputs are for everyone to read
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        _remove_created(created)
        _raise_named(e, path, tmp)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        _remove_created(created)
        raise


@contextmanager
def atomic_file(path: Path, mode: str = "w", fsync: bool = False):
    """Yield an open file that replaces `path` whole once the block ends (`atomic_path`)."""
    with atomic_path(path, fsync=fsync) as tmp, open(tmp, mode) as f:
        yield f


def write_text_atomic(path: Path, text: str) -> None:
    """A small text file (JSON, YAML) written whole or not at all."""
    with atomic_file(path) as f:
        f.write(text)


@contextmanager
def atomic_folder(out: Path):
    """Yield a temporary sibling of `out` to fill; on success it replaces `out` whole (a
    previous folder of that name is removed), on any error it vanishes, with the parent
    folders it created: never half-written."""
    out = Path(out)
    created = _make_parents(out.parent)
    try:
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    except OSError as e:
        _remove_created(created)
        raise OSError(e.errno, e.strerror, str(out)) from e
    umask = os.umask(0)
    os.umask(umask)
    try:
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; a plain folder is what `--out` promises
        yield tmp
        old = None
        if out.exists():
            old = out.with_name(f".{out.name}.old-{tmp.name[-8:]}")
            out.rename(old)
        try:
            tmp.rename(out)
        except OSError:
            if old is not None:
                old.rename(out)  # the previous folder stays as it was
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_created(created)
        _raise_named(e, out, tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_created(created)
        raise
