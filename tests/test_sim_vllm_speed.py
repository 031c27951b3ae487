"""The vLLM engine model's steady stretches (`sim/vllm_engine.py`): a stretch of pure decode
steps priced in one go gives the same timeline, samples and summary, to the last bit, as the
same steps simulated one by one (`max_steady_run=1`)."""

from __future__ import annotations

import numpy as np
import pytest

from rlsched.config import load_config
from rlsched.sim.simulate import simulate
from rlsched.sim.vllm_engine import VllmInstance

SMALL = [
    "rl.steps=2",
    "cluster.instances=2",
    "workload.prompts=12",
    "workload.samples_per_prompt=4",
    "workload.response_len.median=400",
    "workload.response_len.max=2048",
    "engine.kind=vllm",
]
CASES = {
    "goodput": ("default", "goodput", []),
    "static chain": ("default", "static:3", []),
    "off": ("default", "off", []),
    "tree": ("default", "tree:4:2:8", []),
    "seqgoodput": ("default", "seqgoodput", []),
    "ngram, sync": ("ngram-llama8b", "goodput", ["engine.async_scheduling=false"]),
    "probes": ("low-acceptance", "goodput", ["speculation.probe_every=8"]),
    "tight KV, preemptions": ("default", "goodput", ["cluster.kv_capacity_tokens=6000"]),
    "short budget, no caching": (
        "default",
        "static:2",
        ["engine.max_num_batched_tokens=2048", "engine.enable_prefix_caching=false"],
    ),
}


def run(preset: str, policy: str, extra: list[str], stretches: bool, monkeypatch=None):
    cfg = load_config(preset, overrides=[*SMALL, *extra, f"max_steady_run={256 if stretches else 1}"])
    calls = []
    if monkeypatch is not None:
        original = VllmInstance._stretch

        def counted(self, strat, n, m):
            calls.append(m)
            return original(self, strat, n, m)

        monkeypatch.setattr(VllmInstance, "_stretch", counted)
    res = simulate(cfg, policy)
    return res, calls


@pytest.mark.parametrize("case", list(CASES))
def test_stretches_equal_step_by_step(case, monkeypatch):
    preset, policy, extra = CASES[case]
    fast, calls = run(preset, policy, extra, True, monkeypatch)
    slow, none = run(preset, policy, extra, False)
    assert calls and sum(calls) > 2 * len(calls)  # stretches of several steps ran
    assert fast.summary() == slow.summary()
    a, b = fast.timeline.arrays(), slow.timeline.arrays()
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    assert fast.samples_frame().equals(slow.samples_frame())


def test_the_tight_case_preempts_and_the_short_budget_cuts_rows():
    """The cases above reach the paths a stretch must stop at."""
    tight, _ = run(*CASES["tight KV, preemptions"], True)
    assert tight.summary()["preemptions"] > 0
    short, _ = run(*CASES["short budget, no caching"], True)
    assert short.summary()["vllm_engine"]["mixed_steps"] > 0
