"""Draft-tree verification is lossless.

- On a synthetic autoregressive target p(x | prefix) and drafter q(x | prefix) over 6 tokens
  (distributions derived from a hash of the prefix): thousands of rows verified in one
  `tree_verify` call per step, the joint distribution of the first two emitted tokens matches
  p(x1) p(x2 | x1) (chi-square goodness of fit, cells expected below 5 pooled, p > 0.001,
  fixed seeds), for chains and width 2 and 3 trees, deterministic and sampled candidates,
  temperature 1 and 0.7 with top-p 0.9. A resampler with a deliberate error fails the same test.
- On the built-in pair: a tree forward's logits at every node equal a plain forward of the
  node's path; `keep_path` moves exactly the accepted entries; the EAGLE-3 head's tree gives
  every node the distribution its path gives as a chain; greedy tree SD (`propose_tree` of
  the model drafter and of the EAGLE head, + `tree_step`) equals greedy plain decoding on
  ragged prompts; the first token of a sampled tree step follows the target's next-token
  distribution (both drafters, T = 1 and T = 0.7 / top-p 0.9).
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

torch = pytest.importorskip("torch")

from rlsched.executor.decode import tree_verify as tv  # noqa: E402
from rlsched.executor.decode.drafters import ModelDrafter  # noqa: E402
from rlsched.executor.decode.eagle import load_head, target_features  # noqa: E402
from rlsched.executor.decode.eagle_builtin import builtin_head  # noqa: E402
from rlsched.executor.decode.eagle_drafter import EagleDrafter, draft_tree  # noqa: E402
from rlsched.executor.decode.sampling import GREEDY, SamplingParams  # noqa: E402
from rlsched.executor.decode.speculative import PAD, Seq, generate, prefill, tree_step  # noqa: E402
from rlsched.executor.decode.tree_verify import DraftTree, draw_children, tree_of, tree_verify  # noqa: E402
from rlsched.executor.model.builtin import encode  # noqa: E402
from rlsched.executor.model.loading import load_model  # noqa: E402
from rlsched.policies.tree import tree_shape  # noqa: E402
from rlsched.tasks.synthetic import make_examples  # noqa: E402

ALPHA = 1e-3
V = 6
ROWS = 20000
SHAPES = {"chain3": (3, 1, 3), "w2n6": (3, 2, 6), "w3n8": (3, 3, 8)}
CASES = {"t1.0": SamplingParams(1.0), "t0.7-p0.9": SamplingParams(0.7, top_p=0.9)}


def tree_for(name: str) -> DraftTree:
    return tree_of(*SHAPES[name], 0.6, 0.25)


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> float:
    """Goodness of fit of counts (flat) to probs (flat); cells expected below `min_expected`
    are pooled into one (folded into the smallest other cell if the pool is still small).
    Counts in cells of probability 0 fail outright."""
    counts, probs = counts.astype(float).ravel(), probs.astype(float).ravel()
    assert counts[probs == 0].sum() == 0, "a token of probability 0 was emitted"
    exp = probs / probs.sum() * counts.sum()
    big = exp >= min_expected
    obs, ex = list(counts[big]), list(exp[big])
    if (~big).any():
        obs.append(counts[~big].sum())
        ex.append(exp[~big].sum())
        if ex[-1] < min_expected:
            j = int(np.argmin(ex[:-1]))
            obs[j] += obs.pop()
            ex[j] += ex.pop()
    return float(stats.chisquare(obs, ex).pvalue)


# --- the synthetic pair -------------------------------------------------------------------------


def _hash(code: torch.Tensor, salt: float) -> torch.Tensor:
    """(B,) prefix codes -> (B, V) pseudo-random values in [0, 1)."""
    x = torch.sin(code.double()[:, None] * 12.9898 + torch.arange(V, dtype=torch.float64) * 78.233 + salt) * 43758.5453
    return x - x.floor()


def target_logits(code: torch.Tensor) -> torch.Tensor:
    return (4.0 * _hash(code, 0.0)).float()


def drafter_logits(code: torch.Tensor) -> torch.Tensor:
    return (4.0 * _hash(code, 0.0) + 2.5 * _hash(code, 1.7)).float()


def synthetic_step(tree: DraftTree, codes: torch.Tensor, sp: SamplingParams, sampled: bool, g: torch.Generator):
    """One tree step for rows whose prefixes have `codes` (a prefix's code: its tokens as
    digits in base V): candidates drawn from the drafter (sampled: without replacement;
    else its top tokens, deterministic), then `tree_verify`."""
    b, n = len(codes), tree.n
    node_code = torch.zeros((b, n + 1), dtype=torch.long)  # index 0: the root
    node_code[:, 0] = codes
    tokens = torch.zeros((b, n), dtype=torch.long)
    present = torch.ones((b, n), dtype=torch.bool)
    p = torch.zeros((b, n + 1, V))
    q = torch.zeros((b, n + 1, V))
    p[:, 0], q[:, 0] = sp.probs(target_logits(codes)), sp.probs(drafter_logits(codes))
    for j in range(-1, n):
        kids = list(tree.children(j))
        if not kids:
            continue
        if sampled:
            x, ok = draw_children(q[:, j + 1], len(kids), g)
        else:
            x = drafter_logits(node_code[:, j + 1]).topk(len(kids), dim=-1).indices
            ok = torch.ones_like(x, dtype=torch.bool)
        if j >= 0:
            ok &= present[:, j, None]
        tokens[:, kids], present[:, kids] = x, ok
        for i, kid in enumerate(kids):
            c = node_code[:, j + 1] * V + x[:, i]
            node_code[:, kid + 1] = c
            p[:, kid + 1], q[:, kid + 1] = sp.probs(target_logits(c)), sp.probs(drafter_logits(c))
    return tree_verify(tree, p, tokens, q if sampled else None, present, g)


ROOT = 1 * V + 4  # the rows' context: the tokens 1, 4


def first_two_tokens(tree: DraftTree, sp: SamplingParams, sampled: bool, seed: int):
    """The first two tokens every row emits from ROOT (a second step for the rows whose
    first step emitted one), and the first step's result."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.full((ROWS,), ROOT, dtype=torch.long)
    out = synthetic_step(tree, codes, sp, sampled, g)
    x1 = out.tokens[:, 0]
    again = synthetic_step(tree, codes * V + x1, sp, sampled, g)
    x2 = torch.where(out.accepted > 0, out.tokens[:, 1], again.tokens[:, 0])
    return x1, x2, out


def exact_joint(sp: SamplingParams) -> np.ndarray:
    """P(x1, x2) = p(x1 | ROOT) p(x2 | ROOT x1), (V, V)."""
    p1 = sp.probs(target_logits(torch.tensor([ROOT])))[0]
    p2 = sp.probs(target_logits(ROOT * V + torch.arange(V)))
    return (p1[:, None] * p2).double().numpy()


def joint_pvalue(x1: torch.Tensor, x2: torch.Tensor, sp: SamplingParams) -> float:
    counts = torch.bincount(x1 * V + x2, minlength=V * V).numpy()
    return chi2_pvalue(counts, exact_joint(sp))


# --- the tree --------------------------------------------------------------------------------------


def test_tree_from_shape_is_bfs_with_parents_first():
    t = tree_of(3, 2, 6, 0.6, 0.25)
    assert t.parent == (-1, -1, 0, 0, 1, 2) and t.rank == (1, 2, 1, 2, 1, 1) and t.depth == (1, 1, 2, 2, 2, 3)
    assert t.n == 6 and t.k == 3 and t.width == 2
    assert t.children(-1) == (0, 1) and t.children(0) == (2, 3) and t.children(5) == ()
    assert [t.level(d) for d in (1, 2, 3)] == [(0, 2), (2, 5), (5, 6)]
    anc = t.ancestors()
    assert anc[5].tolist() == [True, False, True, False, False, True]  # node 5: 0 -> 2 -> 5
    assert DraftTree.from_shape(tree_shape(4, 1, 4, 0.6, 0.25)) == DraftTree.chain(4)
    assert tree_of(3, 2, 6, 0.6, 0.25) is t  # built once
    for k, w, n in [(4, 2, 10), (3, 3, 8), (5, 4, 24)]:
        t = tree_of(k, w, n, 0.5, 0.25)
        assert t.n == n and t.k == k and all(t.parent[i] < i for i in range(n))
        assert all(t.rank[c] == r + 1 for j in range(-1, n) for r, c in enumerate(t.children(j)))


def test_draw_children_is_sampling_without_replacement():
    q = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    tokens, present = draw_children(q.expand(40000, 5), 2, torch.Generator().manual_seed(0))
    assert present.all() and (tokens[:, 0] != tokens[:, 1]).all()
    exact = q[:, None] * q[None, :] / (1 - q[:, None])
    exact.fill_diagonal_(0.0)
    counts = torch.bincount(tokens[:, 0] * 5 + tokens[:, 1], minlength=25).numpy()
    assert chi2_pvalue(counts, exact.double().numpy()) > ALPHA
    tokens, present = draw_children(torch.tensor([[0.0, 0.7, 0.3, 0.0]]), 3, None)
    assert present.tolist() == [[True, True, False]] and sorted(tokens[0, :2].tolist()) == [1, 2]
    tokens, present = draw_children(torch.tensor([[0.2, 0.8]]), 3, None)
    assert present.tolist() == [[True, True, False]]


# --- losslessness on the synthetic pair ------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("sampled", [True, False], ids=["sampled", "deterministic"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_tree_verify_is_lossless(shape, sampled, case):
    sp = CASES[case]
    tree = tree_for(shape)
    seed = 1000 * list(SHAPES).index(shape) + 10 * sampled + list(CASES).index(case)
    x1, x2, out = first_two_tokens(tree, sp, sampled, seed)
    assert 0.15 < out.accepted.float().mean() < tree.k  # drafts accepted, not all of them
    if tree.width > 1:  # a later candidate was accepted at the root in some rows
        assert (torch.tensor(tree.rank)[out.path[:, 0].clamp_min(0)] > 1).logical_and(out.path[:, 0] >= 0).any()
    assert joint_pvalue(x1, x2, sp) > ALPHA


def _reject_keeps_q(p, q, x):
    """A resampler that forgets to take the rejected candidate out of q."""
    p_new, _ = REJECT(p, q, x)
    return p_new, q


def _reject_without_subtracting(p, q, x):
    """A resampler that only drops the rejected candidate from p instead of subtracting q."""
    _, q_new = REJECT(p, q, x)
    return p.scatter(-1, x[:, None], 0.0), q_new


REJECT = tv._reject


@pytest.mark.parametrize("broken", [_reject_keeps_q, _reject_without_subtracting])
def test_a_broken_resampler_fails(monkeypatch, broken):
    monkeypatch.setattr(tv, "_reject", broken)
    sp = CASES["t1.0"]
    x1, x2, _ = first_two_tokens(tree_for("w3n8"), sp, True, seed=7)
    assert joint_pvalue(x1, x2, sp) < ALPHA


def test_greedy_tree_verify_follows_the_argmax():
    tree = tree_for("w2n6")  # root -> 0, 1; 0 -> 2, 3; 1 -> 4; 2 -> 5
    p = torch.zeros(2, tree.n + 1, V)
    best = [1, 2, 5, 0, 5, 4, 2]  # the target's argmax at the root and at each node
    for i, x in enumerate(best):
        p[:, i, x] = 1.0
    tokens = torch.tensor([[0, 1, 3, 2, 5, 4], [0, 1, 3, 2, 5, 4]])
    present = torch.ones(2, tree.n, dtype=torch.bool)
    present[1, 1] = False
    out = tree_verify(tree, p, tokens, None, present, greedy=True)
    # row 0: root -> node 1 (token 1) -> node 4 (token 5) -> bonus argmax at node 4 = 4
    assert out.accepted.tolist() == [2, 0]
    assert out.path[0].tolist() == [1, 4, -1] and out.row_tokens(0) == [1, 5, 4]
    assert out.row_tokens(1) == [1] and out.tokens[1, 1:].tolist() == [PAD] * 3
    assert out.row_logprobs(0) == [0.0, 0.0, 0.0] and out.emitted.tolist() == [3, 1]


# --- on the built-in pair ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(pair):
    return load_model(pair.target).model, load_model(pair.drafter).model


@pytest.fixture(scope="module")
def head(models):
    yield load_head(builtin_head().folder, models[0])
    models[0].capture = None  # an EagleDrafter has the target keep its states


def _prompts(n: int, seed: int = 1) -> list[list[int]]:
    return [encode(e.prompt) for e in make_examples(n, seed=seed)]


def test_tree_forward_logits_equal_plain_forwards_of_each_path(models):
    target = models[0]
    tree = tree_for("w3n8")
    prompts = _prompts(4)  # ragged
    cache = target.new_cache(6, 64)
    slots = torch.tensor([4, 1, 2, 0])
    last = prefill(target, cache, slots, prompts)
    start = cache.lengths[slots].clone()
    toks = torch.randint(2, 60, (4, tree.n), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = target(torch.cat([last[:, None], toks], 1), cache, slots=slots, tree=tree.target_mask("cpu"))
        assert (cache.lengths[slots] == start + tree.n + 1).all()
        for b in range(4):
            for i in range(-1, tree.n):
                path, j = [], i
                while j >= 0:
                    path.append(int(toks[b, j]))
                    j = tree.parent[j]
                ref = target(torch.tensor([prompts[b] + path[::-1]]))[0, -1]
                torch.testing.assert_close(logits[b, i + 1], ref, atol=1e-4, rtol=0)


def test_keep_path_moves_exactly_the_accepted_entries(models):
    cache = models[0].new_cache(4, 16)
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=torch.Generator().manual_seed(0)))
    before = cache.kv.clone()
    slots = torch.tensor([3, 0, 2])
    start = torch.tensor([2, 5, 0])
    cache.lengths[slots] = start + 8
    keep = torch.tensor([[1, 4, 6], [0, 2, -1], [5, -1, -1]])
    n_keep = torch.tensor([3, 1, 0])
    cache.keep_path(slots, start, keep.clamp_min(0), n_keep)
    assert cache.lengths[slots].tolist() == (start + 1 + n_keep).tolist()
    for row, s, kk, nk in zip(slots.tolist(), start.tolist(), keep.tolist(), n_keep.tolist()):
        want = before[:, :, row].clone()
        for j in range(nk):
            want[:, :, :, s + 1 + j] = before[:, :, row, :, s + 1 + kk[j]]
        assert torch.equal(cache.kv[:, :, row], want)
    assert torch.equal(cache.kv[:, :, 1], before[:, :, 1])  # other rows untouched


def tree_generate(target, drafter, prompts, max_new, sp, tree, g=None):
    """Tree SD rollouts, each row to max_new tokens (finished rows leave the batch); checks
    that the target's cache holds each row's context but its last token after every step."""
    b = len(prompts)
    cache = target.new_cache(b, max(map(len, prompts)) + max_new + tree.n + 1)
    last = prefill(target, cache, torch.arange(b), prompts)
    seqs = [Seq(list(p), i) for i, p in enumerate(prompts)]
    active, steps = list(range(b)), 0
    while active:
        rows = [seqs[i] for i in active]
        slots = torch.tensor(active)
        tokens, dq, present = drafter.propose_tree(rows, tree)
        out = tree_step(target, cache, slots, last[slots], sp, tree, tokens, dq, present, g)
        for r, s in enumerate(rows):
            s.tokens.extend(out.row_tokens(r))
            last[s.slot] = s.tokens[-1]
        assert cache.lengths[slots].tolist() == [len(s.tokens) - 1 for s in rows]
        active = [i for i in active if len(seqs[i].tokens) - len(prompts[i]) < max_new]
        steps += 1
    return [s.tokens[len(p) : len(p) + max_new] for s, p in zip(seqs, prompts)], steps


def test_eagle_tree_nodes_get_the_distribution_of_their_path_as_a_chain(models, head):
    """`draft_tree`: every node's children are drawn from what the head gives when the node's
    path is fed to it as a chain (its tree attention sees the anchors and the ancestors)."""
    target = models[0]
    sp = SamplingParams(1.3)  # flat enough that every node has three candidates
    tree = tree_for("w3n8")
    prompt = encode("count 3 9=")
    ids = torch.tensor([prompt])
    aux, _ = target_features(target, ids[:, :-1], head.config.aux_layers)
    tokens = ids[:, 1:]  # anchor t pairs the states at t with token t + 1
    x, dists, present = draft_tree(head, aux, tokens, tree, sp, torch.Generator().manual_seed(0))
    assert present.all() and set(x[0].tolist()) <= set(head.draft_ids.tolist())

    def chain_dist(path):
        positions = torch.arange(aux.shape[1])[None]
        hidden, logits, ctx = head.layer(tokens, head.fc(aux), positions)
        h, lg, own = hidden[:, -1:], logits[:, -1], []
        for j, tok in enumerate(path):
            h, lg, _ = head.layer(torch.tensor([[tok]]), h, positions[:, -1:] + j + 1, ctx, own)
            lg = lg[:, -1]
        q = torch.zeros(head.config.vocab_size)
        q[head.draft_ids] = sp.probs(lg)[0]
        return q

    with torch.no_grad():
        for i in range(-1, tree.level(tree.k)[0]):  # the deepest nodes have no children to draw
            path, j = [], i
            while j >= 0:
                path.append(int(x[0, j]))
                j = tree.parent[j]
            torch.testing.assert_close(dists[0, i + 1], chain_dist(path[::-1]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("drafter", ["model", "eagle"])
@pytest.mark.parametrize("shape", [(3, 1, 3), (3, 2, 6), (4, 3, 12)])
def test_greedy_tree_sd_equals_greedy_plain(models, head, shape, drafter):
    target, small = models
    prompts = _prompts(5, seed=3)
    want, _, _ = generate(target, prompts, 24, GREEDY)
    tree = tree_of(*shape, 0.6, 0.25)
    if drafter == "model":
        d = ModelDrafter(small, GREEDY, len(prompts), 2 * max(map(len, prompts)) + 24 + 2 * tree.n + 8)
    else:
        d = EagleDrafter(head, target, GREEDY)
    got, steps = tree_generate(target, d, prompts, 24, GREEDY, tree)
    assert got == want
    assert steps < 24 * 0.8  # drafts were accepted


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("drafter", ["model", "eagle"])
def test_sampled_tree_step_first_token_follows_the_target(models, head, drafter, case):
    """A width-2 tree of either drafter: the first emitted token of many rows with the same
    prompt against the target's exact next-token distribution."""
    target, small = models
    sp = CASES[case]
    tree = tree_of(2, 2, 4, 0.6, 0.25)
    # a prompt where the drafter's first candidate is often wrong and its second often right
    prompt = encode({"model": "repeat 12 5=", "eagle": "add 96+7="}[drafter])
    rows = 800
    g = torch.Generator().manual_seed(11)
    cache = target.new_cache(rows, len(prompt) + tree.n + 2)
    slots = torch.arange(rows)
    last = prefill(target, cache, slots[:1], [prompt]).expand(rows)
    for r in range(1, rows):  # the other rows share the first one's prefill
        cache.copy_prefix(0, r, len(prompt) - 1)
    if drafter == "model":
        drafter = ModelDrafter(small, sp, rows, 2 * len(prompt) + tree.n + 8, torch.Generator().manual_seed(12))
    else:
        drafter = EagleDrafter(head, target, sp, torch.Generator().manual_seed(12))
    seqs = [Seq(list(prompt), i) for i in range(rows)]
    tokens, dq, present = drafter.propose_tree(seqs, tree)
    out = tree_step(target, cache, slots, last, sp, tree, tokens, dq, present, g)
    assert 0.2 < out.accepted.float().mean() < tree.k
    assert (out.path[:, 0] == 1).any()  # the root's second candidate was accepted in some rows
    with torch.no_grad():
        exact = sp.probs(target(torch.tensor([prompt]))[0, -1])
    counts = torch.bincount(out.tokens[:, 0], minlength=exact.shape[0]).numpy()
    assert chi2_pvalue(counts, exact.double().numpy()) > ALPHA
