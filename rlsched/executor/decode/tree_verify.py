"""Lossless verification of a draft TREE in one target forward (SpecInfer, Sequoia).

A `DraftTree` is the static shape shared by the rows of one step (decoded from a
`policies.tree.TreeShape`): node i has a parent (-1: the root, the row's last token), a rank
among its siblings (children are drawn in rank order) and a depth. Nodes are in BFS order
(depth, then parent, then rank), so parents come before their children and every depth is
one contiguous range of nodes.

`tree_verify` walks each row down its tree by multi-candidate rejection sampling (Sequoia's
rule for candidates drawn without replacement): at the current node, with p the target's
distribution there and q the drafter's (the one the node's children were drawn from, in rank
order, without replacement), each present child x is accepted with probability
min(1, p(x) / q(x)) of the current normalised residuals; a rejection sets
p <- normalise(max(0, p - q)), q(x) <- 0 and renormalises q. An accepted child becomes the
current node; when every child fails (or there are none) the emitted token is drawn from the
residual p (from the node's own p when it had no children: the bonus token). Every emitted
token is then distributed exactly as plain sampling from the target. Deterministic candidates
(`draft_probs=None`) are one-hot q: accept with probability p(x) / sum(p), zero p(x) on
rejection. Greedy accepts the child equal to the target's argmax and emits the argmax.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import torch

from rlsched.executor.decode.sampling import sample
from rlsched.executor.decode.speculative import PAD, VerifyResult
from rlsched.executor.model.transformer import TreeMask
from rlsched.policies.tree import TreeShape, tree_shape


@dataclass(frozen=True)
class DraftTree:
    """A draft tree's shape: per node (BFS order) its parent (-1 = the root), its 1-based rank
    among its siblings and its 1-based depth."""

    parent: tuple[int, ...]
    rank: tuple[int, ...]
    depth: tuple[int, ...]
    _memo: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self):
        if not (len(self.parent) == len(self.rank) == len(self.depth)) or not self.parent:
            raise ValueError("a draft tree needs parent, rank and depth of equal, non-zero length")
        for i, (par, d) in enumerate(zip(self.parent, self.depth)):
            if not -1 <= par < i or d != (1 if par < 0 else self.depth[par] + 1):
                raise ValueError("draft tree nodes must come after their parents, one level deeper")
            if i and d < self.depth[i - 1]:
                raise ValueError("draft tree nodes must be ordered by depth")

    @classmethod
    def from_shape(cls, shape: TreeShape) -> DraftTree:
        """The tree whose nodes are the shape's paths of sibling ranks (its codes)."""
        base = shape.width + 1
        paths = []
        for c in shape.code.tolist():
            path = []
            while c:
                c, r = divmod(c, base)
                path.append(r)
            paths.append(tuple(reversed(path)))
        index: dict[tuple, int] = {}
        parent, rank, depth = [], [], []
        # BFS: by depth, then parent, then rank (the parents' order is their paths' order)
        for path in sorted(paths, key=lambda p: (len(p), p)):
            index[path] = len(parent)
            parent.append(index[path[:-1]] if len(path) > 1 else -1)
            rank.append(path[-1])
            depth.append(len(path))
        return cls(tuple(parent), tuple(rank), tuple(depth))

    @classmethod
    def chain(cls, k: int) -> DraftTree:
        return cls(tuple(range(-1, k - 1)), (1,) * k, tuple(range(1, k + 1)))

    @property
    def n(self) -> int:
        return len(self.parent)

    @property
    def k(self) -> int:
        """The deepest node's depth: at most k drafts are accepted."""
        return self.depth[-1]

    @property
    def width(self) -> int:
        """The most children of one node."""
        return max(len(self.children(j)) for j in range(-1, self.n))

    def children(self, j: int) -> tuple[int, ...]:
        """Node j's children (j = -1: the root's) in rank order."""
        kids = self._memo.get(("children",))
        if kids is None:
            lists = {j: [] for j in range(-1, self.n)}
            for i, par in enumerate(self.parent):
                lists[par].append(i)
            by_rank = {j: tuple(sorted(c, key=self.rank.__getitem__)) for j, c in lists.items()}
            kids = self._memo[("children",)] = by_rank
        return kids[j]

    def level(self, d: int) -> tuple[int, int]:
        """The nodes of depth d: range(lo, hi)."""
        return self.depth.index(d), len(self.depth) - self.depth[::-1].index(d)

    def ancestors(self) -> torch.Tensor:
        """(n, n) bool: node i sees node j iff j is i or one of i's ancestors."""
        anc = self._memo.get(("ancestors",))
        if anc is None:
            anc = torch.eye(self.n, dtype=torch.bool)
            for i, par in enumerate(self.parent):
                if par >= 0:
                    anc[i] |= anc[par]
            self._memo[("ancestors",)] = anc
        return anc

    def _on(self, name: str, device, make):
        key = (name, str(device))
        out = self._memo.get(key)
        if out is None:
            out = self._memo[key] = make()
        return out

    def child_table(self, device) -> torch.Tensor:
        """(n + 1, width) long: row j + 1 lists node j's children (row 0 the root's) in rank
        order, -1 after."""

        def make():
            t = torch.full((self.n + 1, self.width), -1, dtype=torch.long)
            for j in range(-1, self.n):
                kids = self.children(j)
                t[j + 1, : len(kids)] = torch.tensor(kids, dtype=torch.long)
            return t.to(device)

        return self._on("child_table", device, make)

    def target_mask(self, device) -> TreeMask:
        """The tree attention of a verify forward over [root, nodes...]: the root sees itself,
        node i the root and its ancestors; rope offsets are depths (the root's 0)."""

        def make():
            q = self.n + 1
            visible = torch.zeros((q, q), dtype=torch.bool)
            visible[:, 0] = True
            visible[1:, 1:] = self.ancestors()
            rel = torch.tensor((0,) + self.depth, dtype=torch.long)
            return TreeMask(visible.to(device), rel.to(device))

        return self._on("target_mask", device, make)

    def level_mask(self, d: int, device) -> TreeMask:
        """The tree attention of a drafter forward over the nodes of depth d, written after the
        nodes of depths < d, which follow the row's context (whose last token is the root)."""

        def make():
            lo, hi = self.level(d)
            visible = self.ancestors()[lo:hi, :hi]
            rel = torch.tensor(self.depth[lo:hi], dtype=torch.long) - 1
            return TreeMask(visible.to(device), rel.to(device))

        return self._on(f"level_mask{d}", device, make)


@lru_cache(maxsize=1024)
def tree_of(k: int, width: int, nodes: int, a_ref: float, gain: float) -> DraftTree:
    """The DraftTree of `tree_shape(k, width, nodes, a_ref, gain)`, built once."""
    return DraftTree.from_shape(tree_shape(k, width, nodes, a_ref, gain))


def draw_children(
    q: torch.Tensor, m: int, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """m draws without replacement, in order, from each row of q (B, V) (not necessarily
    normalised): tokens (B, m) long and present (B, m) bool, False where a row's q has fewer
    than m tokens of non-zero mass. The order of q_i / E_i (E_i ~ Exp(1) i.i.d.) is the
    order of successive draws that each renormalise q without the tokens already drawn (the
    exponential race of `sampling.sample`, continued)."""
    b, v = q.shape
    e = (
        torch.empty_like(q, dtype=torch.float32)
        .exponential_(generator=generator)
        .clamp_min_(torch.finfo(torch.float32).tiny)
    )
    keys, tokens = (q.float() / e).topk(min(m, v), dim=-1)
    present = keys > 0
    if m > v:
        pad = torch.zeros((b, m - v), dtype=torch.long, device=q.device)
        tokens, present = torch.cat([tokens, pad], 1), torch.cat([present, pad.bool()], 1)
    return tokens, present


def draw_level(
    tree: DraftTree,
    parents: list[int],
    logits: torch.Tensor,
    probs: torch.Tensor | None,
    present: torch.Tensor,
    generator: torch.Generator | None = None,
):
    """The children of one level's nodes `parents` (node ids; [-1]: the root) in every row,
    from the drafter's logits (B, P, V) there: drawn without replacement from `probs` (B, P, V)
    (`draw_children`), or its top tokens when `probs` is None (greedy); a child of an absent
    parent is absent (`present` (B, n): the nodes drawn so far). Yields, per number of
    children m, (node ids (P', m), vocabulary indices (B, P', m), present (B, P', m))."""
    b, dev = logits.shape[0], logits.device
    by_m: dict[int, list[int]] = {}
    for i, j in enumerate(parents):
        if tree.children(j):
            by_m.setdefault(len(tree.children(j)), []).append(i)
    for m, idx in by_m.items():
        kids = torch.tensor([tree.children(parents[i]) for i in idx], device=dev)
        if probs is None:
            x = logits[:, idx].topk(m, dim=-1).indices
            ok = torch.ones_like(x, dtype=torch.bool)
        else:
            x, ok = draw_children(probs[:, idx].reshape(-1, probs.shape[-1]), m, generator)
            x, ok = x.view(b, len(idx), m), ok.view(b, len(idx), m)
        if parents[0] >= 0:
            ok = ok & present[:, [parents[i] for i in idx]][..., None]
        yield kids, x, ok


@dataclass
class TreeVerifyResult(VerifyResult):
    path: torch.Tensor  # (B, K) int64: the accepted nodes in depth order, -1 after


def _reject(p: torch.Tensor, q: torch.Tensor | None, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The residuals after candidate x (B,) was rejected: p <- max(0, p/|p| - q/|q|) and q
    without x (one-hot q: p without x). Neither is normalised (the acceptance test and
    `sample` divide by the sums). A residual without mass (a rejection of probability 0, up to
    rounding) keeps p."""
    x = x[:, None]
    if q is None:
        return p.scatter(-1, x, 0.0), None
    res = (p / p.sum(-1, keepdim=True) - q / q.sum(-1, keepdim=True).clamp_min(1e-30)).clamp_min_(0.0)
    res = torch.where(res.sum(-1, keepdim=True) > 0, res, p)
    return res, q.scatter(-1, x, 0.0)


def tree_verify(
    tree: DraftTree,
    target_probs: torch.Tensor,
    tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    present: torch.Tensor,
    generator: torch.Generator | None = None,
    greedy: bool = False,
) -> TreeVerifyResult:
    """Walk every row down its draft tree at once (rule: module docstring).

    target_probs (B, n + 1, V): p after `sampling.probs` at the root (index 0) and at each
    node (i + 1); tokens (B, n) the nodes' tokens; draft_probs (B, n + 1, V) the distribution
    each node's children were drawn from (index 0: the root's), or None for deterministic
    candidates; present (B, n): absent nodes are never accepted (nor their subtrees)."""
    b, n1, v = target_probs.shape
    n, k = tree.n, tree.k
    dev = target_probs.device
    if n1 != n + 1 or tokens.shape != (b, n) or present.shape != (b, n):
        raise ValueError(f"a tree of {n} nodes needs target_probs (B, {n + 1}, V), tokens and present (B, {n})")
    if draft_probs is not None and draft_probs.shape != target_probs.shape:
        raise ValueError(f"draft_probs must have shape {tuple(target_probs.shape)}, got {tuple(draft_probs.shape)}")
    table = tree.child_table(dev)
    toks = tokens.to(dev).long().clamp(0, v - 1)
    present = present.to(dev).bool()
    if draft_probs is not None and not greedy:
        draft_probs = draft_probs.to(dev).float()
    rows = torch.arange(b, device=dev)
    cur = torch.full((b,), -1, dtype=torch.long, device=dev)  # the current node, -1 = the root
    alive = torch.ones(b, dtype=torch.bool, device=dev)
    path = torch.full((b, k), -1, dtype=torch.long, device=dev)
    final = target_probs[:, 0]  # the distribution each row's last token is drawn from
    for d in range(k + 1):
        at = cur + 1
        p = target_probs[rows, at]
        q = None if greedy or draft_probs is None else draft_probs[rows, at]
        best = p.argmax(-1) if greedy else None
        moved = torch.zeros(b, dtype=torch.bool, device=dev)
        for r in range(table.shape[1]):
            child = table[at, r]
            node = child.clamp_min(0)
            cand = alive & ~moved & (child >= 0) & present[rows, node]
            x = toks[rows, node]
            if greedy:
                ok = cand & (x == best)
            else:
                u = torch.rand(b, generator=generator, device=dev)
                px = p.gather(-1, x[:, None])[:, 0]
                if q is None:
                    ok = cand & (u * p.sum(-1) < px)
                else:  # u < (p(x) / |p|) / (q(x) / |q|) without dividing
                    ok = cand & (u * q.gather(-1, x[:, None])[:, 0] * p.sum(-1) < px * q.sum(-1))
                rejected = (cand & ~ok)[:, None]
                p_rej, q_rej = _reject(p, q, x)
                p = torch.where(rejected, p_rej, p)
                q = None if q is None else torch.where(rejected, q_rej, q)
            moved |= ok
            cur = torch.where(ok, child, cur)
        final = torch.where((alive & ~moved)[:, None], p, final)
        if d < k:
            path[:, d] = torch.where(moved, cur, -1)
        alive = moved
    accepted = (path >= 0).sum(-1)
    last = final.argmax(-1) if greedy else sample(final, generator)

    out = torch.full((b, k + 1), PAD, dtype=torch.long, device=dev)
    on_path = path >= 0
    out[:, :k] = torch.where(on_path, toks.gather(1, path.clamp_min(0)), PAD)
    out[rows, accepted] = last
    # token j is scored where it was drawn: at the root (j = 0), else at path node j - 1
    at = torch.cat([torch.zeros((b, 1), dtype=torch.long, device=dev), path + 1], 1)
    emitted = out != PAD
    p_at = target_probs.gather(1, at[..., None].expand(b, k + 1, v))
    lp = p_at.gather(-1, out.clamp_min(0)[..., None])[..., 0].clamp_min(1e-45).log()
    return TreeVerifyResult(accepted, out, torch.where(emitted, lp, torch.zeros_like(lp)), path)
