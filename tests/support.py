"""Helpers shared by the test files: running the CLI, listing what a run wrote, a tiny model pair."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple


def rlsched(
    *args: str,
    cwd: Path,
    env_extra: dict | None = None,
    timeout: float = 1800,
    file_size_limit: int | None = None,
) -> subprocess.CompletedProcess:
    """Run the real entry point (`python -m rlsched`) with wide columns, so errors stay one line.
    `file_size_limit` (bytes) caps every file the command writes (RLIMIT_FSIZE): a write past it
    fails with EFBIG, as a full disk fails a write with ENOSPC."""

    def limit_files() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))

    env = dict(os.environ, COLUMNS="400", **(env_extra or {}))
    return subprocess.run(
        [sys.executable, "-m", "rlsched", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=limit_files if file_size_limit is not None else None,
    )


def one_line_error(proc: subprocess.CompletedProcess, *names: str) -> str:
    """Assert the tool's own refusal: exit 2, no traceback, exactly one line on stderr that
    names each of `names`; return that line."""
    detail = f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.returncode == 2, detail
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout, detail
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, detail
    for name in names:
        assert name in lines[0], f"{name!r} not in the error line: {lines[0]!r}"
    return lines[0]


def unwritable_folder(tmp_path: Path) -> Path:
    """A folder no one may create anything in, root included: a read-only folder for a normal
    user, a path under /proc (which refuses new entries) for root, who ignores permissions."""
    if os.geteuid() == 0:
        return Path("/proc/rlsched-cannot-write-here")
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    return folder


def run_then_kill(
    config: Path, out: Path, cwd: Path, steps_recorded: int, timeout: float, checkpoint: bool = False
) -> None:
    """`rlsched run --config config --out out`, killed (-9, with everything it started: Ray,
    vLLM) once `steps_recorded` RL-step records are written (and a checkpoint, if asked)."""
    import signal
    import time

    proc = subprocess.Popen(
        [sys.executable, "-m", "rlsched", "run", "--config", str(config), "--out", str(out)],
        cwd=cwd,
        env=dict(os.environ, COLUMNS="400"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    journal = out / "traces" / "rl_steps"
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if (
            (not checkpoint or (out / "checkpoint.pt").is_file())
            and journal.is_dir()
            and sum(p.read_text().count("\n") for p in journal.glob("*.jsonl")) >= steps_recorded
        ):
            break
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "Traceback" not in proc.stderr
    return proc


def snapshot(root: Path) -> set[str]:
    """Every file and folder under root, hidden ones included."""
    found = set()
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            found.add(os.path.relpath(os.path.join(dirpath, name), root))
    return found


class TinyPair(NamedTuple):
    target: Any  # the Transformer
    drafter: Any  # the target with noise added to its weights
    folder: Path  # the target's files


def tiny_pair(folder: Path, vocab: int) -> tuple[Any, Any]:
    """A tiny random Llama (written with transformers to `folder`, loaded with ours) and a
    drafter: the target with noise added to its weights. Weights are peaked enough that short
    joints of tokens have few large cells."""
    import torch
    import transformers

    from rlsched.executor.model.loading import load_model

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    hf = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0, 0.4)
    hf.save_pretrained(folder)
    target = load_model(folder).model
    drafter = load_model(folder).model
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.03 * torch.randn(p.shape, generator=g))
    return target, drafter
