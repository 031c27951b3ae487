"""bench/gpu_engine.py is run on a lent GPU only; its --smoke mode runs the same code on the
CPU with tiny shapes, so that the prepared script is known to work before device time is spent."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent


# The lent machine's image has torch, numpy, pandas, scipy, safetensors and tokenizers, but not
# pydantic, simpy, typer or yaml (/work/.library/device/KINDS.md): the script runs here with
# those unimportable. (rlsched.errors imported pydantic at the top, for a type: the script
# would have stopped at its first import there.)
ABSENT_ON_DEVICE = ("pydantic", "pydantic_core", "simpy", "typer", "yaml")
RUN_WITHOUT = """
import runpy, sys
absent = set(sys.argv[1].split(","))
class Absent:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in absent:
            raise ImportError(f"{name} is not installed on the device machine")
sys.meta_path.insert(0, Absent())
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_gpu_engine_script_smoke_runs_on_cpu(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            RUN_WITHOUT,
            ",".join(ABSENT_ON_DEVICE),
            str(ROOT / "bench" / "gpu_engine.py"),
            "--device",
            "cpu",
            "--smoke",
            "--batch-sizes",
            "1,4",
            "--k-max",
            "2",
            "--context",
            "16",
            "--tokens",
            "4",
        ],
        env=dict(os.environ, OUT=str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((tmp_path / "gpu_engine.json").read_text())
    kinds = {r["kind"] for r in result["profile"]}
    assert kinds == {"prefill", "feed", "verify", "draft"}
    assert [p["batch"] for p in result["plain"]] == [1, 4] and all(p["tok_s"] > 0 for p in result["plain"])
    assert "verify ms by batch" in (tmp_path / "gpu_engine.txt").read_text()
    assert result["compiled_b1"].get("tok_s", 0) > 0, result["compiled_b1"]  # on the CPU it must work
    compiled = result["compiled_plain"]
    assert [r["batch"] for r in compiled] == [1, 4] and all(r["tok_s"] > 0 for r in compiled)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--device", "cuda", "--sections", "plain,drain"], "plain time CPU peers; on --device cuda choose from drain"),
        (["--sections", "drian"], "--sections: unknown drian"),
    ],
)
def test_engine_bench_refuses_sections_it_cannot_run(args, message):
    """bench/engine.py --device cuda runs the drains only (the other sections time CPU peers)."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "engine.py"), *args], capture_output=True, text=True, timeout=1800
    )
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-1000:]


def test_gpu_drain_script_needs_nothing_carried(tmp_path):
    """The drain runs on the pair shipped in the checkout: no copied cache to carry, no build
    on the lent machine's clock (the shipped pair's recipe is the default one:
    tests/test_builtin_pair.py)."""
    import shutil

    if shutil.which("bash") is None:
        pytest.skip("no bash")
    work = tmp_path / "checkout"
    (work / "bench").mkdir(parents=True)
    shutil.copy(ROOT / "bench" / "gpu_engine.sh", work / "bench")
    stub = tmp_path / "bin"  # a python3 that says it sees a GPU and records its calls, and no nvidia-smi
    stub.mkdir()
    (stub / "python3").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'calls'}\necho 'torch (stub) GPU'\n")
    (stub / "python3").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "RLSCHED_CACHE")}
    proc = subprocess.run(
        ["bash", str(work / "bench" / "gpu_engine.sh"), "drain"],
        capture_output=True,
        text=True,
        env=dict(env, PATH=f"{stub}:/usr/bin:/bin"),
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stderr
    calls = (tmp_path / "calls").read_text().splitlines()
    assert calls[-1].startswith("bench/engine.py --device cuda --sections drain"), calls


def test_planted_drafter_is_accepted_exactly_up_to_its_planted_rejection():
    """bench/gpu_drain.py's planted acceptance: the echo target keeps exactly the drafts before
    the planted rejection (its greedy token is its input token), and the cut falls where each
    row's acceptance says (a geometric count, checked on the mean over many rows)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import torch
    from gpu_drain import PlantedDrafter, echo_target
    from gpu_engine import QWEN_0_5B, QWEN_1_5B

    from rlsched.executor.decode.drafters import ModelDrafter, Seq
    from rlsched.executor.decode.sampling import GREEDY
    from rlsched.executor.decode.speculative import prefill, step

    small = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, head_dim=16)
    target = echo_target({**QWEN_1_5B, **small}, torch.device("cpu"), torch.float32)
    drafter = echo_target({**QWEN_0_5B, **small, "num_layers": 1}, torch.device("cpu"), torch.float32)
    b, k, a = 400, 4, 0.6
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, 500, (b, 6), generator=gen).tolist()
    cache = target.new_cache(b, 32)
    slots = torch.arange(b)
    last = prefill(target, cache, slots, prompts)
    seqs = [Seq(list(p), i, i) for i, p in enumerate(prompts)]
    planted = PlantedDrafter(
        ModelDrafter(drafter, GREEDY, b, 32, gen), {i: a for i in range(b)}, {i: (6, 10**6) for i in range(b)}, gen, 512
    )
    drafts, q, dk = planted.propose(seqs, k)
    out = step(target, cache, slots, last, GREEDY, drafts, q, dk, gen)
    last_tokens = torch.tensor([p[-1] for p in prompts])
    cut = (drafts == last_tokens[:, None]).long().cumprod(1).sum(1)  # echoes before the planted token
    assert torch.equal(out.accepted.cpu(), cut)  # kept exactly the planted prefix
    assert (out.tokens[torch.arange(b), out.accepted] == last_tokens).all()
    expected = sum(a**j for j in range(1, k + 1))  # truncated geometric mean: 1.3056
    assert abs(out.accepted.float().mean().item() - expected) < 0.15


def test_gpu_drain_script_smoke_runs_on_cpu(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            RUN_WITHOUT,
            ",".join(ABSENT_ON_DEVICE),
            str(ROOT / "bench" / "gpu_drain.py"),
            "--device",
            "cpu",
            "--smoke",
        ],
        env=dict(os.environ, OUT=str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((tmp_path / "gpu_drain_cpu.json").read_text())
    by = {r["policy"]: r for r in result["rows"]}
    assert set(by) >= {"off", "static:1", "static:6", "goodput", "goodput:drain", "bandit"}
    assert by["off"]["mean_accept_len"] == 1.0
    # planted acceptance ~0.55-0.9 a token: one draft a step keeps 1 + a tokens
    assert 1.4 < by["static:1"]["mean_accept_len"] < 2.0, by["static:1"]
    assert by["static:3"]["mean_accept_len"] > by["static:1"]["mean_accept_len"]
    assert "held out" in (tmp_path / "gpu_drain_cpu.txt").read_text()


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is importable only in .venv-vllm")
def test_gpu_vllm_path_runs_on_vllms_cpu_build(tmp_path):
    """bench/gpu_vllm.sh's benchmark with the planted pair at the built-in pair's shapes:
    every arm runs, and drafts are accepted at a planted rate (per request 1, 1/2, 1/3 or 1/4)."""
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "vllm_adaptive.py"),
            "--models",
            "planted",
            "--smoke",
            "--reps",
            "1",
            "--prompts",
            "3",
            "--group",
            "4",
            "--median",
            "12",
            "--max-batch",
            "8",
            "--k-max",
            "3",
            "--static",
            "2",
            "--adaptive",
            "seqgoodput",
            "--threads",
            "1",
        ],
        env=dict(os.environ, OUT=str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "vllm_adaptive_planted_smoke.json").read_text())
    assert set(result["arms"]) >= {"off", "static:2", "seqgoodput"}
    acc = result["arms"]["static:2"]["acceptance"]
    # (3 prompts may all plant 1/4: (1/4 + 1/16) / 2 = 0.16 of the drafts accepted at k = 2, give or take)
    assert 0.05 <= acc <= 1.0 and all(a["tokens"] > 0 for a in result["arms"].values())
    assert "planted pair (built-in shapes)" in (tmp_path / "vllm_adaptive_planted_smoke.txt").read_text()
