"""Files and folders written whole or not at all: a temporary sibling, renamed into place.

Every writer of rlsched's outputs (traces, summaries, policy files, figures, model folders,
checkpoints) goes through these, so a killed process never leaves a half-written file.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_path(path: Path, fsync: bool = False):
    """Yield a temporary sibling path of `path` for any writer to fill (pyarrow, matplotlib,
    torch); when the block ends it replaces `path` whole, on any error it vanishes. `fsync`
    also survives power loss."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        if fsync:
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; outputs are for everyone to read
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
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
    previous folder of that name is removed), on any error it vanishes: never half-written."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    umask = os.umask(0)
    os.umask(umask)
    try:
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; a plain folder is what `--out` promises
        yield tmp
        old = None
        if out.exists():
            old = out.with_name(f".{out.name}.old-{tmp.name[-8:]}")
            out.rename(old)
        tmp.rename(out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
