"""The simulator's model of vLLM V1's engine (`engine.kind: vllm`) against closed-form cases:
the token budget split, prefix caching, preemption and recompute, CUDA-graph padding, async
scheduling, and `kind: rlsched` left as it was."""

from __future__ import annotations

import numpy as np
import pytest
import simpy
from support import one_line_error, rlsched

from rlsched.config import load_config
from rlsched.costs.choose import cost_model_for
from rlsched.engine_config import EngineSpec, default_capture_sizes
from rlsched.policies.acceptance import AcceptanceEstimator
from rlsched.policies.draft import PolicyContext
from rlsched.policies.realloc import make_realloc_policy
from rlsched.policies.registry import make_draft_policy
from rlsched.sim.cluster import GenerationStage
from rlsched.sim.simulate import simulate
from rlsched.sim.timeline import KIND_DECODE, KIND_MIXED, KIND_PREFILL, Timeline
from rlsched.sim.vllm_engine import STATS
from rlsched.sim.workload import Rollout

NGRAM = (
    "drafters=[{name: ng, kind: ngram, acceptance: {mean: 0.6, prompt_concentration: null, "
    "sample_concentration: null}}]"
)


def config(prompts: int, group: int, prompt: int, response: int, *extra: str):
    """One instance, one RL step, fixed lengths, vLLM's engine (prefix caching off unless asked)."""
    return load_config(
        "default",
        overrides=[
            "cluster.instances=1",
            "rl.steps=1",
            f"workload.prompts={prompts}",
            f"workload.samples_per_prompt={group}",
            f"workload.prompt_len={{dist: fixed, value: {prompt}}}",
            f"workload.response_len={{dist: fixed, value: {response}}}",
            "drafters.0.acceptance.prompt_concentration=null",
            "drafters.0.acceptance.sample_concentration=null",
            "engine.kind=vllm",
            "engine.enable_prefix_caching=false",
            *extra,
        ],
    )


def stage_of(cfg, policy: str) -> GenerationStage:
    """A generation stage of one instance, stepped by hand (`step`)."""
    w = cfg.workload
    n = w.prompts * w.samples_per_prompt
    rollout = Rollout(
        np.repeat(np.arange(w.prompts), w.samples_per_prompt),
        np.full(n, w.prompt_len.value),
        np.full(n, w.response_len.value),
        np.full((n, len(cfg.drafters)), 0.7),
        tuple(d.name for d in cfg.drafters),
    )
    cost = cost_model_for(cfg)
    ctx = PolicyContext(cost=cost, drafters=tuple(d.name for d in cfg.drafters), k_max=cfg.speculation.k_max)
    return GenerationStage(
        simpy.Environment(),
        cfg,
        cost,
        rollout,
        [make_draft_policy(policy, ctx)],
        make_realloc_policy("none"),
        AcceptanceEstimator([d.name for d in cfg.drafters]),
        Timeline(),
        0,
        np.random.SeedSequence(0),
        10**6,
    )


def step(stage: GenerationStage):
    """Schedule one step of the instance and run its forward; (n, prefix, chunks) scheduled."""
    inst = stage.instances[0]
    inst._record, inst._learn_acceptance, inst._observes = None, True, True
    strat, n, prefix, chunks = inst._schedule()

    def forward():
        yield from inst._forward(strat, n, prefix, chunks)

    stage.env.run(until=stage.env.process(forward()))
    return n.tolist(), prefix.tolist(), chunks.tolist()


def stats(result) -> dict:
    return result.summary()["vllm_engine"]


# ----------------------------------------------------------------------------- the token budget


def test_the_budget_goes_to_decode_and_draft_tokens_first_then_prompt_chunks():
    """Budget 50, prompts of 40, static:3 (a row verifying 3 drafts takes 4 tokens)."""
    cfg = config(3, 1, 40, 200, "engine.max_num_batched_tokens=50")
    st = stage_of(cfg, "static:3")
    inst = st.instances[0]
    # step 1: no decode rows; the first prompt whole, 10 tokens of the second
    assert step(st) == ([], [0, 0], [40, 10])
    assert inst.batch == 1 and int(inst.ctx[0]) == 41  # the completed prompt sampled its first token
    # step 2: the row's 1 + 3 tokens, the second prompt's remaining 30, 16 of the third
    assert step(st) == ([4], [10, 0], [30, 16])
    # step 3: two rows of 4, the third prompt's remaining 24 (50 - 8 - 24 = 18 left unused)
    assert step(st) == ([4, 4], [16], [24])
    # step 4: three rows of 4
    assert step(st) == ([4, 4, 4], [], [])


def test_a_short_budget_cuts_the_drafts_of_the_last_rows():
    cfg = config(3, 1, 8, 200, "engine.max_num_batched_tokens=10")
    st = stage_of(cfg, "static:3")
    assert step(st) == ([], [0, 0], [8, 2])
    while st.instances[0].pre or st.instances[0].waiting:
        step(st)
    n, _, chunks = step(st)
    assert n == [4, 4, 2] and chunks == []  # 10 tokens: the third row verifies 1 draft, not 3


def test_a_rollout_starts_with_mixed_steps_when_prompts_are_chunked():
    res = simulate(config(4, 1, 300, 64, "engine.max_num_batched_tokens=256"), "off")
    kinds = res.timeline.arrays()["kind"]
    assert kinds[0] == KIND_PREFILL and (kinds == KIND_MIXED).sum() >= 3
    assert stats(res)["prefill_tokens"] == 4 * 300 and stats(res)["mixed_steps"] == (kinds == KIND_MIXED).sum()


def test_without_chunked_prefill_a_prompt_waits_for_a_step_that_holds_it_whole():
    cfg = config(3, 1, 40, 10, "engine.max_num_batched_tokens=50", "engine.enable_chunked_prefill=false")
    st = stage_of(cfg, "static:3")
    assert step(st) == ([], [0], [40])
    assert step(st) == ([4], [0], [40])


# ----------------------------------------------------------------------------- prefix caching


@pytest.mark.parametrize("prompt", [40, 32])
def test_a_group_is_prefilled_once_plus_its_partial_blocks(prompt):
    """Block 16: the first sample computes its prompt; each other one only the tokens past the
    last cached block boundary below its prompt (a whole last block when block-aligned: vLLM
    computes at least one token)."""
    n, bs = 4, 16
    res = simulate(config(2, n, prompt, 20, "engine.enable_prefix_caching=true"), "off")
    tail = prompt - (prompt - 1) // bs * bs
    assert stats(res)["prefill_tokens"] == 2 * (prompt + (n - 1) * tail)
    assert stats(res)["cached_tokens"] == 2 * (n - 1) * (prompt - tail)
    off = simulate(config(2, n, prompt, 20), "off")
    assert stats(off)["prefill_tokens"] == 2 * n * prompt and stats(off)["cached_tokens"] == 0


# ----------------------------------------------------------------------------- preemption


def test_the_newest_request_is_preempted_and_recomputed_from_its_context():
    """6 blocks of 16 tokens, two requests of 16 + 48 tokens, no drafter: both hold 3 blocks at
    48 tokens; at 49 each needs 4, so the newer one is preempted holding 49, waits for the older
    one to finish and prefills its 49 tokens again."""
    cfg = config(2, 1, 16, 48, "drafters=[]", "speculation.policy=off", "cluster.kv_capacity_tokens=96")
    res = simulate(cfg)
    s = stats(res)
    assert s["preempted_tokens"] == 49 and res.summary()["preemptions"] == 1
    assert s["prefill_tokens"] == 16 + 16 + 49
    samples = res.samples_frame()
    assert samples["preemptions"].tolist() == [0, 1]
    assert samples["finish_s"][0] < samples["finish_s"][1]


# ----------------------------------------------------------------------------- CUDA graphs


@pytest.mark.parametrize(("sizes", "runs_at"), [("[1, 2, 4, 8, 16]", 8), ("[1, 2, 4]", 5)])
def test_a_decode_step_costs_what_its_capture_size_costs(sizes, runs_at):
    """Five rows of one token: padded to 8 with a graph of 8, eager at 5 above the largest size."""
    cfg = config(
        5, 1, 16, 32, "drafters=[]", f"engine.cudagraph_capture_sizes={sizes}", "engine.async_scheduling=false"
    )
    res = simulate(cfg, "off")
    c = res.timeline.arrays()
    dec = (c["kind"] == KIND_DECODE) & (c["batch"] == 5)
    assert dec.sum() == 31
    step_s = c["draft_s"][dec] + c["verify_s"][dec]
    expected = [res.cost.verify_time(runs_at, 1, int(ctx)) for ctx in c["ctx_tokens"][dec]]
    assert step_s == pytest.approx(expected, rel=1e-12)
    assert stats(res)["padded_tokens"] == 31 * (runs_at - 5)


def test_default_capture_sizes_follow_vllm():
    assert default_capture_sizes(256, 16384)[:5] == [1, 2, 4, 8, 16]
    assert default_capture_sizes(256, 16384)[-3:] == [480, 496, 512]
    assert default_capture_sizes(4, 16384) == [1, 2, 4, 8]
    eng = EngineSpec(kind="vllm").resolve(80.0, "h100-sxm", 256, host_drafter=False)
    assert (eng.max_num_batched_tokens, eng.async_scheduling, eng.block_size) == (16384, True, 16)
    assert EngineSpec(kind="vllm").resolve(40.0, "a100-40gb", 256, host_drafter=True).max_num_batched_tokens == 8192
    assert eng.padded(5) == 8 and eng.padded(513) == 513


# ----------------------------------------------------------------------------- async scheduling


def test_async_scheduling_overlaps_host_work_and_sync_adds_it():
    """An n-gram drafter drafts on the host: synchronous, a step is the GPU's price plus the
    host's drafting; async, the longer of the GPU's part and the host's (overhead + drafting)."""
    base = (NGRAM, "speculation.policy=static:2", "engine.cudagraph_capture_sizes=[]")
    sync = simulate(config(6, 1, 64, 48, *base, "engine.async_scheduling=false"))
    asyn = simulate(config(6, 1, 64, 48, *base, "engine.async_scheduling=true"))
    s, a = sync.timeline.arrays(), asyn.timeline.arrays()
    assert np.array_equal(s["emitted"], a["emitted"])  # the same steps, timed differently
    oh = sync.cost.step_overhead
    host = s["draft_s"]
    dec = s["kind"] == KIND_DECODE
    assert host[dec] == pytest.approx([sync.cost.draft_time("ng", int(b), 2, 0) for b in s["batch"][dec]])
    price = s["draft_s"] + s["verify_s"] - host  # sync: price + host drafting
    assert a["draft_s"] + a["verify_s"] == pytest.approx(np.maximum(price - oh, oh + host), rel=1e-9)
    assert asyn.summary()["generation_s"] < sync.summary()["generation_s"]


# ----------------------------------------------------------------------------- rlsched's engine


def test_kind_rlsched_ignores_the_vllm_knobs():
    overrides = ["rl.steps=1", "workload.prompts=8"]
    plain = simulate(load_config("default", overrides=overrides))
    knobs = [
        "engine.kind=rlsched",
        "engine.max_num_batched_tokens=7",
        "engine.cudagraph_capture_sizes=[3]",
        "engine.async_scheduling=true",
        "engine.block_size=64",
    ]
    same = simulate(load_config("default", overrides=overrides + knobs))
    a, b = plain.timeline.arrays(), same.timeline.arrays()
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert plain.summary() == same.summary() and "vllm_engine" not in plain.summary()
    assert plain.config.engine.kind == "rlsched"


def test_every_sample_finishes_with_its_tokens_on_two_instances():
    cfg = load_config(
        "default", overrides=["rl.steps=1", "workload.prompts=8", "engine.kind=vllm", "cluster.realloc=rebalance"]
    )
    res = simulate(cfg)
    samples = res.samples_frame()
    assert samples["finish_s"].notna().all()
    emitted = res.timeline.arrays()["emitted"].sum()
    assert emitted == samples["response_len"].sum()
    assert set(stats(res)) == set(STATS)


# ----------------------------------------------------------------------------- bad settings


@pytest.mark.parametrize(
    ("setting", "field"),
    [
        ("engine.kind=bogus", "engine.kind"),
        ("engine.max_num_batched_tokens=0", "engine.max_num_batched_tokens"),
        ("engine.cudagraph_capture_sizes=[4, 2]", "engine.cudagraph_capture_sizes"),
        ("engine.block_size=-16", "engine.block_size"),
    ],
)
def test_bad_engine_settings_are_refused_naming_the_field(tmp_path, setting, field):
    proc = rlsched("simulate", "--set", setting, "--set", "rl.steps=1", "--out", str(tmp_path / "o"), cwd=tmp_path)
    one_line_error(proc, field)
    assert not (tmp_path / "o").exists()


def test_a_budget_below_a_whole_sequence_without_chunking_is_refused(tmp_path):
    proc = rlsched(
        "simulate",
        "--set",
        "engine.kind=vllm",
        "--set",
        "engine.enable_chunked_prefill=false",
        "--set",
        "engine.max_num_batched_tokens=64",
        "--set",
        "rl.steps=1",
        "--set",
        "workload.prompts=8",
        "--out",
        str(tmp_path / "o"),
        cwd=tmp_path,
    )
    one_line_error(proc, "engine.max_num_batched_tokens", "engine.enable_chunked_prefill")
    assert not (tmp_path / "o").exists()
