"""The EAGLE-3 head drafting in the rollout engine (`executor/decode/eagle_drafter.py`): the target's
states it keeps per row are the ones a cache-less forward of the row gives, greedy rollouts
(chains and draft trees) equal plain decoding, and sampled ones complete with the target's
log-probs; the trees' losslessness is tested in test_tree_verify.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from rlsched.executor.decode.eagle import load_head, target_features  # noqa: E402
from rlsched.executor.decode.eagle_builtin import builtin_head  # noqa: E402
from rlsched.executor.decode.eagle_drafter import EagleDrafter  # noqa: E402
from rlsched.executor.decode.sampling import GREEDY, SamplingParams  # noqa: E402
from rlsched.executor.engine.rollout import RolloutEngine  # noqa: E402
from rlsched.executor.engine.rows import Request  # noqa: E402
from rlsched.executor.model.builtin import EOS, encode  # noqa: E402
from rlsched.executor.model.loading import load_model  # noqa: E402
from rlsched.tasks.synthetic import make_examples  # noqa: E402


@pytest.fixture(scope="module")
def models(pair):
    target = load_model(pair.target, dtype="float32").model
    return target, load_head(builtin_head().folder, target)


def requests(n_prompts=6, group=2, max_new=24):
    return [
        Request(encode(e.prompt), p, p * group + i, max_new, EOS)
        for p, e in enumerate(make_examples(n_prompts, 12345))
        for i in range(group)
    ]


def engine(models, policy, sampling=GREEDY, drafter=True):
    target, head = models
    target.capture = None
    gen = torch.Generator().manual_seed(0)
    d = EagleDrafter(head, target, sampling, gen) if drafter else None
    return RolloutEngine(target, d, 4 * 200, 4, sampling, policy, k_max=4, generator=gen), d


@pytest.mark.parametrize("policy", ["static:3", "tree:3:2:4"])
def test_the_states_kept_per_row_are_the_targets(models, policy):
    """After every step (rows joining, drafting, accepting a chain's drafts or a tree's path,
    leaving) each row's kept states are the target's aux states at the row's last positions,
    as a cache-less forward gives them."""
    eng, d = engine(models, policy)
    eng.start(requests())
    checked = 0
    while eng.has_work and checked < 40:
        eng.work()
        for row in eng._running.values():
            entry = d._rows.get(row.seq.slot)
            if entry is None or entry[0] is not row.seq:
                continue
            n = len(row.seq.tokens) - 1
            assert entry[2] == n
            want, _ = target_features(models[0], torch.tensor([row.seq.tokens[:n]]), models[1].config.aux_layers)
            torch.testing.assert_close(entry[1], want[0, -d.window :], atol=1e-4, rtol=1e-4)
            checked += 1
    assert checked >= 20


def test_greedy_eagle_rollouts_equal_plain_decoding(models):
    reqs = requests()
    off, _ = engine(models, "off", drafter=False)
    want = [s.tokens for s in off.run(reqs).samples]
    for policy in ("static:3", "tree:3:2:4"):  # a chain, and a draft tree of the head's candidates
        eng, _ = engine(models, policy)
        got = eng.run(reqs)
        assert [s.tokens for s in got.samples] == want, policy
        assert got.stats["accepted"] > 0 and got.stats["mean_accept_len"] > 1.2, policy


def test_sampled_eagle_rollouts_complete_with_target_logprobs(models):
    sampling = SamplingParams(temperature=1.0)
    for policy in ("static:3", "tree:3:2:4"):
        eng, _ = engine(models, policy, sampling)
        res = eng.run(requests(4, 2, 16))
        assert all(0 < len(s.tokens) <= 16 and max(s.logprobs) <= 0 for s in res.samples)
        assert res.stats["accepted"] > 0


def test_prepared_rows_draft_without_a_target_forward(models, monkeypatch):
    """`prepare` computes a row's states ahead (what `observe` hands over in the engine; the
    profiler calls it untimed): the draft that follows runs the head alone."""
    import rlsched.executor.decode.eagle_drafter as ed
    from rlsched.executor.decode.speculative import Seq

    target, head = models
    d = EagleDrafter(head, target, GREEDY)
    rows = [Seq(encode(e.prompt) + [5, 7], i) for i, e in enumerate(make_examples(3, 1))]
    d.prepare(rows)

    def no_forward(*args, **kwargs):
        raise AssertionError("the draft recomputed the target's states")

    monkeypatch.setattr(ed, "target_features", no_forward)
    tokens, _, ks = d.propose(rows, 3)
    assert tokens.shape == (3, 3) and ks.tolist() == [3, 3, 3]
    target.capture = None


def test_one_engine_switches_among_the_head_the_draft_model_and_the_suffix_drafter(models, pair, tmp_path):
    """Several drafters in one engine: the policy (bandit, which first tries off's neighbours,
    k = 1 of each drafter) drafts with each of them in turn; the head keeps its rows' states
    through the steps the others draft, and greedy output stays plain decoding's."""
    from rlsched.executor.decode.drafters import ModelDrafter
    from rlsched.executor.decode.suffix import SuffixDrafter
    from rlsched.executor.engine.rollout import build_policy
    from rlsched.traces.reader import read_trace

    target, head = models
    reqs = requests()
    want = [s.tokens for s in engine(models, "off", drafter=False)[0].run(reqs).samples]
    gen = torch.Generator().manual_seed(0)
    small = load_model(pair.drafter, dtype="float32").model
    drafters = [ModelDrafter(small, GREEDY, 4, 256, gen), EagleDrafter(head, target, GREEDY, gen), SuffixDrafter()]
    policy = build_policy("bandit", ("model", "eagle", "suffix"), k_max=4)
    eng = RolloutEngine(target, drafters, 4 * 200, 4, GREEDY, policy, k_max=4, generator=gen, trace_dir=tmp_path)
    got = eng.run(reqs)
    eng.close()
    assert [s.tokens for s in got.samples] == want
    steps = read_trace(tmp_path, "steps")
    assert set(steps[steps.k > 0].drafter) == {"model", "eagle", "suffix"}
    target.capture = None
