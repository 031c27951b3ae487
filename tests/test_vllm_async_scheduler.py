"""rlsched's scheduler over vLLM's AsyncScheduler, driven step by step without a model.

vLLM's CPU platform turns async scheduling off, so no engine here runs it; this test builds the
scheduler vLLM would build on a GPU (`PolicyScheduler` with `async_scheduling` on: vLLM's own
AsyncScheduler as the base) from a real engine config of the built-in pair, adds requests and
feeds it model-runner outputs as an engine core does. Under async scheduling the drafts never
reach the scheduler: each request gets draft placeholders, and the next step verifies as many
as it holds. The policy's per-step k must size those placeholders, and its per-request k cut
each request's.
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from plugin_policies import CYCLE  # noqa: E402

pytestmark = pytest.mark.vllm

K = 6


def _scheduler(pair, policy: str, monkeypatch, async_scheduling: bool = True, budget: int | None = None):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from rlsched.executor.vllm.scheduler import PolicyScheduler, scheduler_for

    monkeypatch.setenv("PYTHONPATH", os.path.dirname(__file__))
    config = EngineArgs(
        model=str(pair.target),
        dtype="float32",
        max_model_len=256,
        max_num_seqs=16,
        skip_tokenizer_init=True,
        enable_prefix_caching=False,
        speculative_config={"method": "draft_model", "model": str(pair.drafter), "num_speculative_tokens": K},
        scheduler_cls="rlsched.vllm.PolicyScheduler",
        additional_config={"rlsched": {"policy": policy, "probe_every": None}},
        **({} if budget is None else {"max_num_batched_tokens": budget}),
    ).create_engine_config()
    config.scheduler_config.async_scheduling = async_scheduling  # True: as vLLM sets it on a GPU
    config.cache_config.num_gpu_blocks = 512  # (what the engine core sets once it sized the cache)
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=512, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
    sched = PolicyScheduler(
        vllm_config=config, kv_cache_config=kv, structured_output_manager=StructuredOutputManager(config), block_size=16
    )
    assert type(sched) is scheduler_for(async_scheduling)
    return sched


def _requests(sched, n: int):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    for i in range(n):
        params = SamplingParams(max_tokens=40, ignore_eos=True)
        sched.add_request(Request(f"r{i}", [1 + i, 5, 9, 13, 2, 7], params, None))


def _output(sched, out, accepted: int = 1):
    """What a model runner returns for `out`: each request's bonus token plus `accepted` drafts."""
    from vllm.v1.outputs import ModelRunnerOutput

    ids = list(out.num_scheduled_tokens)
    sampled = [[7] * (1 + min(accepted, len(out.scheduled_spec_decode_tokens.get(q, ())))) for q in ids]
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={q: i for i, q in enumerate(ids)}, sampled_token_ids=sampled)


def test_async_base_sizes_its_placeholders_from_the_policys_step_k(pair, monkeypatch):
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    sched = _scheduler(pair, "plugin:plugin_policies.cycling", monkeypatch)
    assert isinstance(sched, AsyncScheduler)
    _requests(sched, 4)
    seen = []
    prev = sched.schedule()  # the prompts
    for _ in range(6):
        seen.append(prev.num_spec_tokens_to_schedule)
        nxt = sched.schedule()  # async: the next step is scheduled before this one's output is in
        held = {len(t) for t in nxt.scheduled_spec_decode_tokens.values()}
        assert held <= {prev.num_spec_tokens_to_schedule}, (held, prev.num_spec_tokens_to_schedule)
        sched.update_from_output(prev, _output(sched, prev))
        prev = nxt
    assert seen == [CYCLE[s % len(CYCLE)] for s in range(6)]


def test_async_base_cuts_each_requests_placeholders_to_its_own_k(pair, monkeypatch):
    sched = _scheduler(pair, "plugin:plugin_policies.cycling_per_request", monkeypatch)
    _requests(sched, 4)
    prev = sched.schedule()
    cut = 0
    for step in range(5):
        nxt = sched.schedule()
        index = sched.hook.index_of
        for q, toks in nxt.scheduled_spec_decode_tokens.items():
            assert len(toks) == CYCLE[(index[q] + step) % len(CYCLE)], (step, q, toks)
            cut += len(toks) < prev.num_spec_tokens_to_schedule
        sched.update_from_output(prev, _output(sched, prev))
        prev = nxt
    assert cut > 0  # rows did hold fewer placeholders than the step's longest chain


def test_a_policy_file_names_the_engines_drafter(pair, monkeypatch, tmp_path):
    """A policy learned on a job whose drafter is called `draft` runs on the engine's one drafter."""
    import json

    policy = tmp_path / "twostate.json"
    params = {"max_batch_on": 2, "k": 3}
    data = {"format": "rlsched-policy", "version": 1, "kind": "twostate", "drafter": "draft", "params": params}
    policy.write_text(json.dumps(data))
    sched = _scheduler(pair, f"twostate:{policy}", monkeypatch, async_scheduling=False)
    assert sched.hook.drafter == "draft" and sched.hook.estimator.drafters == ["draft"]
    _requests(sched, 4)
    ks = []
    for _ in range(3):
        out = sched.schedule()
        ks.append(out.num_spec_tokens_to_schedule)
        sched.update_from_output(out, _output(sched, out))
    assert ks == [0, 0, 0]  # 4 rows, above the file's max_batch_on: speculation off


def test_step_records_say_the_prompt_chunks_beside_the_rows(pair, monkeypatch):
    """Prompts of 20 under a small token budget: the first step prefills one prompt whole and
    the start of the next, the second decodes the first beside the rest of the next (a mixed
    step). Each record says the prompt tokens, their attention's size, sum c (c + 2 cached), and
    the rows that were not in a prompt."""
    from vllm import SamplingParams
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    sched = _scheduler(pair, "static:0", monkeypatch, async_scheduling=False, budget=24)
    records: list[dict] = []
    sched.hook.record = records.append
    for i in range(2):
        sched.add_request(Request(f"r{i}", list(range(1 + i, 21 + i)), SamplingParams(max_tokens=8), None))
    chunks = []
    for _ in range(3):
        out = sched.schedule()
        chunks.append(dict(out.num_scheduled_tokens))
        ids = list(out.num_scheduled_tokens)
        # a runner samples nothing for a prompt not yet whole
        sampled = [[7] if sched.requests[q].num_computed_tokens >= 20 else [] for q in ids]
        sched.update_from_output(
            out,
            ModelRunnerOutput(
                req_ids=ids, req_id_to_index={q: i for i, q in enumerate(ids)}, sampled_token_ids=sampled
            ),
        )
    first = chunks[0]["r1"]  # (the budget vLLM leaves after the first prompt)
    assert chunks[0]["r0"] == 20 and 0 < first < 20 and chunks[1] == {"r0": 1, "r1": 20 - first}
    rest = 20 - first
    got = [(r["kind"], r["prompt_tokens"], r["prompt_sq"], r["decode_rows"]) for r in records]
    assert got == [
        ("prefill", 20 + first, 20 * 20 + first * first, 0),
        ("mixed", rest, rest * (rest + 2 * first), 1),
        ("decode", 0, 0, 2),
    ], got


def test_step_records_count_each_draft_position_over_requests_of_their_own_k(pair, monkeypatch):
    """Requests of different draft lengths in one step, each accepting its own number of
    drafts: the record's counts by position are over the requests that drafted each position
    (`recorder.position_counts`), and add up to the step's drafted and accepted."""
    from vllm.v1.outputs import ModelRunnerOutput

    from rlsched.executor.engine.recorder import position_counts

    sched = _scheduler(pair, "plugin:plugin_policies.cycling_per_request", monkeypatch)
    records: list[dict] = []
    sched.hook.record = records.append
    _requests(sched, 6)
    want = {}
    prev = sched.schedule()
    for _ in range(8):
        nxt = sched.schedule()
        spec, index = prev.scheduled_spec_decode_tokens, sched.hook.index_of
        ids = list(prev.num_scheduled_tokens)
        took = {q: min(index[q] % 3, len(spec.get(q, ()))) for q in ids}  # request i accepts up to i % 3
        sampled = [[7] * (1 + took[q]) for q in ids]
        where = {q: i for i, q in enumerate(ids)}
        runner = ModelRunnerOutput(req_ids=ids, req_id_to_index=where, sampled_token_ids=sampled)
        drafted = [q for q in ids if spec.get(q)]
        want[sched.hook.step] = position_counts([len(spec[q]) for q in drafted], [took[q] for q in drafted])
        sched.update_from_output(prev, runner)
        prev = nxt
    chains = [r for r in records if r["drafted"]]
    assert len(chains) >= 4
    assert any(len(set(r["drafted_by_position"])) > 1 for r in chains)  # rows of different k in one step
    for r in records:
        assert {n: r[n] for n in want[r["step"]] or {}} == (want[r["step"]] or {}), r
        if not r["drafted"]:
            assert r["accepted_by_position"] is None
            continue
        assert sum(r["accepted_by_position"]) == r["accepted"] and sum(r["drafted_by_position"]) == r["drafted"]
        assert len(r["tried_by_position"]) == r["k"] and r["tried_by_position"][0] == r["drafted_by_position"][0]
