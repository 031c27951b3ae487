"""One command at a time per output folder (`rlsched.locks`), the temporaries killed writes
leave (removed at the next start), and a full disk during `rlsched run` (one line; the folder
removed before the first checkpoint, resumable after it).

The lock's own tests run `rlsched.locks` in child processes and load no model; the end-to-end
ones run the CLI on the built-in pair."""

import errno
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
from support import ok, one_line_error, rlsched, run_then_kill, snapshot

from rlsched.errors import UserError
from rlsched.locks import FolderLock, hold, lock_path

# a child that takes the lock on argv[1], says so on stdout, and holds it until stdin closes
HOLDER = textwrap.dedent(
    """
    import sys
    from rlsched.errors import UserError
    from rlsched.locks import hold
    try:
        hold(sys.argv[1], "run")
    except UserError as e:
        print("refused:", e, flush=True)
        sys.exit(2)
    print("held", flush=True)
    sys.stdin.read()
    """
)


def _holder(out: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(out)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def _end(proc: subprocess.Popen) -> None:
    proc.stdin.close()
    proc.wait(timeout=60)


def test_a_held_folder_is_refused_naming_it_and_the_holders_pid(tmp_path):
    out = tmp_path / "runs" / "a"
    child = _holder(out)
    try:
        assert child.stdout.readline().strip() == "held"
        assert lock_path(out).read_text().split() == [str(child.pid), "run"]
        with pytest.raises(UserError) as refused:
            FolderLock(out, "generate").acquire()
        message = str(refused.value)
        assert str(out) in message and f"pid {child.pid}" in message and "rlsched run" in message
        assert "\n" not in message
    finally:
        _end(child)
    assert not lock_path(out).exists() and not (tmp_path / "runs").exists()  # its folders too: they were empty
    with FolderLock(out, "generate") as lock:  # free once its holder ended
        assert lock.held and lock_path(out).read_text().split() == [str(os.getpid()), "generate"]
    assert not lock_path(out).exists()


def test_a_lock_left_by_a_killed_process_is_taken_over(tmp_path):
    out = tmp_path / "a"
    child = _holder(out)
    assert child.stdout.readline().strip() == "held"
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=60)
    stale = lock_path(out)
    assert stale.read_text().split()[0] == str(child.pid)  # its file stays, its flock went with it
    lock = hold(out, "run")
    try:
        assert stale.read_text().split() == [str(os.getpid()), "run"]
    finally:
        lock.release()
    assert not stale.exists()


def test_of_commands_started_together_exactly_one_holds_the_folder(tmp_path):
    out = tmp_path / "new" / "folder"
    children = [_holder(out) for _ in range(6)]
    try:
        answers = [c.stdout.readline().strip() for c in children]
    finally:
        for c in children:
            _end(c)
    assert answers.count("held") == 1, answers
    holder = children[answers.index("held")].pid
    for a in answers:
        if a != "held":
            assert a.startswith("refused:") and str(out) in a and f"pid {holder}" in a, a
    # released: the lock file went (a parent folder a refused start made may stay, empty)
    assert not lock_path(out).exists() and not [p for p in tmp_path.rglob("*") if not p.is_dir()]


# children that take the lock again and again and log each hold: holds never overlap, even
# while the file is removed and made again between an open and a flock (the inode check)
CHURN = textwrap.dedent(
    """
    import os, sys, time
    from rlsched.errors import UserError
    from rlsched.locks import FolderLock
    held = 0
    while held < 25:
        try:
            lock = FolderLock(sys.argv[1], "run").acquire()
        except UserError:
            continue
        with open(sys.argv[2], "a") as log:
            log.write(f"+{os.getpid()}\\n")
            log.flush()
            time.sleep(0.001)
            log.write(f"-{os.getpid()}\\n")
        lock.release()
        held += 1
    """
)


def test_holds_never_overlap_while_the_lock_file_comes_and_goes(tmp_path):
    out, log = tmp_path / "a", tmp_path / "holds.log"
    children = [subprocess.Popen([sys.executable, "-c", CHURN, str(out), str(log)]) for _ in range(4)]
    for c in children:
        assert c.wait(timeout=300) == 0
    lines = log.read_text().split()
    assert len(lines) == 4 * 25 * 2
    for enter, leave in zip(lines[::2], lines[1::2]):  # every hold ends before the next begins
        assert enter[0] == "+" and leave == "-" + enter[1:], lines
    assert not lock_path(out).exists()


def test_holds_within_one_process_are_counted(tmp_path):
    out = tmp_path / "a"
    first = hold(out, "run")
    second = FolderLock(out, "run").acquire()  # the same process: granted
    second.release()
    assert lock_path(out).exists() and first.held
    first.release()
    assert not lock_path(out).exists() and not first.held


def test_an_unwritable_parent_is_one_line_and_leaves_nothing(tmp_path):
    from support import unwritable_folder

    parent = unwritable_folder(tmp_path)
    with pytest.raises(UserError) as refused:
        hold(parent / "sub" / "out", "run")
    assert str(parent / "sub" / "out") in str(refused.value) and "\n" not in str(refused.value)
    assert not (parent / "sub").exists()


# --- leftovers of killed writes ----------------------------------------------------------------


def _atomic_temporaries(folder: Path, name: str) -> list[Path]:
    """The temporaries rlsched.atomic makes for `name` in `folder`, as a killed write leaves them."""
    fd, f = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".tmp")
    os.close(fd)
    return [Path(f), Path(tempfile.mkdtemp(dir=folder, prefix=f".{name}.tmp-"))]


def test_leftovers_are_removed_and_a_replaced_folder_whose_successor_never_came_is_put_back(tmp_path):
    from rlsched.executor.folders import remove_leftovers

    parent = tmp_path / "runs"
    out = parent / "out"
    (out / "traces" / "steps").mkdir(parents=True)
    (out / "plots").mkdir()
    keep = [out / ".hidden", out / "notes.tmp", out / "traces" / "steps" / "part-000000.parquet"]
    for f in keep:
        f.write_text("mine")
    gone = _atomic_temporaries(out, "checkpoint.pt") + _atomic_temporaries(out / "traces" / "steps", "part.parquet")
    gone.append(out / ".plots.old-abcd1234")  # plots/ arrived: the old one is a leftover
    gone[-1].mkdir()
    (out / ".rollouts.old-abcd1234").mkdir()  # rollouts/ never arrived: the old one is it
    (out / ".rollouts.old-abcd1234" / "step-000000.parquet").write_text("rows")
    beside = _atomic_temporaries(parent, "out")
    others = _atomic_temporaries(parent, "out.json")  # another output's, beside: not this folder's
    removed = remove_leftovers(out, siblings=True)
    assert sorted(removed) == sorted([*gone, *beside, out / ".rollouts.old-abcd1234"])
    assert not any(p.exists() for p in gone + beside)
    assert all(p.exists() for p in keep + others)
    assert (out / "rollouts" / "step-000000.parquet").read_text() == "rows"


def test_write_failures_for_want_of_room_or_permission_are_told_apart_from_other_errors():
    from rlsched.executor.folders import WriteFailed, write_failure, writing

    assert write_failure(OSError(errno.ENOSPC, "No space left on device")) == ("No space left on device", True)
    assert write_failure(OSError(errno.EFBIG, "File too large"))[1] is True
    assert write_failure(OSError(errno.EROFS, "Read-only file system"))[1] is False
    assert write_failure(OSError("[Errno 27] File too large")) == ("File too large", True)  # pyarrow's
    assert write_failure(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 7 vs 5"))
    assert write_failure(OSError(errno.ENOENT, "No such file")) is None
    assert write_failure(RuntimeError("shape mismatch")) is None
    with pytest.raises(WriteFailed) as failed, writing(Path("/x/out")):
        raise OSError(errno.ENOSPC, "No space left on device", "/x/out/traces/part.jsonl")
    assert failed.value.path == Path("/x/out/traces/part.jsonl") and "free space" in failed.value.fix
    with pytest.raises(ValueError), writing(Path("/x/out")):
        raise ValueError("not a write")


# --- end to end: run, generate ----------------------------------------------------------------

TINY = """
steps: {steps}
policy: static:2
checkpoint_every: 1
data: builtin:count,repeat
rollout: {{prompts_per_step: 4, group_size: 4, max_tokens: 16, max_batch: 16, k_max: 3}}
algorithm: {{minibatches: 1}}
drafter_update: {{every: 2, steps: 2, batch: 8, schedule: every}}
"""
ROOM = 2 * 2**20  # bytes a file may hold: the traces, rollouts and config fit, the checkpoint (~40 MB) does not


def _config(tmp_path: Path, steps: int) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(TINY.format(steps=steps))
    return path


def _together(cwd: Path, *commands: list[str]) -> list[subprocess.CompletedProcess]:
    """The commands started back to back, then waited for."""
    env = dict(os.environ, COLUMNS="400")
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "rlsched", *c], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for c in commands
    ]
    done = []
    for c, p in zip(commands, procs):
        stdout, stderr = p.communicate(timeout=1800)
        done.append(subprocess.CompletedProcess(c, p.returncode, stdout.decode(), stderr.decode()))
    return done


def _one_refused(procs: list[subprocess.CompletedProcess], out: Path) -> subprocess.CompletedProcess:
    """Exactly one refused (one line naming the folder and the holder's pid); the other, returned."""
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 2], [(p.returncode, p.stderr[-2000:]) for p in procs]
    refused = next(p for p in procs if p.returncode == 2)
    line = one_line_error(refused, str(out), "in use by", "pid ")
    assert "--out" in line
    return ok(next(p for p in procs if p.returncode == 0))


@pytest.mark.e2e
def test_two_runs_started_together_on_one_folder_one_is_refused_the_other_intact(pair, tmp_path):
    import pandas as pd

    from rlsched.traces.reader import read_trace

    out = tmp_path / "run"
    config = str(_config(tmp_path, steps=2))
    run = ["run", "--config", config, "--out", str(out), "--json"]
    winner = _one_refused(_together(tmp_path, run, run), out)
    summary = json.loads(winner.stdout)
    assert summary["steps"] == 2 and json.loads((out / "summary.json").read_text())["steps"] == 2
    rl = read_trace(out / "traces", "rl_steps")
    assert sorted(rl.rl_step) == [0, 1]  # every step once
    assert sorted(read_trace(out / "traces", "samples").sample_id) == list(range(2 * 16))
    assert sorted(p.name for p in (out / "rollouts").iterdir()) == ["step-000000.parquet", "step-000001.parquet"]
    for s in (0, 1):
        roll = pd.read_parquet(out / "rollouts" / f"step-{s:06d}.parquet")
        assert len(roll) == 16 and roll.reward.mean() == pytest.approx(rl.reward_mean[rl.rl_step == s].item())
    assert not lock_path(out).exists()


@pytest.mark.e2e
@pytest.mark.slow
def test_two_generates_started_together_on_one_folder_one_is_refused(pair, tmp_path):
    import pandas as pd

    out = tmp_path / "gen"
    gen = ["generate", "--policy", "static:2", "--n", "1", "--max-tokens", "8", "--out", str(out), "--json"]
    winner = _one_refused(_together(tmp_path, gen, gen), out)
    summary = json.loads(winner.stdout)
    assert summary == json.loads((out / "summary.json").read_text())
    assert len(pd.read_parquet(out / "samples.parquet")) == summary["samples"]
    assert ".gen.lock" not in snapshot(tmp_path)  # released


@pytest.mark.e2e
@pytest.mark.slow
def test_a_full_disk_before_the_first_checkpoint_removes_the_run(pair, tmp_path):
    config = _config(tmp_path, steps=2)
    out = tmp_path / "runs" / "full"
    proc = rlsched("run", "--config", str(config), "--out", str(out), cwd=tmp_path, file_size_limit=ROOM)
    line = one_line_error(proc, str(out / "checkpoint.pt"), "free space", "removed")
    assert "--resume" not in line
    assert snapshot(tmp_path) == {"run.yaml"}  # nothing half-written, no lock file, no folder made for it


@pytest.mark.e2e
@pytest.mark.slow
def test_a_killed_save_is_cleared_at_resume_and_a_full_disk_after_a_checkpoint_is_resumable(pair, tmp_path):
    import torch

    from rlsched.traces.reader import read_trace

    config = _config(tmp_path, steps=4)
    out = tmp_path / "run"
    run_then_kill(config, out, tmp_path, steps_recorded=1, timeout=1800, checkpoint=True)
    assert not (out / "summary.json").exists()
    saved = torch.load(out / "checkpoint.pt", weights_only=False)["next_step"]
    leftovers = _atomic_temporaries(out, "checkpoint.pt") + _atomic_temporaries(out / "rollouts", "step-000009.parquet")

    proc = rlsched("run", "--resume", "--out", str(out), cwd=tmp_path, file_size_limit=ROOM)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    *before, error = [line for line in proc.stderr.splitlines() if line.strip()]
    assert [line.split()[0] for line in before] == ["resuming"], proc.stderr  # the run's own log: one line
    for name in (str(out / "checkpoint.pt"), "free space", f"rlsched run --resume --out {out}"):
        assert name in error, error
    assert not any(p.exists() for p in leftovers)  # cleared at the start, under the lock
    assert torch.load(out / "checkpoint.pt", weights_only=False)["next_step"] == saved  # the last one, whole
    assert not (out / "summary.json").exists() and not lock_path(out).exists()

    ok(rlsched("run", "--resume", "--out", str(out), cwd=tmp_path))
    assert sorted(read_trace(out / "traces", "rl_steps").rl_step) == [0, 1, 2, 3]
    assert not [p for p in snapshot(out) if p.endswith(".tmp") or ".tmp-" in p]
