"""What `rlsched plan` writes runs on vLLM's CPU build: its vLLM engine arguments start an
engine that drafts as written, and its `rlsched run` config trains through vLLM, both on the
built-in pair scaled to its size.

Runs in .venv-vllm (`make test-vllm`); skipped where vllm is not importable.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import yaml
from support import ok, rlsched

pytest.importorskip("torch")

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not importable here (make test-vllm sets up .venv-vllm)"),
]


@pytest.fixture(scope="module")
def planned(tmp_path_factory, pair):
    root = tmp_path_factory.mktemp("plan")
    out = root / "plan"
    ok(
        rlsched(
            "plan",
            "--workload",
            "default",
            "--gpus",
            "2",
            "--tp",
            "1",
            "--max-batch",
            "64",
            "--seeds",
            "1",
            "--survivors",
            "3",
            "-j",
            "1",
            "--set",
            "rl.steps=1",
            "--drafters",
            "model",
            "--no-learn",
            "--model-path",
            str(pair.target),
            "--drafter-path",
            str(pair.drafter),
            "--out",
            str(out),
            cwd=root,
            timeout=1800,
        )
    )
    return root, out, pair


def test_the_written_vllm_arguments_start_an_engine_that_drafts_as_written(planned):
    import torch
    from vllm import SamplingParams, TokensPrompt

    from rlsched.executor.model.builtin import EOS, encode
    from rlsched.executor.vllm.shims import start_llm
    from rlsched.policies.vllm_plan import TABLE_FIELD
    from rlsched.tasks.synthetic import make_examples

    _, out, pair = planned
    args = json.loads((out / "vllm_engine.json").read_text())
    spec = args["speculative_config"]  # the default preset's drafter pays at these batch sizes
    assert args["model"] == str(pair.target) and spec["model"] == str(pair.drafter)
    assert args["tensor_parallel_size"] == 1  # (this CPU build runs tp 1; gpu_memory_utilization is a GPU's)
    torch.set_num_threads(1)
    from rlsched.executor.vllm.scheduler import PolicyScheduler

    assert args["scheduler_cls"] == "rlsched.vllm.PolicyScheduler"
    block = args["additional_config"]["rlsched"]
    llm = start_llm(
        args["model"],
        spec,
        max_batch=args["max_num_seqs"],
        max_model_len=min(args["max_model_len"], 256),
        seed=0,
        dtype="float32",
        threads=1,
        scheduler_cls=PolicyScheduler,  # what the name resolves to
        additional_config=args["additional_config"],
    )
    try:
        served = llm.llm_engine.vllm_config.speculative_config
        assert served.method == "draft_model" and served.num_speculative_tokens == spec["num_speculative_tokens"]
        if TABLE_FIELD in spec:
            assert [list(e) for e in getattr(served, TABLE_FIELD)] == spec[TABLE_FIELD]
        prompts = [encode(e.prompt) for e in make_examples(4, seed=7)]
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts],
            SamplingParams(temperature=1.0, max_tokens=16, stop_token_ids=[EOS], seed=0),
            use_tqdm=False,
        )
        assert all(1 <= len(o.outputs[0].token_ids) <= 16 for o in outs)
        drafted = sum(
            getattr(m, "value", 0) for m in llm.get_metrics() if m.name == "vllm:spec_decode_num_draft_tokens"
        )
        assert drafted > 0
        engine = json.loads(next(Path(block["trace_dir"]).glob("engine-*.json")).read_text())
        assert engine["rlsched"]["policy"] == block["policy"]  # the plan's policy chose the draft lengths
    finally:
        engine_core = getattr(llm.llm_engine, "engine_core", None)
        if engine_core is not None and hasattr(engine_core, "shutdown"):
            engine_core.shutdown()


def test_the_written_run_config_trains_through_vllm(planned):
    root, out, pair = planned
    run = yaml.safe_load((out / "run.yaml").read_text())
    assert run["rollout"]["backend"] == "vllm" and run["model"] == str(pair.target)
    proc = ok(
        rlsched(
            "run",
            "--config",
            str(out / "run.yaml"),
            "--set",
            "steps=1",
            "--set",
            "rollout.instances=1",
            "--set",
            "rollout.realloc=none",
            "--set",
            "rollout.prompts_per_step=2",
            "--set",
            "rollout.group_size=2",
            "--set",
            "rollout.max_tokens=8",
            "--set",
            "rollout.max_batch=8",
            "--set",
            "threads=1",
            "--set",
            "device=cpu",  # the plan is for its preset's GPUs; this test runs on vLLM's CPU build
            "--set",
            "dtype=float32",
            "--set",
            "rollout.tp=1",
            "--out",
            str(root / "run"),
            "--json",
            cwd=root,
            timeout=1800,
        )
    )
    assert json.loads(proc.stdout)["steps"] == 1
