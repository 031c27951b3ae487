"""One command at a time per output folder: `rlsched run`, `generate` and `profile` hold a lock
on their `--out` while they check, fill and replace it.

The lock is `fcntl.flock` on a file `.NAME.lock` beside the folder `NAME` (in its parent), not
inside it:

- it works for a folder that does not exist yet (the lock comes before any look at the folder,
  so two commands started at the same instant cannot both find it free);
- `generate` and `profile` replace their folder whole (`rlsched.atomic.atomic_folder` renames a
  filled temporary over it) and a fresh `run` removes an earlier finished one: a lock file inside
  would vanish with the folder it guards;
- a snapshot of the folder shows only what the command wrote.

The kernel drops a flock when its holder dies (kill -9 included), so a lock file left by a dead
process is free: the next command takes it over. The holder writes "PID COMMAND" into the file
for a refused command to name. On release the holder removes the file while still holding it;
a command that opened the file just before and is granted the lock after would then hold an
unlinked file, so after every flock the path must still name the same file, else it tries
again. Parent folders created for the lock file are removed on release when they are still
empty, so a command refused under the lock leaves nothing behind.

Locks are per process and counted: taking one this process already holds succeeds (a command
may take it at its start and a function it calls again). `hold` keeps one until the process
ends.
"""

from __future__ import annotations

import atexit
import fcntl
import os
import time
from pathlib import Path

from rlsched.errors import UserError

_HELD: dict[Path, FolderLock] = {}  # lock file -> the lock this process holds on it


def lock_path(out: Path) -> Path:
    """The lock file of the output folder `out`: `.NAME.lock` beside it (symlinks resolved, so
    two spellings of one folder share a lock)."""
    folder = Path(out).resolve()
    if not folder.name:
        raise UserError(f"--out {out} is the file system's root; give a folder")
    return folder.parent / f".{folder.name}.lock"


class FolderLock:
    """The lock on one output folder, taken by `acquire` (refused with a UserError while another
    live process holds it) and given back by `release`; also a context manager."""

    def __init__(self, out: Path, command: str):
        self.out, self.command = Path(out), command
        self.path = lock_path(out)
        self._fd: int | None = None
        self._count = 0
        self._pid = os.getpid()
        self._created: list[Path] = []  # parent folders made for the lock file, deepest first
        self._owner: FolderLock | None = None  # the lock this process took first, when this is a second hold

    @property
    def held(self) -> bool:
        return self._owner is not None or self._count > 0

    def acquire(self) -> FolderLock:
        """Take the lock, or raise UserError naming the folder and the holder's pid."""
        owner = _HELD.get(self.path)
        if owner is not None and owner._pid == os.getpid():  # this process holds it already
            if owner is not self:
                self._owner = owner
            owner._count += 1
            return self
        for _ in range(1000):  # each retry follows a release or a removed parent: never many
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                self._remove_created()
                raise UserError(
                    f"--out {self.out} is in use by {holder}; wait for it to end or give another --out"
                ) from None
            if _same_file(fd, self.path):
                break
            os.close(fd)  # the holder released and removed it between our open and flock: again
        else:  # pragma: no cover - a file removed under us a thousand times in a row
            raise UserError(f"--out {self.out}: cannot take its lock {self.path}; try again")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {self.command}\n".encode(), 0)
        self._fd, self._count, self._pid = fd, 1, os.getpid()
        _HELD[self.path] = self
        return self

    def release(self) -> None:
        """Give one hold back; the last of this process's holds removes the file."""
        if self._owner is not None:
            owner, self._owner = self._owner, None
            owner.release()
            return
        if self._count == 0:
            return
        self._count -= 1
        if self._count > 0 or self._fd is None:
            return
        _HELD.pop(self.path, None)
        if self._pid == os.getpid():  # a forked child never removes its parent's lock
            try:
                if _same_file(self._fd, self.path):
                    self.path.unlink()
            except OSError:
                pass
            self._remove_created()
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> FolderLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    # --- helpers ---------------------------------------------------------------------------

    def _open(self) -> int:
        """The lock file opened (created, with its missing parents, when absent)."""
        for _ in range(100):
            self._make_parents()
            try:
                return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except FileNotFoundError:
                continue  # an empty parent removed by another command's release: make it again
            except OSError as e:
                self._remove_created()
                raise UserError(
                    f"--out {self.out}: cannot write its lock file {self.path} ({e.strerror}); "
                    "give an --out in a folder you may write to"
                ) from None
        raise UserError(f"--out {self.out}: its folder {self.path.parent} keeps vanishing; try again")

    def _make_parents(self) -> None:
        cur = self.path.parent
        missing = []
        while not os.path.lexists(cur) and cur != cur.parent:
            missing.append(cur)
            cur = cur.parent
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(
                f"--out {self.out}: cannot create its folder {self.path.parent} ({e.strerror}); "
                "give an --out in a folder you may write to"
            ) from None
        self._created = missing + [d for d in self._created if d not in missing]

    def _remove_created(self) -> None:
        for d in self._created:  # deepest first; one that holds something stays, with its parents
            try:
                d.rmdir()
            except OSError:
                break
        self._created = []


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _read_holder(fd: int) -> str:
    """'rlsched COMMAND (pid PID)' from the held lock file; its holder writes it right after
    taking the lock, so an empty file is read again for a moment."""
    for _ in range(40):
        text = os.pread(fd, 200, 0).decode(errors="replace").split()
        if len(text) >= 2 and text[0].isdigit():
            return f"rlsched {text[1]} (pid {text[0]})"
        time.sleep(0.05)
    return "another process (pid unknown)"


def hold(out: Path, command: str) -> FolderLock:
    """Take the lock on `out` for the rest of this process (given back when it exits, or by
    `release`); a UserError naming the folder and the holder's pid while another holds it."""
    return FolderLock(out, command).acquire()


@atexit.register
def _release_all() -> None:
    for lock in list(_HELD.values()):
        if lock._pid == os.getpid():
            while lock.held:
                lock.release()
