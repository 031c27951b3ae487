"""The rollout engine: continuous batching, policies, traces, log-probs.

Tiny random Llama pair (vocab 16, written with save_pretrained): the drafter is the target
with small noise, so that it accepts often but not always.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


from rlsched.errors import UserError  # noqa: E402
from rlsched.executor.decode.drafters import ModelDrafter, NgramDrafter  # noqa: E402
from rlsched.executor.decode.sampling import GREEDY, SamplingParams  # noqa: E402
from rlsched.executor.decode.speculative import generate  # noqa: E402
from rlsched.executor.decode.suffix import SuffixDrafter  # noqa: E402
from rlsched.executor.engine.rollout import RolloutEngine, build_policy  # noqa: E402
from rlsched.executor.engine.rows import Request  # noqa: E402
from rlsched.policies.acceptance import AcceptanceEstimator  # noqa: E402
from rlsched.policies.types import OFF, Strategy  # noqa: E402
from rlsched.traces import read_trace  # noqa: E402

V = 16
PROMPTS = [[1, 2, 3], [4, 4, 4, 4], [7, 1, 7, 1, 7], [2], [5, 6, 5, 6, 5, 6], [3, 9, 12]]


def requests(n_per_prompt: int = 2, max_new: int = 20, eos: int | None = None) -> list[Request]:
    out = []
    for pid, prompt in enumerate(PROMPTS):
        for _ in range(n_per_prompt):
            out.append(Request(list(prompt), pid, 100 + len(out), max_new, eos))
    return out


def make_drafter(tiny, kind: str, sampling=GREEDY, max_batch: int = 4):
    if kind == "ngram":
        return NgramDrafter(max_n=3)
    if kind == "suffix":
        return SuffixDrafter(depth=4)
    return ModelDrafter(tiny.drafter, sampling, max_batch=max_batch, max_len=64)


def engine(tiny, drafter_kind, policy, max_batch=4, capacity=1000, trace_dir=None, sampling=GREEDY, **kw):
    drafter = None if drafter_kind is None else make_drafter(tiny, drafter_kind, sampling, max_batch)
    names = () if drafter is None else (drafter.name,)
    if isinstance(policy, str):
        policy = build_policy(policy, names)
    return RolloutEngine(
        tiny.target, drafter, capacity, max_batch, sampling, policy, AcceptanceEstimator(names), trace_dir, **kw
    )


def test_continuous_batching_completes_every_request(tiny):
    reqs = requests(3, 15)  # 18 requests, 4 rows at a time
    res = engine(tiny, "ngram", "static:3").run(reqs)
    assert [s.sample_id for s in res.samples] == [r.sample_id for r in reqs]
    assert len({s.sample_id for s in res.samples}) == len(reqs)
    assert all(len(s.tokens) == 15 for s in res.samples)
    assert [s.prompt_id for s in res.samples] == [r.prompt_id for r in reqs]
    assert res.stats["tokens"] == 15 * len(reqs) and res.stats["tokens_per_s"] > 0


def test_kv_budget_limits_the_batch_and_eos_stops_a_sample(tiny):
    reqs = requests(2, 12)
    need = max(len(r.prompt) + 12 for r in reqs)
    e = engine(tiny, "ngram", "static:2", max_batch=8, capacity=2 * need)  # at most 2 rows fit
    ref = e.run(reqs)
    eos = ref.samples[0].tokens[4]
    got = engine(tiny, "ngram", "static:2", max_batch=8, capacity=2 * need).run(requests(2, 12, eos))
    for a, b in zip(ref.samples, got.samples):
        if eos in a.tokens:
            assert b.tokens == a.tokens[: a.tokens.index(eos) + 1]
        else:
            assert b.tokens == a.tokens
    with pytest.raises(UserError, match="cache capacity"):
        engine(tiny, "ngram", "static:2", capacity=10).run(reqs)


@pytest.mark.parametrize("kind", ["ngram", "model"])
def test_greedy_static_equals_off_and_reference(tiny, kind):
    reqs = requests(2, 20)
    want, _, _ = generate(tiny.target, [r.prompt for r in reqs], 20, GREEDY)
    off = engine(tiny, None, "off").run(reqs)
    sd = engine(tiny, kind, "static:3").run(reqs)
    assert [s.tokens for s in off.samples] == want
    assert [s.tokens for s in sd.samples] == want
    assert sd.stats["accepted"] > 0 and sd.stats["mean_accept_len"] > 1.0


@pytest.mark.parametrize("kind, policy", [("model", "tree:3:2:6"), ("model", "tree:2:3:6"), ("suffix", "tree:3:2:6")])
def test_greedy_trees_equal_off(tiny, kind, policy):
    """Draft trees verified in the engine (continuous batching, rows joining and leaving) emit
    exactly greedy decoding's tokens."""
    reqs = requests(3, 20)  # 18 requests, 4 rows at a time
    want, _, _ = generate(tiny.target, [r.prompt for r in reqs], 20, GREEDY)
    sd = engine(tiny, kind, policy).run(reqs)
    assert [s.tokens for s in sd.samples] == want
    assert sd.stats["accepted"] > 0 and sd.stats["mean_accept_len"] > 1.0


class TreesPay:
    """A cost model where a verify costs the same for any number of tokens a row (a GPU at a
    small batch, taken to its limit) and drafting next to nothing: the deepest, widest draft
    the estimates make likeliest pays."""

    def verify_time(self, batch, q, ctx_tokens):
        return np.full(np.shape(q), 1e-2) if np.ndim(q) else 1e-2

    def draft_time(self, drafter, batch, k, ctx_tokens, width=1):
        return 1e-5 * np.asarray(k, dtype=float) * width

    def draft_time_per_row(self, drafter, ks, ctx_tokens):
        return 1e-5 * np.asarray(ks, dtype=float).max(axis=-1, initial=0)

    def prefill_time(self, n_tokens, sum_sq_tokens=None):
        return 1e-3

    def drafter_prefill_time(self, drafter, n_tokens, sum_sq_tokens=None):
        return 0.0

    def kv_transfer_time(self, ctx_tokens, n_seqs):
        return 0.0


@pytest.mark.parametrize("kind", ["model", "suffix"])
def test_goodput_chooses_draft_trees_where_they_pay_and_stays_lossless(tiny, kind, tmp_path):
    """With width_max > 1 goodput prices trees beside chains every step; where trees pay it
    runs them (steps recorded with their width), and greedy output stays greedy decoding's.
    With width_max 1 the same policy drafts chains only."""
    reqs = requests(3, 20)
    want, _, _ = generate(tiny.target, [r.prompt for r in reqs], 20, GREEDY)
    for width_max in (3, 1):
        policy = build_policy(
            "goodput", (kind,), TreesPay(), k_max=8, max_batch=4, width_max=width_max, nodes_max=8, calibrate=False
        )
        traces = tmp_path / f"w{width_max}"
        sd = engine(tiny, kind, policy, trace_dir=traces, k_max=8).run(reqs)
        assert [s.tokens for s in sd.samples] == want
        widths = read_trace(traces, "steps").query("kind == 'decode' and k > 0").width
        assert (widths > 1).any() if width_max > 1 else (widths == 1).all(), widths.value_counts()


def test_a_tree_step_shows_the_estimator_rank_1_trials():
    """Root -> node 0 (rank 1) -> node 2 (rank 1); root -> node 1 (rank 2). Accepted nodes are
    hits (rank 1) or misses; where the walk stopped, a present rank-1 child is a miss."""
    from rlsched.executor.decode.tree_verify import DraftTree
    from rlsched.executor.engine.rollout import _rank1_trials

    tree = DraftTree(parent=(-1, -1, 0), rank=(1, 2, 1), depth=(1, 1, 2))
    path = torch.tensor([[0, 2], [1, -1], [-1, -1], [0, -1], [0, -1]])
    present = torch.tensor([[True] * 3] * 4 + [[True, True, False]])
    hits, misses = _rank1_trials(tree, path, present)
    assert hits.tolist() == [2, 0, 0, 1, 1] and misses.tolist() == [0, 1, 1, 1, 0]


def test_sampled_trees_run_and_a_chain_drafter_is_refused_a_tree(tiny):
    sampling = SamplingParams(temperature=1.0)
    res = engine(tiny, "model", "tree:3:2:6", sampling=sampling).run(requests(2, 16))
    assert all(len(s.tokens) == 16 and max(s.logprobs) <= 0 for s in res.samples)
    with pytest.raises(UserError, match="drafter 'ngram' drafts chains only"):
        engine(tiny, "ngram", "tree:3:2:6").run(requests(1, 8))
    with pytest.raises(UserError, match="verifies 6 drafts a row, more than the engine's k_max = 4"):
        engine(tiny, "model", "tree:3:2:6", k_max=4).run(requests(1, 8))


def test_compiled_engine_equals_eager_greedy(tiny):
    """With the target's and the drafter's forwards of up to two rows compiled
    (`compile_decode`), a two-row engine's greedy SD gives the eager plain decoding's tokens,
    and the compiled graphs ran at two rows and at one (decode, verify, the drafter's drafts
    and feeds)."""
    import copy

    reqs = [Request(r.prompt, r.prompt_id, r.sample_id, 16 + 8 * (i == 5)) for i, r in enumerate(requests(1, 16))]
    want = [generate(tiny.target, [r.prompt], r.max_new_tokens, GREEDY)[0][0] for r in reqs]  # the last runs alone
    target, drafter = copy.deepcopy(tiny.target), copy.deepcopy(tiny.drafter)
    target.compile_decode(3, max_batch=2)  # static:2 verifies 3 tokens a row
    drafter.compile_decode(2, max_batch=2)
    rows = {"target": [], "drafter": []}
    for name, m in (("target", target), ("drafter", drafter)):
        graph = m.compiled._graph
        m.compiled._graph = lambda *a, g=graph, n=name: rows[n].append(a[0].shape[0]) or g(*a)
    e = RolloutEngine(
        target,
        ModelDrafter(drafter, GREEDY, max_batch=2, max_len=64),
        1000,
        2,
        GREEDY,
        build_policy("static:2", ("model",)),
        AcceptanceEstimator(("model",)),
    )
    sd = e.run(reqs)
    assert [s.tokens for s in sd.samples] == want
    assert sd.stats["accepted"] > 0
    assert len(rows["target"]) >= sd.stats["steps"] - len(reqs)
    assert {1, 2} <= set(rows["target"]) and {1, 2} <= set(rows["drafter"])


def test_model_drafter_feeds_a_prompts_samples_once(tiny):
    """Two fresh rows with the same tokens: one is fed, the other copies its KV and logits.
    Their greedy drafts, and the drafts after a further step, equal those of each row fed on
    its own, and both cache rows hold the same keys and values."""
    from rlsched.executor.decode.drafters import Seq

    prompt = [5, 6, 5, 6, 5]
    shared = make_drafter(tiny, "model")
    rows = [Seq(list(prompt), 0, 0), Seq(list(prompt), 2, 0), Seq([1, 2, 3], 1, 1)]
    d_shared, _, _ = shared.propose(rows, 3)
    alone = make_drafter(tiny, "model")
    d_alone = torch.cat([alone.propose([Seq(list(r.tokens), r.slot, r.prompt_id)], 3)[0] for r in rows])
    assert torch.equal(d_shared, d_alone)
    n = len(prompt) + 2  # the prompt and the first two drafts
    kv = shared.cache.kv
    assert int(shared.cache.lengths[0]) == int(shared.cache.lengths[2]) == n
    assert torch.allclose(kv[:, :, 0, :, :n], kv[:, :, 2, :, :n], atol=1e-6)
    for r, d in zip(rows, d_shared):  # all drafts accepted, then a bonus token
        r.tokens += d.tolist() + [9]
    again, _, _ = shared.propose(rows, 2)
    ref = make_drafter(tiny, "model")
    want = torch.cat([ref.propose([Seq(list(r.tokens), r.slot, r.prompt_id)], 2)[0] for r in rows])
    assert torch.equal(again, want)


def test_model_drafter_feeds_a_joining_prompt_apart_from_the_running_rows(tiny):
    """Two running rows feed one token each, a row that just joined its whole prompt: two
    forwards, not all three rows padded to the prompt's length, and the same greedy drafts as
    each row fed on its own."""
    from rlsched.executor.decode.drafters import Seq

    d = make_drafter(tiny, "model")
    running = [Seq(list(PROMPTS[0]), 0, 0), Seq(list(PROMPTS[1]), 1, 1)]
    d.propose(running, 2)
    for r in running:
        r.tokens += [7]  # a rejection: the corrected token is the one new token
    # long enough that padding the others to it costs more than a forward
    fresh = Seq([i % 10 + 1 for i in range(40)], 2, 2)
    shapes = []
    forward = d.model.forward
    d.model.forward = lambda ids, *a, **kw: shapes.append(tuple(ids.shape)) or forward(ids, *a, **kw)
    try:
        drafts, _, _ = d.propose(running + [fresh], 3)
    finally:
        del d.model.forward
    feeds, drafting = shapes[:-2], shapes[-2:]  # then k - 1 one-token forwards of all three rows
    assert drafting == [(3, 1), (3, 1)] and len(feeds) == 2, shapes
    # `length_groups` may pad one short row to the prompt (cheaper than a forward), not both
    assert sum(b * q for b, q in feeds) <= 2 * len(fresh.tokens) + 1 < 3 * len(fresh.tokens), shapes
    want = torch.cat(
        [
            make_drafter(tiny, "model").propose([Seq(list(r.tokens), r.slot, r.prompt_id)], 3)[0]
            for r in running + [fresh]
        ]
    )
    assert torch.equal(drafts, want)


@pytest.mark.parametrize("probe_every", [None, 16])
def test_a_policy_kept_off_by_its_acceptance_prior_probes_and_learns(tiny, probe_every):
    """A table that drafts only above 0.7 estimated acceptance, an estimator whose prior is 0.6
    and a drafter that accepts nearly everything (the target plus noise, greedy): without
    probes the run never drafts, so it never learns better; with a probe every 16 off steps
    the estimate rises past 0.7 and the table turns SD on."""
    from rlsched.policies.draft import PolicyContext
    from rlsched.policies.lookup import TablePolicy

    table = TablePolicy(
        PolicyContext(cost=None, drafters=("model",), k_max=4), "model", [1], [0.0, 0.7, 1.0], [[0], [3]]
    )
    drafter = ModelDrafter(tiny.drafter, GREEDY, max_batch=1, max_len=256)
    e = RolloutEngine(
        tiny.target, drafter, 1000, 1, GREEDY, table, AcceptanceEstimator(("model",)), probe_every=probe_every
    )
    res = e.run([Request(list(PROMPTS[0]), 0, 0, 120)])
    if probe_every is None:
        assert res.stats["drafted"] == 0 and e.probes == 0
    else:
        assert e.probes >= 1 and res.stats["drafted"] > 2 * e.probes  # drafting went on beyond the probes


def test_the_probe_count_runs_on_across_rollouts(tiny):
    """RL rollouts are often shorter than probe_every steps: a count that restarted with each
    rollout would never probe. Two 20-token rollouts, a probe after 30 off steps: none in the
    first, one in the second."""
    from rlsched.policies.draft import PolicyContext
    from rlsched.policies.lookup import TablePolicy

    table = TablePolicy(
        PolicyContext(cost=None, drafters=("model",), k_max=4), "model", [1], [0.0, 0.99, 1.0], [[0], [3]]
    )
    drafter = ModelDrafter(tiny.drafter, GREEDY, max_batch=1, max_len=256)
    e = RolloutEngine(tiny.target, drafter, 1000, 1, GREEDY, table, AcceptanceEstimator(("model",)), probe_every=30)
    e.run([Request(list(PROMPTS[0]), 0, 0, 20)])
    assert e.probes == 0
    res = e.run([Request(list(PROMPTS[1]), 0, 0, 20)])
    assert e.probes == 1 and res.stats["drafted"] >= 1


def test_model_drafter_reports_its_catch_up(tiny):
    """`catch_up`: tokens a propose fed beyond two a row. A fresh row feeds its prompt; a row
    one rejection on feeds one or two tokens; a row five tokens on (off steps) five or six."""
    from rlsched.executor.decode.drafters import Seq

    d = make_drafter(tiny, "model")
    row = Seq(list(PROMPTS[0]), 0, 0)
    d.propose([row], 2)
    assert d.catch_up == len(PROMPTS[0]) - 2
    row.tokens += [7]
    d.propose([row], 2)
    assert d.catch_up == 0
    row.tokens += [3, 4, 5, 6, 7]
    d.propose([row], 2)
    # the five and the one before them (the row's cache kept a draft that stood in for it, unless
    # the draft was that very token), less the two of a steady step
    assert d.catch_up in (3, 4)


@pytest.mark.parametrize("kind", [None, "model"])
def test_shared_prompt_prefill_changes_nothing_but_the_work(tiny, kind, tmp_path):
    """Samples of a prompt copy its KV from a row that holds it: one joining with it, or one
    still running when it joins (max_batch 2: the third sample of prompt 0 joins when the
    first finishes, while the second runs). Greedy tokens and log-probs as without sharing."""
    prompt = list(PROMPTS[0])
    reqs = [
        Request(prompt, 0, 0, 4),
        Request(prompt, 0, 1, 14),
        Request(prompt, 0, 2, 10),
        Request(list(PROMPTS[1]), 1, 3, 6),
    ]
    runs = {}
    for share in (False, True):
        e = engine(
            tiny, kind, "static:2" if kind else "off", max_batch=2, trace_dir=tmp_path / str(share), share_prompts=share
        )
        runs[share] = e.run(reqs)
        e.close()
    assert [s.tokens for s in runs[True].samples] == [s.tokens for s in runs[False].samples]
    for a, b in zip(runs[True].samples, runs[False].samples):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    prefilled = {
        share: read_trace(tmp_path / str(share) / "steps", "steps").query("kind == 'prefill'")
        for share in (False, True)
    }
    assert int(prefilled[False]["batch"].sum()) == 4
    assert int(prefilled[True]["batch"].sum()) == 2  # prompt 0 once, prompt 1 once
    assert int(prefilled[True]["ctx_tokens"].sum()) == len(PROMPTS[0]) + len(PROMPTS[1])


def test_traces_read_back_and_count_tokens(tiny, tmp_path):
    reqs = requests(2, 12)
    e = engine(tiny, "model", "static:3", trace_dir=tmp_path, rl_step=2)
    res = e.run(reqs)
    e.close()
    steps = read_trace(tmp_path / "steps", "steps")
    samples = read_trace(tmp_path / "samples", "samples")
    dec = steps[steps["kind"] == "decode"]
    assert int(dec["emitted"].sum()) == sum(len(s.tokens) for s in res.samples)
    assert set(steps["kind"]) == {"decode", "prefill"}
    # the two samples of each prompt share one prefill
    assert int(steps.loc[steps["kind"] == "prefill", "batch"].sum()) == len(PROMPTS)
    assert (dec["accepted"] <= dec["drafted"]).all() and (dec["batch"] <= 4).all()
    assert len(samples) == len(reqs) and sorted(samples["sample_id"]) == sorted(r.sample_id for r in reqs)
    assert (samples["response_len"] == 12).all() and (samples["rl_step"] == 2).all()
    assert "acceptance_model" in samples.columns
    # the rollout's chain trials (what the drafter-update schedule reads) are the samples' summed
    st = res.stats
    assert (st["drafted"], st["accepted"], st["rejected"]) == tuple(
        int(samples[c].sum()) for c in ("drafted", "accepted", "rejected")
    )
    assert st["sd_rows"] == int((dec["k"] > 0).mul(dec["batch"]).sum()) and 0 < st["rejected"] <= st["sd_rows"]
    assert not list((tmp_path / "steps").glob("part-*.jsonl"))  # closed: every journal became a part


class ChangingK:
    """A test policy: k cycles 0..4 (0 = off); per-row lengths every third step."""

    name = "changing"

    def __init__(self):
        self.outcomes, self.states = [], []

    def choose(self, state):
        self.states.append((state.batch, state.waiting, state.kv_free_tokens, state.ctx_tokens))
        k = state.step % 5
        if k == 0:
            return OFF
        if state.step % 3 == 0:
            per = np.arange(state.batch) % (k + 1)
            per[0] = k
            return Strategy("model", k, k_per_row=per)
        return Strategy("model", k)

    def observe(self, outcome):
        self.outcomes.append(outcome)


def test_policy_changing_k_every_step(tiny):
    reqs = requests(2, 16)
    pol = ChangingK()
    res = engine(tiny, "model", pol).run(reqs)
    want, _, _ = generate(tiny.target, [r.prompt for r in reqs], 16, GREEDY)
    assert [s.tokens for s in res.samples] == want
    assert len(pol.outcomes) == res.stats["steps"] > 0
    assert all(o.accepted <= o.drafted for o in pol.outcomes)
    assert all(o.emitted >= o.batch for o in pol.outcomes)  # no eos: every row emits at least one token
    assert {o.strategy.k for o in pol.outcomes} == {0, 1, 2, 3, 4}
    assert all(o.verify_time > 0 and o.step_time >= o.verify_time for o in pol.outcomes)
    assert all(s[0] <= 4 for s in pol.states) and pol.states[0][1] == len(reqs) - 4


def test_logprobs_length_and_sign(tiny):
    sp = SamplingParams(temperature=1.0)
    reqs = requests(2, 10)
    res = engine(tiny, "model", "static:2", sampling=sp, generator=torch.Generator().manual_seed(0)).run(reqs)
    for s in res.samples:
        assert len(s.logprobs) == len(s.tokens) == 10
        assert all(lp <= 0 for lp in s.logprobs)
    assert any(lp < 0 for s in res.samples for lp in s.logprobs)


def test_policy_needing_a_cost_model_is_refused(tiny):
    with pytest.raises(UserError, match="cost model"):
        build_policy("goodput", ("model",))
    with pytest.raises(UserError, match="cost model"):
        engine(tiny, "model", "goodput")


@pytest.mark.parametrize("policy", ["bandit", "twostate:2:3"])
def test_cost_free_adaptive_policies_run_losslessly(tiny, policy):
    reqs = requests(1, 12)
    want, _, _ = generate(tiny.target, [r.prompt for r in reqs], 12, GREEDY)
    res = engine(tiny, "ngram", policy).run(reqs)
    assert [s.tokens for s in res.samples] == want


def test_engine_does_not_import_the_simulator():
    import subprocess
    import sys

    code = (
        "import sys, rlsched.executor.engine.rollout; "
        "assert not [m for m in sys.modules if m.startswith('rlsched.sim')]"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


class Crashing(ChangingK):
    """Fails at step 6, as a killed process would stop."""

    def choose(self, state):
        if state.step == 6:
            raise KeyboardInterrupt
        return super().choose(state)


def test_a_crash_keeps_the_steps_written_so_far(tiny, tmp_path):
    with pytest.raises(KeyboardInterrupt):
        engine(tiny, "model", Crashing(), trace_dir=tmp_path).run(requests(2, 12))
    steps = read_trace(tmp_path / "steps", "steps")  # from the journal: the writer was never closed
    assert (steps["kind"] == "decode").sum() == 6 and (steps["kind"] == "prefill").sum() >= 1
    assert list((tmp_path / "steps").glob("part-*.jsonl"))


def test_a_too_small_model_drafter_is_refused(tiny):
    small = ModelDrafter(tiny.drafter, GREEDY, max_batch=2, max_len=64)
    e = RolloutEngine(tiny.target, small, 1000, 4, GREEDY, "static:2")
    with pytest.raises(UserError, match="drafter 'model'"):
        e.run(requests(1, 8))


def test_resize_makes_room_for_longer_requests(tiny):
    """A request past the KV budget and the model drafter's cache is refused; after resize
    (what the trainer does when a longer prompt comes) it runs."""
    e = engine(tiny, "model", "static:2", capacity=200)
    long = [Request([1 + i % 9 for i in range(40)], 0, 0, 80)]  # 120 tokens: over the drafter's 64
    with pytest.raises(UserError):
        e.run([Request(long[0].prompt, 0, 0, 180)])  # over the KV budget too
    with pytest.raises(UserError, match="drafter 'model'"):
        e.run(long)
    e.resize(400, 256)
    assert e.cache_capacity == 400 and e.drafters["model"].cache.max_len == 256
    assert len(e.run(long).samples[0].tokens) == 80


def test_model_drafter_feeds_rows_apart_when_a_ragged_feed_would_overflow_its_cache(tmp_path):
    """A fresh row's whole prompt beside a row deep in its context: padding both to the
    prompt's length would write past the cache; the drafter feeds them one by one and drafts
    what it drafts with room to spare (greedy, so the drafts can be compared)."""
    from support import tiny_pair

    from rlsched.executor.decode.drafters import ModelDrafter, Seq
    from rlsched.executor.decode.sampling import GREEDY

    _, drafter = tiny_pair(tmp_path / "m", vocab=50)
    long_row, fresh = list(range(1, 41)), list(range(5, 35))
    tight = ModelDrafter(drafter, GREEDY, max_batch=2, max_len=48)
    roomy = ModelDrafter(drafter, GREEDY, max_batch=2, max_len=128)
    for d in (tight, roomy):
        d.propose([Seq(long_row[:38], 0)], 1)  # row 0 cached up to 37 tokens
    a = [Seq(long_row, 0), Seq(fresh, 1)]
    b = [Seq(list(long_row), 0), Seq(list(fresh), 1)]
    tight_tokens, _, _ = tight.propose(a, 3)
    roomy_tokens, _, _ = roomy.propose(b, 3)
    assert tight_tokens.tolist() == roomy_tokens.tolist()
