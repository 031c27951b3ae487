"""The speculative step is lossless.

- verify() on hand-made p and q: the acceptance rate of one draft is sum_x min(p(x), q(x))
  (p(x) for a deterministic draft), the emitted token is distributed as p, greedy is exact
  match, ragged rows, log-probs.
- On a tiny random Llama (vocab 16, written with save_pretrained, loaded with load_model):
  the first 3 generated tokens under SD (n-gram drafter with history, and a model drafter;
  k = 1, 3, 6; temperature 1.0, and 0.7 with top-p 0.9) follow the exact distribution of plain
  sampling, computed by enumerating all V^3 continuations: chi-square goodness of fit over the
  joint counts (cells with expected count < 5 pooled), p > 0.001, fixed seeds. Plain
  sampling passes the same test. Greedy SD equals greedy plain token for token.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


from rlsched.executor.decode.drafters import ModelDrafter, NgramDrafter, OffDrafter, Seq, make_drafter  # noqa: E402
from rlsched.executor.decode.sampling import GREEDY, SamplingParams, probs, sample  # noqa: E402
from rlsched.executor.decode.speculative import PAD, decode_step, generate, prefill, step, verify  # noqa: E402

V = 16
ALPHA = 1e-3
P_VALUES: dict[str, float] = {}  # printed at the end with -s


def _chi2_sf(stat: float, df: int) -> float:
    return float(
        torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64))
    )


def chi2_gof(counts: torch.Tensor, expected_p: torch.Tensor, min_expected: float = 5.0) -> float:
    """p-value of counts (flat) against probabilities (flat); cells expected below
    `min_expected` are pooled into one."""
    counts, expected_p = counts.double().flatten(), expected_p.double().flatten()
    n = counts.sum()
    exp = expected_p / expected_p.sum() * n
    big = exp >= min_expected
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    ex = torch.cat([exp[big], exp[~big].sum()[None]])
    if ex[-1] < min_expected:  # too little pooled mass: fold it into the smallest big cell
        j = int(ex[:-1].argmin())
        obs[j] += obs[-1]
        ex[j] += ex[-1]
        obs, ex = obs[:-1], ex[:-1]
    stat = float(((obs - ex) ** 2 / ex).sum())
    return _chi2_sf(stat, len(ex) - 1)


# --- sampling ---------------------------------------------------------------------------------


def test_probs_match_transformers_warpers():
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)) * 2
    for t, k, p in [(1.0, 0, 1.0), (0.7, 0, 0.9), (1.3, 5, 1.0), (0.5, 10, 0.8)]:
        x = TemperatureLogitsWarper(t)(None, logits.clone())
        if k:
            x = TopKLogitsWarper(k)(None, x)
        if p < 1:
            x = TopPLogitsWarper(p)(None, x)
        want = torch.softmax(x, -1)
        got = probs(logits, t, k, p)
        assert torch.allclose(got, want, atol=1e-6), (t, k, p)
    g = probs(logits, 0.0)
    assert torch.equal(g.argmax(-1), logits.argmax(-1)) and torch.equal(g.sum(-1), torch.ones(6))


def test_sampling_params_validated_and_seeded():
    for bad in (dict(temperature=-1), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    p = probs(torch.randn(100, 8, generator=torch.Generator().manual_seed(1)))
    a = sample(p, torch.Generator().manual_seed(5))
    b = sample(p, torch.Generator().manual_seed(5))
    assert torch.equal(a, b) and a.shape == (100,)


# --- verify() on hand-made distributions --------------------------------------------------------

N_UNIT = 200_000
P_HAND = torch.tensor([0.4, 0.3, 0.2, 0.1, 0.0])
Q_HAND = torch.tensor([0.1, 0.2, 0.3, 0.1, 0.3])


def _rate_ok(rate: float, want: float, n: int):
    sd = math.sqrt(want * (1 - want) / n)
    assert abs(rate - want) < 5 * sd + 1e-12, (rate, want)


def test_single_sampled_draft_acceptance_and_output():
    g = torch.Generator().manual_seed(10)
    q = Q_HAND.expand(N_UNIT, 1, 5).contiguous()
    drafts = sample(q, g)
    target = torch.stack([P_HAND, torch.tensor([0.0, 0.0, 0.5, 0.5, 0.0])]).expand(N_UNIT, 2, 5)
    out = verify(target, drafts, q, None, g)
    _rate_ok(out.accepted.float().mean().item(), float(torch.minimum(P_HAND, Q_HAND).sum()), N_UNIT)
    first = out.tokens[:, 0]
    p = chi2_gof(torch.bincount(first, minlength=5), P_HAND)
    P_VALUES["verify sampled draft, first token"] = p
    assert p > ALPHA
    assert (first != 4).all()  # p(4) = 0: never emitted, though q drafts it often
    bonus = out.tokens[out.accepted == 1, 1]
    assert set(bonus.tolist()) <= {2, 3}
    assert (out.tokens[out.accepted == 0, 1] == PAD).all()


@pytest.mark.parametrize("x", [0, 2, 4])
def test_single_deterministic_draft(x):
    g = torch.Generator().manual_seed(11 + x)
    drafts = torch.full((N_UNIT, 1), x)
    out = verify(P_HAND.expand(N_UNIT, 2, 5), drafts, None, None, g)
    _rate_ok(out.accepted.float().mean().item(), float(P_HAND[x]), N_UNIT)
    p = chi2_gof(torch.bincount(out.tokens[:, 0], minlength=5), P_HAND)
    P_VALUES[f"verify deterministic draft {x}, first token"] = p
    assert p > ALPHA


def test_chain_of_drafts_acceptance_counts():
    """Two deterministic drafts with p(x1) = 0.4 and p(x2) = 0.5: accepted = 0, 1, 2 with
    probabilities 0.6, 0.2, 0.2; with p = q (sampled drafts from p) everything is accepted."""
    g = torch.Generator().manual_seed(12)
    p2 = torch.tensor([0.1, 0.5, 0.2, 0.2, 0.0])
    target = torch.stack([P_HAND, p2, P_HAND]).expand(N_UNIT, 3, 5)
    out = verify(target, torch.tensor([[0, 1]]).expand(N_UNIT, 2), None, None, g)
    freq = torch.bincount(out.accepted, minlength=3).double()
    p = chi2_gof(freq, torch.tensor([0.6, 0.2, 0.2]))
    P_VALUES["verify two deterministic drafts, accepted counts"] = p
    assert p > ALPHA
    same = torch.stack([P_HAND, p2]).expand(1000, 2, 5).contiguous()
    d = sample(same, g)
    out = verify(torch.cat([same, P_HAND.expand(1000, 1, 5)], 1), d, same, None, g)
    assert (out.accepted == 2).all()


def test_greedy_is_exact_match_and_ragged_rows():
    target = torch.zeros(4, 4, 6)
    best = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [5, 0, 0, 0]])
    target.scatter_(-1, best[..., None], 1.0)
    drafts = torch.tensor([[1, 2, 3], [1, 0, 3], [1, 2, 3], [9, 9, 9]])
    out = verify(target, drafts, None, torch.tensor([3, 3, 1, 0]), greedy=True)
    assert out.accepted.tolist() == [3, 1, 1, 0]
    assert out.row_tokens(0) == [1, 2, 3, 4]
    assert out.row_tokens(1) == [1, 2]
    assert out.row_tokens(2) == [1, 2]  # one draft only: accepted, then the bonus at position 1
    assert out.row_tokens(3) == [5]  # no drafts: a plain step
    assert out.logprobs[0].tolist() == [0.0] * 4
    # the sampling rule gives the same on one-hot p (nothing random can change it)
    out2 = verify(target, drafts, None, torch.tensor([3, 3, 1, 0]), torch.Generator().manual_seed(0))
    assert torch.equal(out.tokens, out2.tokens)


def test_logprobs_and_padding_never_accepted():
    g = torch.Generator().manual_seed(13)
    target = probs(torch.randn(500, 4, 7, generator=g))
    drafts = sample(target[:, :3], g)  # drafts from p itself with q = p: all accepted
    kr = torch.randint(0, 4, (500,), generator=g)
    out = verify(target, drafts, target[:, :3], kr, g)
    assert torch.equal(out.accepted, kr)
    for b in range(0, 500, 37):
        toks = out.row_tokens(b)
        want = [math.log(float(target[b, i, t])) for i, t in enumerate(toks)]
        assert out.row_logprobs(b) == pytest.approx(want, abs=1e-5)
        assert (out.tokens[b, len(toks) :] == PAD).all()
    with pytest.raises(ValueError, match="k per row"):
        verify(target, drafts, None, torch.full((500,), 4), g)
    with pytest.raises(ValueError, match="draft_tokens must have shape"):
        verify(target, drafts[:, :2], None, None, g)
    with pytest.raises(ValueError, match="draft_probs must have shape"):
        verify(target, drafts, target, None, g)


# --- on a real (tiny, random) model -------------------------------------------------------------

PROMPTS = [[3, 5, 7, 3, 5, 7, 3, 5], [1, 2, 9, 1, 2, 9, 1, 2, 9, 1]]
N_ROWS = 4000  # per prompt
CASES = {"t1.0": SamplingParams(1.0), "t0.7-p0.9": SamplingParams(0.7, top_p=0.9)}


@torch.no_grad()
def exact_joint(model, prompt: list[int], sp: SamplingParams) -> torch.Tensor:
    """P(first 3 tokens = a, b, c) under plain sampling, (V, V, V), by enumeration."""
    last = lambda seqs: sp.probs(model(torch.tensor(seqs))[:, -1])  # noqa: E731
    p1 = last([prompt])[0]
    p2 = last([prompt + [a] for a in range(V)])
    p3 = last([prompt + [a, b] for a in range(V) for b in range(V)]).view(V, V, V)
    return p1[:, None, None] * p2[:, :, None] * p3


def _joint_counts(gen: list[list[int]]) -> torch.Tensor:
    t = torch.tensor([g[:3] for g in gen])
    return torch.bincount(t[:, 0] * V * V + t[:, 1] * V + t[:, 2], minlength=V**3)


def _fit(tiny, sp, gen, label):
    target = tiny.target
    ps = []
    for i, prompt in enumerate(PROMPTS):
        ps.append(chi2_gof(_joint_counts(gen[i * N_ROWS : (i + 1) * N_ROWS]), exact_joint(target, prompt, sp)))
        P_VALUES[f"{label}, prompt {i}"] = ps[-1]
    return min(ps) * len(ps)  # Bonferroni over the prompts


def _run(tiny, sp, drafter, k, seed, k_per_row=None):
    prompts = [p for p in PROMPTS for _ in range(N_ROWS)]
    ids = [i for i in range(len(PROMPTS)) for _ in range(N_ROWS)]
    return generate(
        tiny.target,
        prompts,
        3,
        sp,
        drafter=drafter,
        k=k,
        k_per_row=k_per_row,
        prompt_ids=ids,
        generator=torch.Generator().manual_seed(seed),
    )


def _ngram(tiny, sp):
    """An n-gram drafter that knows 8 earlier rollouts (24 tokens) of each prompt."""
    d = NgramDrafter(max_n=3)
    for i, prompt in enumerate(PROMPTS):
        gen, _, _ = generate(tiny.target, [prompt] * 8, 24, sp, generator=torch.Generator().manual_seed(100 + i))
        for g in gen:
            d.add_history(i, prompt + g)
    return d


@pytest.mark.parametrize("case", list(CASES))
def test_plain_sampling_matches_exact_distribution(tiny, case):
    gen, lps, stats = _run(tiny, CASES[case], None, 0, seed=1)
    assert stats["steps"] == 3
    assert _fit(tiny, CASES[case], gen, f"plain {case}") > ALPHA


@pytest.mark.parametrize("k", [1, 3, 6])
@pytest.mark.parametrize("case", list(CASES))
def test_ngram_sd_is_lossless(tiny, case, k):
    sp = CASES[case]
    gen, _, stats = _run(tiny, sp, _ngram(tiny, sp), k, seed=20 + k)
    assert stats["accepted"] > 0.05 * stats["drafted"] > 0, stats
    assert _fit(tiny, sp, gen, f"ngram k={k} {case} (accepted {stats['accepted'] / stats['drafted']:.2f})") > ALPHA


@pytest.mark.parametrize("k", [1, 3, 6])
@pytest.mark.parametrize("case", list(CASES))
def test_model_sd_is_lossless(tiny, case, k):
    sp = CASES[case]
    drafter = ModelDrafter(tiny.drafter, sp, len(PROMPTS) * N_ROWS, 32, torch.Generator().manual_seed(7))
    gen, _, stats = _run(tiny, sp, drafter, k, seed=40 + k)
    assert stats["accepted"] > 0.3 * stats["drafted"] > 0, stats
    assert _fit(tiny, sp, gen, f"model k={k} {case} (accepted {stats['accepted'] / stats['drafted']:.2f})") > ALPHA


def test_ragged_k_is_lossless(tiny):
    """Every row its own draft length 0..6 (a per-sequence policy's ragged verify)."""
    sp = CASES["t1.0"]
    drafter = ModelDrafter(tiny.drafter, sp, len(PROMPTS) * N_ROWS, 32, torch.Generator().manual_seed(8))
    kr = torch.randint(0, 7, (len(PROMPTS) * N_ROWS,), generator=torch.Generator().manual_seed(9))
    gen, _, stats = _run(tiny, sp, drafter, 6, seed=60, k_per_row=kr)
    assert stats["accepted"] > 0
    assert _fit(tiny, sp, gen, "model ragged k=0..6 t1.0") > ALPHA


@pytest.mark.parametrize(
    "name, k", [("ngram", 1), ("ngram", 3), ("ngram", 6), ("model", 1), ("model", 3), ("model", 6), ("off", 4)]
)
def test_greedy_sd_equals_greedy_plain(tiny, name, k):
    prompts = PROMPTS + [[4, 4, 4, 4], [7, 1, 7, 1, 7], [2]]
    want, want_lp, _ = generate(tiny.target, prompts, 30, GREEDY)
    if name == "model":
        drafter = make_drafter("model", model=tiny.drafter, sampling=GREEDY, max_batch=len(prompts), max_len=64)
    else:
        drafter = make_drafter(name)
    got, got_lp, stats = generate(tiny.target, prompts, 30, GREEDY, drafter=drafter, k=k)
    assert got == want
    assert got_lp == want_lp  # all 0: log 1 under the one-hot greedy distribution
    if name != "off":
        assert stats["accepted"] > 0 and stats["steps"] < 30


def test_step_keeps_only_accepted_tokens_in_the_cache(tiny):
    """After a speculative step each row's cache holds its context up to the newly emitted
    token, and its logits equal those of a fresh forward over that context."""
    target = tiny.target
    sp = CASES["t1.0"]
    g = torch.Generator().manual_seed(3)
    cache = target.new_cache(4, 40)
    slots = torch.tensor([3, 1])
    seqs = [list(PROMPTS[0]), list(PROMPTS[1])]
    last = prefill(target, cache, slots, seqs)
    drafter = NgramDrafter()
    for _ in range(6):
        rows = [Seq(s, int(slot)) for s, slot in zip(seqs, slots)]
        d, dq, kr = drafter.propose(rows, 4)
        out = step(target, cache, slots, last, sp, d, dq, kr, g)
        for r in range(2):
            seqs[r] += out.row_tokens(r)
        last = torch.tensor([s[-1] for s in seqs])
        assert cache.lengths[slots].tolist() == [len(s) - 1 for s in seqs]
    out = decode_step(target, cache, slots, last, GREEDY)
    with torch.no_grad():
        for r in range(2):
            ref = target(torch.tensor([seqs[r]]))[0, -1].argmax().item()
            assert out.row_tokens(r) == [ref]


def test_model_drafter_cache_stays_in_sync(tiny):
    """With the target itself as drafter (q = p up to rounding) every draft is accepted: the
    drafter's cache rows follow their sequences through acceptances, ragged rows and reuse."""
    target = tiny.target
    sp = CASES["t1.0"]
    drafter = ModelDrafter(target, sp, 64, 48, torch.Generator().manual_seed(4))
    prompts = [PROMPTS[i % 2][: 3 + i % 6] for i in range(64)]
    kr = torch.randint(1, 5, (64,), generator=torch.Generator().manual_seed(5))
    for seed in (6, 7):  # the second rollout reuses the freed rows
        gen, _, stats = generate(
            target, prompts, 20, sp, drafter=drafter, k=4, k_per_row=kr, generator=torch.Generator().manual_seed(seed)
        )
        assert stats["accepted"] >= 0.999 * stats["drafted"], stats
        assert all(len(g) == 20 for g in gen)


def test_drafters():
    d = NgramDrafter(max_n=3)
    d.add_history("p", [1, 2, 3, 8, 9, 10, 11])
    rows = [Seq([5, 6, 7, 5, 6], 0), Seq([0, 3, 8], 1, "p"), Seq([4], 2, "p"), Seq([1, 2, 9, 1, 2], 3)]
    tokens, q, kr = d.propose(rows, 3)
    assert q is None
    assert kr.tolist() == [3, 3, 0, 3]
    assert tokens[0].tolist() == [7, 5, 6]  # the row's own "5 6" -> 7 5 6
    assert tokens[1].tolist() == [9, 10, 11]  # no 3-gram; history: "3 8" -> 9 10 11
    assert tokens[3].tolist() == [9, 1, 2]
    t, q, kr = OffDrafter().propose(rows, 3)
    assert kr.tolist() == [0, 0, 0, 0] and q is None
    with pytest.raises(ValueError, match="unknown drafter"):
        make_drafter("eagle")


def test_zz_report_p_values():
    """Printed with `pytest -s`: every chi-square p-value measured above."""
    for label, p in P_VALUES.items():
        print(f"chi-square p = {p:.4f}  {label}")
