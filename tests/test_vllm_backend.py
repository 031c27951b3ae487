"""The vLLM rollout backend (`rollout.backend: vllm`, rlsched/executor/vllm/engine.py and spec.py).

The tests marked `vllm` run the real engine (vLLM's CPU build, in .venv-vllm: `make test-vllm`)
and are skipped where vllm is not importable (the normal `make test`, in .venv). The policy
mapping and the missing-vLLM message need no vLLM and run everywhere.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

import torch  # noqa: E402
from support import ok, rlsched  # noqa: E402

from rlsched.errors import UserError  # noqa: E402
from rlsched.executor.vllm.spec import check_vllm_backend, speculative_plan  # noqa: E402
from rlsched.policies.vllm_plan import TABLE_FIELD  # noqa: E402

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not importable here (make test-vllm sets up .venv-vllm)")


# ----------------------------------------------------------------------------- no vLLM needed


def test_policies_map_onto_speculative_config(tmp_path):
    plan = lambda p, d=Path("d"): speculative_plan(p, d, k_max=4, max_batch=16)  # noqa: E731
    assert plan("off") is None and plan("static:0") is None
    assert plan("static:3") == {"k": 3, "table": None, "drafter": "model", "native": True}
    assert plan("static:4", "ngram") == {"k": 4, "table": None, "drafter": "ngram", "native": True}
    assert plan("static:2", "eagle") == {"k": 2, "table": None, "drafter": "eagle", "native": True}
    head = tmp_path / "head"  # a folder holding an EAGLE-3 head (its config.json says so) is served as eagle3
    head.mkdir()
    (head / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    assert plan("goodput", head)["drafter"] == "eagle"
    with pytest.raises(UserError, match=r"K = 9 is above rollout.k_max = 4"):  # refused, not quietly capped
        plan("static:9", "ngram")
    assert plan("twostate:4:2") == {"k": 2, "table": [[1, 4, 2], [5, 16, 0]], "drafter": "model", "native": True}
    assert plan("twostate:32:2")["table"] is None  # one K for every batch up to max_batch: plain static
    table = tmp_path / "vllm.json"  # `rlsched learn --vllm-table` output
    table.write_text(json.dumps({TABLE_FIELD: [[1, 8, 3], [9, 16, 1]]}))
    assert plan(f"table:{table}") == {"k": 3, "table": [[1, 8, 3], [9, 16, 1]], "drafter": "model", "native": True}
    table.write_text(json.dumps([[1, 16, 0]]))
    assert plan(f"table:{table}") is None
    # rlsched's own policies choose k inside vLLM (vllm_hook), up to k_max
    for p in ("goodput", "seqgoodput", "bandit:0.1", "twostate"):
        assert plan(p) == {"k": 4, "table": None, "drafter": "model", "native": False}, p


@pytest.mark.parametrize(
    "policy, match",
    [
        ("oracle", r"policy 'oracle' reads the simulator's true acceptance"),
        ("goodput:x", r"goodput"),
        ("static:x", r"K must be a whole number"),
        ("table:missing.json", r"does not exist; write one with `rlsched learn --vllm-table"),
    ],
)
def test_policies_vllm_cannot_express_are_one_line(policy, match):
    with pytest.raises(UserError, match=match) as e:
        speculative_plan(policy, Path("d"), k_max=4, max_batch=16)
    assert "\n" not in str(e.value)


def test_bad_tables_and_a_drafting_policy_without_drafter(tmp_path):
    bad = tmp_path / "bad.json"
    for table, match in (
        ([[2, 8, 3]], "must start at batch size 1"),
        ([[1, 8, 3], [4, 9, 1]], "not overlapping"),
        ([[1, 8]], "list of \\[start_bs, end_bs, K\\]"),
    ):
        bad.write_text(json.dumps({TABLE_FIELD: table}))
        with pytest.raises(UserError, match=match):
            speculative_plan(f"table:{bad}", Path("d"), k_max=4, max_batch=16)
    with pytest.raises(UserError, match="drafter is off"):
        speculative_plan("static:2", "off", k_max=4, max_batch=16)
    with pytest.raises(UserError, match=r"policy 'goodput' prices steps, and with the ngram drafter.*cost_model"):
        check_vllm_backend("goodput", "ngram", k_max=4, max_batch=16)
    with pytest.raises(UserError, match=r"drafter suffix runs on the local backend only.*backend local"):
        speculative_plan("static:2", "suffix", k_max=4, max_batch=16)


@pytest.mark.skipif(HAVE_VLLM, reason="vllm is importable here")
def test_without_vllm_the_engine_says_how_to_get_it(tmp_path):
    from rlsched.executor.decode.sampling import SamplingParams
    from rlsched.executor.vllm.engine import VllmRolloutEngine

    with pytest.raises(UserError, match=r"needs vLLM, which is not installed here.*make test-vllm"):
        check_vllm_backend("static:2", "ngram", k_max=2, max_batch=4)
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 256}))
    with pytest.raises(UserError, match=r"needs vLLM, which is not importable.*make test-vllm.*pip install vllm"):
        VllmRolloutEngine(
            tmp_path,
            "off",
            SamplingParams(1.0),
            "off",
            max_batch=4,
            k_max=2,
            max_len=64,
            trace_dir=None,
            seed=0,
            threads=1,
            dtype="float32",
        )


# ----------------------------------------------------------------------------- the real engine


@pytest.fixture(scope="module")
def requests_(pair):
    from rlsched.executor.engine.rows import Request
    from rlsched.executor.model.loading import load_model
    from rlsched.tasks.synthetic import make_examples

    tok = load_model(pair.target).tokenizer
    return [
        Request(tok.encode(e.prompt, add_special_tokens=False).ids, i // 2, i, 24, 1)
        for i, e in enumerate(make_examples(12, 3))
    ]


@pytest.fixture(scope="module")
def self_engine(pair, tmp_path_factory):
    """The target drafting for itself (draft_model = the target folder), static:3, sampled."""
    from rlsched.executor.decode.sampling import SamplingParams
    from rlsched.executor.vllm.engine import VllmRolloutEngine

    torch.set_num_threads(1)
    eng = VllmRolloutEngine(
        pair.target,
        pair.target,
        SamplingParams(1.0),
        "static:3",
        max_batch=8,
        k_max=4,
        max_len=128,
        trace_dir=tmp_path_factory.mktemp("traces"),
        seed=0,
        threads=1,
        dtype="float32",
    )
    yield eng
    eng.close()


def _our_logprobs(model, requests, result) -> list[torch.Tensor]:
    from rlsched.executor.rl.algos import token_logprobs

    out = []
    with torch.no_grad():
        for r, x in zip(requests, result.samples):
            ids = torch.tensor([r.prompt + x.tokens])
            out.append(token_logprobs(model, ids, 1.0)[0, len(r.prompt) - 1 :])
    return out


@pytest.mark.vllm
@needs_vllm
def test_target_drafting_for_itself_accepts_about_every_token(self_engine, requests_):
    self_engine.rl_step = 0
    res = self_engine.run(requests_)
    st = res.stats
    assert st["samples"] == len(requests_) and st["drafted"] > 50
    # sampled SD with p == q accepts every draft (vLLM issue #55005 on CPU broke exactly this)
    assert st["accepted"] / st["drafted"] > 0.9, st
    assert 3.5 < st["mean_accept_len"] <= 4.0
    for r, x in zip(requests_, res.samples):
        assert x.sample_id == r.sample_id and 1 <= len(x.tokens) <= r.max_new_tokens
        assert (r.eos_id not in x.tokens[:-1]) and x.drafted >= x.accepted > 0.9 * x.drafted


@pytest.mark.vllm
@needs_vllm
def test_logprobs_match_our_model(self_engine, requests_, pair):
    from rlsched.executor.model.loading import load_model

    self_engine.rl_step = 1
    res = self_engine.run(requests_)
    ours = _our_logprobs(load_model(pair.target).model, requests_, res)
    diff = max((o - torch.tensor(x.logprobs)).abs().max().item() for o, x in zip(ours, res.samples))
    assert diff < 1e-4, diff
    assert all(lp <= 0 for x in res.samples for lp in x.logprobs)


@pytest.mark.vllm
@needs_vllm
def test_sync_weights_moves_what_vllm_samples_and_scores(self_engine, requests_, pair):
    from rlsched.executor.model.loading import load_model

    original, perturbed = load_model(pair.target).model, load_model(pair.target).model
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in perturbed.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    llm = self_engine.llm
    try:
        self_engine.sync_weights(perturbed, perturbed)  # target and its draft model (the same folder)
        assert self_engine.llm is llm  # in place: no restart
        self_engine.rl_step = 2
        res = self_engine.run(requests_)
        new = _our_logprobs(perturbed, requests_, res)
        old = _our_logprobs(original, requests_, res)
        got = [torch.tensor(x.logprobs) for x in res.samples]
        assert max((n - g_).abs().max().item() for n, g_ in zip(new, got)) < 1e-4
        assert max((o - g_).abs().max().item() for o, g_ in zip(old, got)) > 0.05  # the old weights score otherwise
        assert res.stats["accepted"] / res.stats["drafted"] > 0.9  # the draft model got them too
    finally:
        self_engine.sync_weights(original, original)


@pytest.mark.vllm
@needs_vllm
def test_traces_of_each_run(self_engine, requests_):
    from rlsched.traces.reader import read_trace

    self_engine.rl_step = 7
    res = self_engine.run(requests_[:4])
    self_engine.flush()
    steps = read_trace(self_engine.trace_dir, "steps")
    mine = steps[steps.rl_step == 7]  # one record per engine step, drafting and verifying timed apart
    assert len(mine) == res.stats["steps"] and mine.kind.iloc[0] == "prefill"
    assert set(mine.kind) <= {"prefill", "mixed", "decode"}  # (the engine core steps while requests arrive)
    sd = mine[mine.drafted > 0]
    assert len(sd) and set(sd.drafter) == {"model"} and set(sd.k) == {3}
    assert (sd.draft_ms > 0).all() and (sd.verify_ms > 0).all() and (sd.step_ms >= sd.verify_ms).all()
    assert mine.drafted.sum() == res.stats["drafted"] and mine.accepted.sum() == res.stats["accepted"]
    samples = read_trace(self_engine.trace_dir, "samples")
    s7 = samples[samples.rl_step == 7].sort_values("sample_id")
    assert list(s7.sample_id) == [r.sample_id for r in requests_[:4]]
    assert list(s7.response_len) == [len(x.tokens) for x in res.samples]
    assert s7.drafted.sum() == res.stats["drafted"] and s7.accepted.sum() == res.stats["accepted"]
    assert (s7.rejected <= 1).all()
    e = self_engine.policy_state()[1]  # each sample's own trials, shrunk towards the prior as rlsched's engine does
    own = (s7.accepted + e.prior_mean * e.sample_strength) / (s7.accepted + s7.rejected + e.sample_strength)
    assert np.allclose(s7.acceptance_model, own) and (s7.acceptance_model > e.prior_mean).all()


@pytest.mark.vllm
@needs_vllm
def test_a_rollout_again_at_its_seed_and_step_is_the_same(self_engine, requests_):
    """The engine core holds a rollout's requests until the first step (they start together,
    whatever the timing between processes) and vLLM's workers are seeded per rollout: the same
    rollout again gives the same tokens, another RL step others."""
    runs = []
    for step in (11, 11, 12):
        self_engine.rl_step = step
        runs.append([x.tokens for x in self_engine.run(requests_[:6]).samples])
    assert runs[0] == runs[1] and runs[0] != runs[2]


@pytest.mark.vllm
@needs_vllm
def test_a_request_past_vllms_window_is_refused(self_engine):
    from rlsched.executor.engine.rows import Request

    with pytest.raises(
        UserError, match=r"sample 5: prompt \+ max_new_tokens \(1003 tokens\) exceed vLLM's max_model_len"
    ):
        self_engine.run([Request([3, 4, 5], 0, 5, 1000, 1)])


@pytest.mark.vllm
@needs_vllm
def test_ngram_drafting(pair, requests_):
    """vLLM's n-gram proposer (prompt lookup): lossless log-probs, drafts on repeating text.
    (A second engine in the process: the first one's metrics are this one's from now on.)"""
    from rlsched.executor.decode.sampling import SamplingParams
    from rlsched.executor.model.loading import load_model
    from rlsched.executor.vllm.engine import VllmRolloutEngine

    eng = VllmRolloutEngine(
        pair.target,
        "ngram",
        SamplingParams(1.0),
        "static:2",
        max_batch=8,
        k_max=3,
        max_len=128,
        trace_dir=None,
        seed=0,
        threads=1,
        dtype="float32",
    )
    try:
        res = eng.run(requests_)
        assert res.stats["drafted"] > 0 and 0 < res.stats["accepted"] < res.stats["drafted"]
        ours = _our_logprobs(load_model(pair.target).model, requests_, res)
        assert max((o - torch.tensor(x.logprobs)).abs().max().item() for o, x in zip(ours, res.samples)) < 1e-4
    finally:
        eng.close()


RUN = """
steps: {steps}
seed: 1
threads: 1
policy: {policy}
drafter: {drafter}
checkpoint_every: 1
data: builtin:count,repeat
rollout: {{prompts_per_step: 4, group_size: 4, max_tokens: 16, max_batch: 16, k_max: 3, backend: vllm}}
algorithm: {{minibatches: 1, lr: 0.003}}
drafter_update: {{every: 1, steps: 2, batch: 8, schedule: every}}
"""


@pytest.mark.vllm
@needs_vllm
def test_run_end_to_end_on_vllm_weights_synced_every_step(pair, tmp_path):
    from rlsched.executor.model.loading import load_model
    from rlsched.traces.reader import read_trace

    cfg = tmp_path / "run.yaml"
    cfg.write_text(RUN.format(steps=3, policy="twostate:8:2", drafter="builtin"))
    out = tmp_path / "run"
    proc = ok(rlsched("run", "--config", str(cfg), "--out", str(out), "--json", cwd=tmp_path, timeout=1800))
    summary = json.loads(proc.stdout)  # stdout holds only the JSON (vLLM logs to stderr)
    assert summary["steps"] == 3
    rl = read_trace(out / "traces", "rl_steps").sort_values("rl_step")
    # a step whose groups all scored alike has zero advantages and no gradient (step 0 here)
    assert list(rl.rl_step) == [0, 1, 2] and (rl.grad_norm > 0).sum() >= 2, rl[["reward_mean", "grad_norm"]]
    # vLLM's batch-size table: plain while more than 8 rows run, 2 drafts per step below (a
    # handful of steps: with the 16-layer pair's drafter all 12 drafts of a run were accepted)
    assert rl.drafted.sum() > 0 and 0 < rl.accepted.sum() <= rl.drafted.sum()
    # one minibatch: the update's first forward is the actor that vLLM sampled from, so the
    # old log-probs (vLLM's) match it at every step only if each update reached vLLM
    assert (rl.approx_kl_old.abs() < 1e-4).all() and (rl.clip_frac == 0).all(), rl[["approx_kl_old", "clip_frac"]]
    ck = torch.load(out / "checkpoint.pt", weights_only=False)
    start = load_model(pair.target).model.state_dict()
    assert max((ck["actor"][k] - v).abs().max().item() for k, v in start.items()) > 1e-3
    steps = read_trace(out / "traces", "steps")
    assert sorted(set(steps.rl_step)) == [0, 1, 2]
    # one record per engine step: vLLM's own table drafts (2 tokens) only for 8 rows or fewer
    # (a verify step's batch may hold requests that joined after the drafts were made)
    assert steps.drafted.sum() == rl.drafted.sum() and steps.drafted.max() <= 8 * 2
    samples = read_trace(out / "traces", "samples")
    # acceptance where the rollout drafted (NaN for a rollout that never did: twostate drafts
    # only while 8 rows or fewer run)
    drafted = samples[samples.rl_step.isin(rl.rl_step[rl.drafted > 0])]
    assert len(samples) == 3 * 16 and len(drafted) and drafted.acceptance_model.between(0, 1).all()
    assert samples.accepted.sum() == rl.accepted.sum() and (samples.rejected <= samples.drafted).all()


@pytest.mark.vllm
@needs_vllm
def test_plain_vllm_run_traces_fit(pair, tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(RUN.format(steps=2, policy="off", drafter="off"))
    out = tmp_path / "run"
    ok(rlsched("run", "--config", str(cfg), "--out", str(out), cwd=tmp_path, timeout=1800))
    proc = ok(rlsched("fit", str(out), "--out", str(tmp_path / "cost.json"), "--json", cwd=tmp_path, timeout=1800))
    fitted = json.loads(proc.stdout)
    assert (tmp_path / "cost.json").is_file() and {"verify", "prefill"} <= set(fitted["ops"]), fitted
    # the engine file names the policy the engine ran, and the run replays under vLLM's engine model
    (engine,) = [json.loads(f.read_text()) for f in (out / "traces").glob("engine-*.json")]
    assert engine["rlsched"]["policy"] == "off"
    replayed = json.loads(ok(rlsched("replay", str(out), "--json", cwd=tmp_path, timeout=1800)).stdout)
    assert replayed["rl_steps"] == 2 and replayed["predicted_generation_s"] > 0, replayed


@pytest.mark.vllm
@needs_vllm
def test_a_policy_vllm_cannot_run_is_one_line_exit_2(tmp_path):
    proc = rlsched(
        "run",
        "--backend",
        "vllm",
        "--policy",
        "oracle",
        "--set",
        "steps=1",
        "--out",
        str(tmp_path / "r"),
        cwd=tmp_path,
        timeout=1800,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "policy 'oracle' reads the simulator's true acceptance" in lines[0]
    assert "Traceback" not in proc.stderr and not (tmp_path / "r").exists()


@pytest.mark.vllm
@needs_vllm
def test_run_with_rlsched_policies_inside_vllm(pair, tmp_path):
    """seqgoodput on vLLM: step costs measured through vLLM at start-up, every request its own
    draft length each step (ragged verifies in the step records), weights synced every step."""
    from rlsched.traces.reader import read_trace

    cfg = tmp_path / "run.yaml"
    cfg.write_text(RUN.format(steps=2, policy="seqgoodput", drafter="builtin"))
    out = tmp_path / "run"
    proc = ok(rlsched("run", "--config", str(cfg), "--out", str(out), "--json", cwd=tmp_path, timeout=1800))
    assert json.loads(proc.stdout)["steps"] == 2 and "measuring step costs through vLLM" in proc.stderr
    steps = read_trace(out / "traces", "steps")
    sd = steps[(steps.kind == "decode") & (steps.drafted > 0)]
    assert sorted(set(steps.rl_step)) == [0, 1] and len(sd) and (sd.draft_ms > 0).all()
    assert (sd.accepted <= sd.drafted).all() and (sd.k <= 3).all()
    rl = read_trace(out / "traces", "rl_steps")
    assert rl.drafted.sum() == steps.drafted.sum() and rl.accepted.sum() == steps.accepted.sum()
    # one way in: the engine core ran in its own process, started by engine arguments
    (engine,) = [json.loads(f.read_text()) for f in (out / "traces").glob("engine-*.json")]
    assert engine["own_process"] and engine["rlsched"]["trace_dir"] == str((out / "traces").absolute())
    assert engine["max_batch"] == 16 and engine["k_max"] == 3 and engine["tp"] == 1
    assert engine["rlsched"]["policy"] == "seqgoodput"  # handed over after start-up, named for replay


def test_the_run_device_must_be_the_vllm_builds():
    from types import SimpleNamespace

    from rlsched.executor.vllm.spec import check_device

    check_device("cpu", SimpleNamespace(device_type="cpu"))
    check_device("cuda:0", SimpleNamespace(device_type="cuda"))
    for device, built in (("cuda", "cpu"), ("cpu", "cuda"), ("cuda:1", "cuda")):
        with pytest.raises(UserError, match=rf"device '{device}': the vLLM build here runs on '{built}'"):
            check_device(device, SimpleNamespace(device_type=built))


@pytest.mark.vllm
@needs_vllm
def test_a_vllm_run_killed_and_resumed_restores_its_policy_and_loses_nothing(pair, tmp_path):
    """goodput on one vLLM engine, killed (-9) once a checkpoint is written and resumed: every
    step once, every sample once, and the resumed engine runs on the checkpoint's estimator
    and policy (no start-up calibration the second time)."""
    from support import run_then_kill

    from rlsched.traces.reader import read_trace

    cfg = tmp_path / "run.yaml"
    cfg.write_text(RUN.format(steps=4, policy="goodput", drafter="builtin"))
    out = tmp_path / "cut"
    run_then_kill(cfg, out, tmp_path, steps_recorded=2, timeout=1800, checkpoint=True)
    assert not (out / "summary.json").exists()
    done = ok(rlsched("run", "--out", str(out), "--resume", cwd=tmp_path, timeout=1800))
    assert "resuming" in done.stderr and " at step 0" not in done.stderr
    assert "measuring step costs through vLLM" not in done.stderr  # the policy came back from the checkpoint
    rl = read_trace(out / "traces", "rl_steps")
    assert sorted(rl.rl_step) == [0, 1, 2, 3]
    samples = read_trace(out / "traces", "samples")
    per_step = samples.groupby("rl_step").sample_id.agg(["nunique", "size"])
    assert (per_step["nunique"] == 16).all() and (per_step["size"] == 16).all()
