"""`rlsched plan` under the simulator's vLLM engine model (`engine.kind: vllm`): the space holds
vLLM's knobs where they can change the result (`plan/knobs.py`), the screen prices them, the
plan does not choose a setting that throttles or pads, and its files carry the chosen values;
bad knob values are one line and exit 2."""

from __future__ import annotations

import json
import shlex

import pytest
import yaml
from support import ok, one_line_error, rlsched

from rlsched.config import load_config
from rlsched.engine_config import default_capture_sizes
from rlsched.errors import UserError
from rlsched.plan.feasible import longest_sequence
from rlsched.plan.knobs import EngineKnobs, dense_capture_sizes, engine_options
from rlsched.plan.screen import screen, screen_setups
from rlsched.plan.space import Candidate, Space, candidates, from_config, to_config
from rlsched.policies.engine_args import EngineFacts, HookSettings, verl_rollout_section, vllm_engine_kwargs
from rlsched.policies.registry import parse_policy

SMALL = ["rl.steps=1", "workload.prompts=8", "record_timeline=false", "cluster.max_batch=16"]
SPACE = Space(2, tps=(1,), max_batches=(16,), static_ks=(3,), reallocs=("none",), colocated=(1.0,), split=())


def _base(*extra: str, kind: str = "vllm"):
    return load_config(preset="default", overrides=[*SMALL, f"engine.kind={kind}", *extra])


def test_the_space_holds_vllms_knobs_under_its_engine_only():
    plain = candidates(_base(kind="rlsched"), SPACE)
    assert plain and all(c.engine is None for c in plain)
    vllm = candidates(_base(), SPACE)
    settings = {c.engine for c in vllm}
    assert None not in settings
    assert {e.batched_tokens for e in settings} >= {2048, 4096}
    assert {e.capture for e in settings} == {"vllm", "dense"}
    assert {e.chunked_prefill for e in settings} == {True, False}
    # every setup of rlsched's engine is there under vLLM's, at each of its settings
    assert {c.label for c in plain} == {Candidate(**{**c.__dict__, "engine": None}).label for c in vllm}
    assert len(vllm) > len(plain)


def test_knobs_are_pruned_where_they_cannot_change_the_result():
    base = _base()
    longest = longest_sequence(base)
    opts = engine_options(base, 16, 1, longest, budgets=(8, 2048, 4096, 8192, 1 << 22))
    budgets = sorted({o.batched_tokens for o in opts})
    assert 8 not in budgets  # below max_num_seqs: vLLM refuses it
    assert budgets[-1] == 1 << 22  # the only budget that holds every token a step could schedule
    assert all(o.chunked_prefill for o in opts if o.batched_tokens == 1 << 22)  # never chunks: no choice
    assert all(o.batched_tokens >= longest for o in opts if not o.chunked_prefill)  # vLLM refuses less
    # a config that runs eagerly has no graphs to choose; rlsched's engine has no knobs at all
    eager = engine_options(_base("engine.cudagraph_capture_sizes=[]"), 16, 1, longest)
    assert {(o.capture, o.sizes) for o in eager} == {("eager", ())}
    assert engine_options(_base(kind="rlsched"), 16, 1, longest) == [None]
    # a dense grid that resolves to vLLM's own (a batch limit of 1) is not tried twice
    assert {o.capture for o in engine_options(base, 1, 1, longest, budgets=(2048,))} == {"vllm"}
    dense, default = dense_capture_sizes(64, 8192), default_capture_sizes(64, 8192)
    assert set(default) <= set(dense) and dense[-1] == default[-1] == 128


def _scored(base, engine: EngineKnobs) -> float:
    c = Candidate(1, 2, 16, 0.9, parse_policy("static:3:model"), "model", engine=engine)
    (s,), dropped = screen(base, [c])
    assert not dropped
    return s.score


def test_the_screen_prices_a_budget_that_throttles_and_a_grid_that_pads():
    base = _base()
    assert base.drafters[0].name == "model"
    default = _scored(base, EngineKnobs(16384))
    assert _scored(base, EngineKnobs(16)) > 1.2 * default  # 16 rows x 4 tokens a step in budgets of 16
    assert _scored(base, EngineKnobs(16384, True, "own", (1, 4096))) > 1.2 * default  # every step at 4096
    assert _scored(base, EngineKnobs(16384, True, "dense", tuple(dense_capture_sizes(16, 16384)))) <= default


def test_the_screen_searches_a_setting_only_where_it_gains():
    base = _base("engine.max_num_batched_tokens=16", "engine.cudagraph_capture_sizes=[1,4096]")
    scored, dropped, pool = screen_setups(base, candidates(base, SPACE))
    assert scored and len(pool) < len(scored)
    for s in pool:  # the throttling budget and the padding grid are screened, never searched
        assert s.candidate.engine.batched_tokens != 16 and s.candidate.engine.capture != "own"
    assert any(s.candidate.engine.batched_tokens == 16 for s in scored)
    own = from_config(base)
    assert own.engine == EngineKnobs(16, True, "own", (1, 4096))
    assert to_config(base, own).engine.max_num_batched_tokens == 16


def _plan(root, *extra: str):
    args = [
        "plan",
        "--workload",
        "default",
        "--gpus",
        "2",
        "--tp",
        "1",
        "--max-batch",
        "16",
        "--seeds",
        "1",
        "--survivors",
        "3",
        "-j",
        "1",
        "--no-learn",
        "--drafters",
        "model",
        "--out",
        str(root / "plan"),
        "--json",
    ]
    for s in [*SMALL, "engine.kind=vllm", *extra]:
        args += ["--set", s]
    return rlsched(*args, cwd=root, timeout=900)


@pytest.fixture(scope="module")
def throttled(tmp_path_factory):
    """A plan whose own setup has a budget that throttles and a grid that pads every step."""
    root = tmp_path_factory.mktemp("knobs")
    proc = ok(_plan(root, "engine.max_num_batched_tokens=16", "engine.cudagraph_capture_sizes=[1,4096]"))
    return root / "plan", json.loads(proc.stdout)


def test_the_plan_does_not_choose_a_setting_that_throttles_or_pads(throttled):
    out, summary = throttled
    plan = json.loads((out / "plan.json").read_text())
    winner = plan["rows"][0]
    assert winner["setup"] == summary["winner"]
    assert " tokens16 " not in winner["setup"] + " " and "graphs:own" not in winner["setup"]
    assert "tokens16 " in plan["own"] + " " and "graphs:own" in plan["own"]
    assert summary["own_step_s"] > summary["winner_step_s"]
    moved = {k["knob"]: k for k in plan["knobs"]}
    assert moved["engine"]["from"].startswith("tokens16 ") and moved["engine"]["gain"] > 0.1


def test_the_files_carry_the_knobs_the_plan_simulated(throttled):
    out, _ = throttled
    sim = yaml.safe_load((out / "sim.yaml").read_text())["engine"]
    engine = json.loads((out / "vllm_engine.json").read_text())
    assert sim["kind"] == "vllm"
    assert engine["max_num_batched_tokens"] == sim["max_num_batched_tokens"] != 16
    assert engine["enable_chunked_prefill"] == sim["enable_chunked_prefill"]
    assert engine["enable_prefix_caching"] is True
    assert engine.get("cudagraph_capture_sizes") == sim["cudagraph_capture_sizes"]
    serve = shlex.split((out / "vllm_serve.sh").read_text().replace("\\\n", " "), comments=True)
    i = serve.index("--max-num-batched-tokens")
    assert serve[i + 1] == str(engine["max_num_batched_tokens"])
    assert ("--enable-chunked-prefill" if engine["enable_chunked_prefill"] else "--no-enable-chunked-prefill") in serve
    rollout = yaml.safe_load((out / "verl_rollout.yaml").read_text())["actor_rollout_ref"]["rollout"]
    assert rollout["max_num_batched_tokens"] == engine["max_num_batched_tokens"]
    assert "max_num_batched_tokens" not in rollout["engine_kwargs"]["vllm"]
    assert f"'max_num_batched_tokens': {engine['max_num_batched_tokens']}" in (out / "openrlhf_launch.py").read_text()


def test_engine_arguments_write_the_knobs_for_every_framework():
    facts = EngineFacts(
        "m",
        max_num_seqs=8,
        max_model_len=512,
        max_num_batched_tokens=4096,
        enable_chunked_prefill=False,
        enable_prefix_caching=True,
        cudagraph_capture_sizes=(1, 2, 4, 8),
    )
    kw = vllm_engine_kwargs(facts, HookSettings("off"))
    assert kw["max_num_batched_tokens"] == 4096 and kw["cudagraph_capture_sizes"] == [1, 2, 4, 8]
    from rlsched.policies.engine_args import vllm_serve_argv

    argv = vllm_serve_argv(kw)
    i = argv.index("--cudagraph-capture-sizes")
    assert argv[i + 1 : i + 5] == ["1", "2", "4", "8"] and "--no-enable-chunked-prefill" in argv
    eager = vllm_engine_kwargs(EngineFacts("m", cudagraph_capture_sizes=()), HookSettings("off"))
    assert eager["enforce_eager"] is True and "cudagraph_capture_sizes" not in eager
    assert verl_rollout_section(eager)["actor_rollout_ref"]["rollout"]["enforce_eager"] is True
    plain = vllm_engine_kwargs(EngineFacts("m"), HookSettings("off"))
    assert not {"max_num_batched_tokens", "enable_chunked_prefill", "cudagraph_capture_sizes"} & set(plain)


@pytest.mark.parametrize(
    ("facts", "name"),
    [
        (dict(max_num_batched_tokens=4, max_num_seqs=8), "max_num_batched_tokens"),
        (dict(max_num_batched_tokens=256, enable_chunked_prefill=False, max_model_len=512), "max_model_len"),
        (dict(cudagraph_capture_sizes=(8, 4)), "cudagraph_capture_sizes"),
        (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
    ],
)
def test_engine_arguments_refuse_knobs_vllm_refuses(facts, name):
    with pytest.raises(UserError, match=name):
        vllm_engine_kwargs(EngineFacts("m", **facts), HookSettings("off"))


@pytest.mark.parametrize(
    ("sets", "names"),
    [
        (["engine.max_num_batched_tokens=0"], ["max_num_batched_tokens"]),
        (["engine.max_num_batched_tokens=8"], ["max_num_batched_tokens", "max_num_seqs"]),
        (["engine.enable_chunked_prefill=false", "engine.max_num_batched_tokens=64"], ["chunked prefill"]),
        (["engine.cudagraph_capture_sizes=[8,4]"], ["cudagraph_capture_sizes"]),
    ],
)
def test_bad_knob_values_are_one_line(tmp_path, sets, names):
    one_line_error(_plan(tmp_path, *sets), *names)
    assert not (tmp_path / "plan").exists()


def test_the_search_and_its_pins_take_only_the_settings_the_screen_lets_in():
    from rlsched.plan.planner import make_plan

    base = _base()
    _, _, pool = screen_setups(base, candidates(base, SPACE))
    plan = make_plan(base, SPACE, seeds=1, survivors=2, explain=False)
    let_in = {s.candidate for s in pool} | {from_config(base)}
    assert plan.ranked and all(x.candidate in let_in for x in plan.ranked)
    assert plan.baseline is not None and plan.baseline.candidate.engine == EngineKnobs(16384)
