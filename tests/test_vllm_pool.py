"""Several vLLM instances on Ray (`executor/pool/instances.py` with `backend = "vllm"`): samples move
between them (aborted at the source, resubmitted with prompt + partial response), each comes
back exactly once and complete, and a killed instance's samples finish elsewhere while it is
started again. vLLM's CPU build in .venv-vllm; skipped where vllm or Ray is missing."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

pytest.importorskip("torch")
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None or importlib.util.find_spec("ray") is None,
        reason="vllm and ray are importable only in .venv-vllm (make test-vllm)",
    ),
]

from rlsched.executor.decode.sampling import SamplingParams  # noqa: E402
from rlsched.executor.engine.rows import Request  # noqa: E402
from rlsched.executor.pool.instances import InstancePool, InstanceSpec  # noqa: E402
from rlsched.traces.reader import read_trace  # noqa: E402

SHORT, LONG = 8, 48


def drain_requests(n_prompts: int = 8, group: int = 3, seed: int = 0) -> list[Request]:
    """Prompts go round-robin to the two instances: instance 0 gets the short ones and drains
    at once, instance 1 the long ones (no eos: each sample runs to its budget)."""
    rng = np.random.default_rng(seed)
    out = []
    for p in range(n_prompts):
        prompt = rng.integers(3, 60, size=int(rng.integers(3, 8))).tolist()
        for _ in range(group):
            out.append(Request(prompt, p, 100 + len(out), SHORT if p % 2 == 0 else LONG, None))
    return out


def check_exactly_once(requests, result) -> None:
    assert [s.sample_id for s in result.samples] == [r.sample_id for r in requests]
    for r, s in zip(requests, result.samples):
        assert len(s.tokens) == r.max_new_tokens == len(s.logprobs)  # complete: nothing lost, nothing twice
        assert np.isfinite(s.logprobs).all() and max(s.logprobs) <= 0


@pytest.fixture(scope="module")
def vpool(tmp_path_factory, pair):
    trace_dir = tmp_path_factory.mktemp("traces")
    spec = InstanceSpec(
        str(pair.target),
        "model",
        str(pair.drafter),
        SamplingParams(1.0),
        "goodput",
        8 * 128,
        8,
        3,
        0,
        trace_dir=str(trace_dir),
        threads=1,
        backend="vllm",
        max_len=128,
        seed=0,
        typical_ctx=32,
    )
    pool = InstancePool(2, spec, realloc="rebalance", threshold=4, seed=0)
    yield pool, trace_dir
    pool.close()


def test_rebalance_moves_samples_between_vllm_instances(vpool):
    """Each instance gets one full batch and no queue, so what moves is running, tokens and all."""
    pool, trace_dir = vpool
    requests = drain_requests(n_prompts=4, group=4)
    pool.rl_step = 0
    result = pool.run(requests)
    st = result.stats
    assert st["migrated"] > 0 and st["migrated_kv"] == 0 and st["migrated_reprefill"] > 0, st  # tokens travel
    check_exactly_once(requests, result)
    assert st["drafted"] > 0 and st["accepted"] > 0  # goodput drafted inside both vLLM engines
    samples = read_trace(trace_dir, "samples")  # the instances' journals: every record as written
    mine = samples[samples.rl_step == 0]
    assert sorted(mine.sample_id) == sorted(r.sample_id for r in requests)  # one record per sample
    assert mine.migrations.sum() == st["migrated"]  # every move counted in the sample records
    steps = read_trace(trace_dir, "steps")
    assert set(steps[steps.rl_step == 0].instance) == {0, 1}  # each instance's engine steps, in its own parts


def test_a_killed_vllm_instance_is_restarted_and_the_rollout_completes(vpool):
    pool, _ = vpool
    requests = drain_requests(seed=1)
    killed = []

    def kill_one(i, report):  # instance 1 dies after its first answer, mid-rollout
        if i == 1 and not killed:
            killed.append(len(report["view"]["running_ids"]) + len(report["view"]["waiting_ids"]))
            pool.kill(1)

    pool.on_report, pool.rl_step = kill_one, 1
    try:
        result = pool.run(requests)
    finally:
        pool.on_report = None
    st = result.stats
    # (what it held then, less what rebalance moved off it before it died, starts again elsewhere)
    assert killed and killed[0] > 0 and st["instances_died"] == 1 and st["requeued"] > 0, st
    assert st["requeued"] + st["migrated"] >= killed[0], st
    check_exactly_once(requests, result)
    assert pool.restarts == [0, 1]
    pool.rl_step = 2
    again = pool.run(requests)  # the restarted instance takes its share of the next rollout
    assert again.stats["instances_alive"] == 2 and again.stats["instances_died"] == 0
    check_exactly_once(requests, again)


RUN = """
steps: 4
seed: 1
threads: 2
policy: goodput
drafter: builtin
checkpoint_every: 1
data: builtin:count,repeat
rollout: {prompts_per_step: 4, group_size: 4, max_tokens: 16, max_batch: 16, k_max: 3, backend: vllm,
          instances: 2, realloc: rebalance, realloc_threshold: 6}
algorithm: {minibatches: 1, lr: 0.003}
drafter_update: {every: 1, steps: 2, batch: 8, schedule: every}
"""


def test_run_on_two_vllm_instances_killed_and_resumed_loses_nothing(tmp_path):
    """`rlsched run` with two vLLM instances and rebalance, killed (-9) in its third step and
    resumed: every step once, every sample once, the instances' policies restored."""
    from support import ok, rlsched, run_then_kill

    config = tmp_path / "run.yaml"
    config.write_text(RUN)
    out = tmp_path / "cut"
    run_then_kill(config, out, tmp_path, steps_recorded=2, timeout=1800)  # in its third step
    assert not (out / "summary.json").exists()
    done = ok(rlsched("run", "--out", str(out), "--resume", cwd=tmp_path, timeout=1800))
    assert "resuming" in done.stderr
    rl = read_trace(out / "traces", "rl_steps")
    assert sorted(rl.rl_step) == [0, 1, 2, 3]  # no step lost or duplicated
    samples = read_trace(out / "traces", "samples")
    per_step = samples.groupby("rl_step").sample_id.agg(["nunique", "size"])
    assert (per_step["nunique"] == 16).all() and (per_step["size"] == 16).all()
    assert set(samples.instance) == {0, 1} and "migrated" in rl
