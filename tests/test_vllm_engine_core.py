"""rlsched's scheduler in vLLM's multiprocess engines (vLLM's CPU build), configured by engine
arguments only: the engine core runs in a process of its own, the model runner in another.

- Losslessness through the multiprocess `LLM`: the first 3 tokens of many samples against their
  exact distribution (chi-square, as tests/test_vllm_hook.py does in-process), under a policy
  that cycles k over {0, 1, 3, 6} step by step and one that gives each request its own k,
  loaded by qualified name inside the engine core (`plugin:plugin_policies.cycling`).
- `AsyncLLM`, the engine RL frameworks' rollout workers run, started with the engine kwargs as
  `rlsched.policies.engine_args` writes them for verl, drafts under the policy.

vLLM's CPU platform turns async scheduling off ("not required on CPU"), so the engines here run
the synchronous base; the engine file in the trace folder records which base ran.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("vllm")

from test_vllm_hook import ALPHA, N_ROWS, PROMPTS, _p_value, noisy_pair  # noqa: E402

from rlsched.executor.decode.sampling import SamplingParams  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return noisy_pair(tmp_path_factory.mktemp("engine-core"))


@pytest.fixture
def multiprocess(monkeypatch):
    """vLLM's default: the engine core in its own process; tests/ importable there (the plugin)."""
    from rlsched.executor.vllm.shims import ENGINE_ENV

    for k, v in {**ENGINE_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))


def _steps(folder: Path):
    from rlsched.traces.reader import read_trace

    return read_trace(folder, "steps")


@pytest.mark.parametrize("per_request", [False, True], ids=["k-per-step", "k-per-request"])
def test_policy_chosen_k_is_lossless_through_the_multiprocess_engine(folders, multiprocess, tmp_path, per_request):
    from vllm import LLM
    from vllm import SamplingParams as VP
    from vllm.inputs import TokensPrompt

    policy = "plugin:plugin_policies.cycling" + ("_per_request" if per_request else "")
    llm = LLM(
        model=str(folders[0]),
        dtype="float32",
        enforce_eager=True,
        max_num_seqs=256,
        max_model_len=64,
        skip_tokenizer_init=True,
        seed=3 + per_request,
        speculative_config={
            "method": "draft_model",
            "model": str(folders[1]),
            "num_speculative_tokens": 6,
            "draft_sample_method": "probabilistic",
        },
        scheduler_cls="rlsched.vllm.PolicyScheduler",
        additional_config={"rlsched": {"policy": policy, "trace_dir": str(tmp_path / "traces")}},
    )
    try:
        params = VP(temperature=1.0, max_tokens=8, ignore_eos=True, detokenize=False)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in PROMPTS for _ in range(N_ROWS)]
        gen = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.llm_engine.engine_core.shutdown()
    engine = json.loads(next((tmp_path / "traces").glob("engine-*.json")).read_text())
    assert engine["rlsched"]["policy"] == policy and engine["async_scheduling"] is False  # the CPU platform's
    decode = _steps(tmp_path / "traces").query("kind == 'decode'")
    if per_request:  # rows drafted different lengths in one step
        assert decode.drafted.sum() < (decode.batch * decode.k).sum()
    else:  # k really changed from step to step, chosen inside the engine core
        assert {0, 1, 3}.issubset(set(decode.k))
    assert decode.accepted.sum() > 0.3 * decode.drafted.sum() > 0
    p = _p_value(folders, SamplingParams(1.0), gen)
    print(f"multiprocess engine, per_request={per_request}: p = {p:.3g}")
    assert p > ALPHA


def test_async_llm_with_the_verl_engine_kwargs_drafts_under_the_policy(pair, multiprocess, tmp_path):
    from vllm import SamplingParams as VP
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    from rlsched.policies.engine_args import EngineFacts, HookSettings, verl_rollout_section, vllm_engine_kwargs

    traces = tmp_path / "traces"
    facts = EngineFacts(
        str(pair.target), "model", str(pair.drafter), k_max=4, max_num_seqs=32, max_model_len=256, dtype="float32"
    )
    kw = vllm_engine_kwargs(facts, HookSettings("bandit", trace_dir=str(traces)))
    verl = verl_rollout_section(kw)["actor_rollout_ref"]["rollout"]
    engine_kwargs = verl["engine_kwargs"]["vllm"]  # what verl hands its vLLM server, beside its own keys
    args = AsyncEngineArgs(
        model=str(pair.target),
        tensor_parallel_size=verl["tensor_model_parallel_size"],
        max_num_seqs=verl["max_num_seqs"],
        enforce_eager=True,
        **{k: v for k, v in engine_kwargs.items() if k not in ("model",)},
        **{k: kw[k] for k in ("max_model_len", "dtype") if k in kw},
    )
    llm = AsyncLLM.from_engine_args(args)
    FINAL_ONLY = RequestOutputKind.FINAL_ONLY  # one output a group, its 16 samples whole

    async def group(step: int, i: int, prompt: list[int]):
        params = VP(n=16, temperature=1.0, max_tokens=24 + 8 * i, ignore_eos=True, output_kind=FINAL_ONLY)
        async for out in llm.generate(TokensPrompt(prompt_token_ids=prompt), params, request_id=f"s{step}g{i}"):
            last = out
        return last

    async def rollout():
        """Two RL steps' rollouts, the framework's weight update between them (verl resets the
        prefix cache once the new weights are in)."""
        first = await asyncio.gather(*(group(0, i, p) for i, p in enumerate([[1, 5, 9, 13], [3, 4, 5, 6, 7]])))
        await llm.reset_prefix_cache()
        second = await asyncio.gather(group(1, 0, [2, 6, 10]))
        return first + second

    try:
        outs = asyncio.run(rollout())
    finally:
        llm.shutdown()
    assert [len(o.outputs) for o in outs] == [16, 16, 16]
    steps = _steps(traces)
    assert sorted(steps.rl_step.unique()) == [0, 1]  # the trace marks the weight update
    decode = steps[steps.kind == "decode"]
    assert decode.drafted.sum() > 0 and np.isfinite(decode.draft_ms).all()
    engine = json.loads(next(traces.glob("engine-*.json")).read_text())
    assert engine["rlsched"]["policy"] == "bandit" and engine["k_max"] == 4


def test_tensor_parallel_workers_time_their_drafting(pair, multiprocess, tmp_path):
    """Two tensor-parallel workers, each a process of its own: the first one's drafting
    reaches the engine core's records with its output (the general plugin)."""
    from vllm import LLM
    from vllm import SamplingParams as VP
    from vllm.inputs import TokensPrompt

    traces = tmp_path / "traces"
    llm = LLM(
        model=str(pair.target),
        dtype="float32",
        tensor_parallel_size=2,
        enforce_eager=True,
        max_num_seqs=16,
        max_model_len=128,
        skip_tokenizer_init=True,
        speculative_config={"method": "draft_model", "model": str(pair.drafter), "num_speculative_tokens": 3},
        scheduler_cls="rlsched.vllm.PolicyScheduler",
        additional_config={"rlsched": {"policy": "static:2", "trace_dir": str(traces)}},
    )
    try:
        params = VP(temperature=1.0, max_tokens=16, ignore_eos=True, detokenize=False)
        llm.generate([TokensPrompt(prompt_token_ids=[1, 5, 9, 13])] * 8, params, use_tqdm=False)
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert json.loads(next(traces.glob("engine-*.json")).read_text())["tp"] == 2
    decode = _steps(traces).query("kind == 'decode'")
    assert len(decode) > 0 and set(decode.k) == {2}
    assert decode.draft_ms.notna().all() and (decode.draft_ms > 0).all()
