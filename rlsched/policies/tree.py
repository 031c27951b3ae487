"""Draft trees: their shape and how many tokens they get accepted.

A tree strategy drafts `k` levels, each drafter forward proposing the `width` most likely next
tokens of the branches it extends (SGLang's steps and topk), and sends the best `nodes` of
them to the target (SGLang's num_draft_tokens minus the root), which verifies them in one
forward with a tree mask. The target keeps the longest drafted path it accepts.

Acceptance model. At every depth the target's next token is the drafter's candidate of rank
r with probability p_r, independently of the depth: p_1 = a, the per-token acceptance of a
chain, and each further candidate takes the share `gain` of what the candidates before it
missed: p_r = (1 - a) gain (1 - gain)^(r - 2) for r >= 2. So the top r candidates hold
h_r = 1 - (1 - a)(1 - gain)^(r - 1): the top-r hit rate grows by less and less. (Treating the
candidates as independent draws, h_r = 1 - (1 - a)^r, is the gain = a special case: far too
optimistic for real drafters, whose second choice is seldom right when the first is not.)

A node's path of ranks (r_1..r_d) is the target's with probability prod p_{r_j}; the tree is
the `nodes` paths most likely under a reference acceptance (EAGLE-2's dynamic tree keeps the
drafts its drafter is most confident of), at most `k` deep and `width` wide. A chain is the
tree of width 1: its paths are the top-1 ranks, reached with probability a^d.

Because the events "the target's path is this node's" are disjoint across the nodes of one
depth, P(accepted >= d) is the sum of the depth-d nodes' probabilities and the expected
accepted length is the sum over all nodes: closed forms that the simulator's draws are tested
against.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

TREE_GAIN = 0.25  # default `gain` (AcceptanceSpec.tree_gain): the share of a miss the next candidate catches


@dataclass(frozen=True)
class TreeShape:
    """The nodes of one tree: for each, its depth, how many of its path's edges are rank 1
    (`top`) and how many are not (`other`), and the sum over those of (rank - 2) (`excess`),
    which set its probability; `code` names each path (ranks as digits in base width + 1) and
    `has_top_child` says whether the node's rank-1 child is in the tree."""

    k: int
    width: int
    depth: np.ndarray
    top: np.ndarray
    other: np.ndarray
    excess: np.ndarray
    code: np.ndarray  # sorted
    has_top_child: np.ndarray  # aligned with code

    @property
    def nodes(self) -> int:
        return len(self.code)

    def node_probs(self, a: np.ndarray, gain: float) -> np.ndarray:
        """(rows, nodes): each node's probability of being on the target's path, per row of
        acceptance a."""
        a = np.clip(np.asarray(a, dtype=float), 1e-9, 1 - 1e-9)[:, None]
        log_other = np.log1p(-a) + math.log(gain)
        return np.exp(self.top * np.log(a) + self.other * log_other + self.excess * math.log1p(-gain))

    def reach(self, a: np.ndarray, gain: float) -> np.ndarray:
        """(rows, k): P(accepted >= d) for d = 1..k, per row."""
        p = self.node_probs(a, gain)
        out = np.zeros((p.shape[0], self.k))
        np.add.at(out.T, self.depth - 1, p.T)
        return out

    def expected_accepted(self, a: np.ndarray, gain: float) -> np.ndarray:
        """Expected accepted draft tokens a step, per row."""
        return self.node_probs(a, gain).sum(axis=1)


def chain_tokens(a, k):
    """Expected tokens of a chain step of `k` drafts at per-token acceptance `a` < 1: the
    accepted drafts plus the target's own token, sum_{j=0..k} a^j = (1 - a^(k+1)) / (1 - a)
    (numpy arrays broadcast; a tree's counterpart is `TreeShape.expected_accepted` + 1)."""
    return (1 - a ** (k + 1)) / (1 - a)


def reference_acceptance(mean: float, top1: float) -> float:
    """The rank-1 rate a drafter's tree shapes are built for: its mean chain acceptance times
    `tree_top1`, rounded so that policies and the simulator build the very same shape."""
    return round(mean * top1, 3)


def max_nodes(k: int, width: int) -> int:
    """Nodes of the full tree k deep and width wide."""
    return k if width == 1 else width * (width**k - 1) // (width - 1)


def rank_probs(a: float, gain: float, width: int) -> np.ndarray:
    """p_1..p_width for acceptance a."""
    r = np.arange(2, width + 1)
    return np.concatenate(([a], (1 - a) * gain * (1 - gain) ** (r - 2)))


@lru_cache(maxsize=4096)
def tree_shape(k: int, width: int, nodes: int, a_ref: float, gain: float) -> TreeShape:
    """The `nodes` most likely paths under acceptance `a_ref`, at most k deep and width wide
    (ties go to the smaller ranks, then the shallower path)."""
    if not 1 <= k <= nodes <= max_nodes(k, width):
        raise ValueError(f"a tree of depth {k} and width {width} has {k}..{max_nodes(k, width)} nodes, not {nodes}")
    logp = np.log(np.maximum(rank_probs(a_ref, gain, width), 1e-300))
    frontier: list[tuple[float, tuple[int, ...]]] = [(-logp[r - 1], (r,)) for r in range(1, width + 1)]
    heapq.heapify(frontier)
    chosen: list[tuple[int, ...]] = []
    while len(chosen) < nodes:
        neg, path = heapq.heappop(frontier)
        chosen.append(path)
        if len(path) < k:
            for r in range(1, width + 1):
                heapq.heappush(frontier, (neg - logp[r - 1], path + (r,)))
    base = width + 1

    def code(path):
        c = 0
        for r in path:
            c = c * base + r
        return c

    codes = np.array([code(p) for p in chosen], dtype=np.int64)
    order = np.argsort(codes)
    chosen = [chosen[i] for i in order]
    in_tree = set(codes.tolist())
    ranks = [np.array(p) for p in chosen]
    return TreeShape(
        k=k,
        width=width,
        depth=np.array([len(p) for p in chosen]),
        top=np.array([(r == 1).sum() for r in ranks]),
        other=np.array([(r > 1).sum() for r in ranks]),
        excess=np.array([np.maximum(r - 2, 0).sum() for r in ranks]),
        code=codes[order],
        has_top_child=np.array([code(p) * base + 1 in in_tree for p in chosen]),
    )


def draw_tree(shape: TreeShape, a: np.ndarray, gain: float, uniforms: np.ndarray):
    """Walk the target's path down the tree for each row: at each depth the target's token has
    rank r with probability p_r(a); the walk goes on while that child is in the tree.

    `a` is (rows,), `uniforms` (k, rows). Returns (accepted, top1_hits, top1_misses) per row:
    the accepted length, and the rank-1 trials the walk observed (a depth reached whose token
    was, or was not, the drafter's first choice; the depth where it stopped counts as a miss
    when the tree held the rank-1 child there). Those trials are Bernoulli(a) whatever the
    tree, so they update a chain's acceptance estimate exactly (where the tree leaves out a
    rank-1 child, a stop there says nothing of it)."""
    a = np.asarray(a, dtype=float)
    rows = len(a)
    code = np.zeros(rows, dtype=np.int64)
    alive = np.ones(rows, dtype=bool)
    acc = np.zeros(rows, dtype=np.int64)
    hits = np.zeros(rows, dtype=np.int64)
    misses = np.zeros(rows, dtype=np.int64)
    base = shape.width + 1
    miss_share = np.maximum(1 - a, 1e-300)
    for d in range(shape.k):
        u = uniforms[d]
        # rank: 1 below a; else the r with (1-gain)^(r-1) < (1-u)/(1-a) <= (1-gain)^(r-2)
        with np.errstate(divide="ignore", invalid="ignore"):
            tail = np.log(np.maximum(1 - u, 1e-300) / miss_share) / math.log1p(-gain)
        rank = np.where(u < a, 1, 2 + np.floor(np.maximum(tail, 0.0)).astype(np.int64))
        child = code * base + np.minimum(rank, shape.width)
        pos = np.minimum(np.searchsorted(shape.code, child), shape.nodes - 1)
        in_tree = alive & (rank <= shape.width) & (shape.code[pos] == child)
        if d > 0:
            parent_pos = np.minimum(np.searchsorted(shape.code, code), shape.nodes - 1)
            top_child = shape.has_top_child[parent_pos]
        else:
            top_child = np.full(rows, shape.code[0] == 1)
        # the rank is known where the walk goes on; where it stops, only that it is not 1 when
        # the rank-1 child was there to take
        observed = in_tree | alive & top_child
        hits += observed & (rank == 1)
        misses += observed & (rank != 1)
        alive = in_tree
        code = np.where(alive, child, code)
        acc += alive
        if not alive.any():
            break
    return acc, hits, misses


NODE_BUDGETS = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
GRID = np.linspace(0.0, 1.0, 257)  # acceptance levels a tree's expected tokens are tabled at


def tree_options(k_max: int, width_max: int, nodes_max: int) -> list[tuple[int, int, int]]:
    """(depth, width, nodes) of the trees a policy chooses among: widths 2, 4, 8.. up to
    width_max, depths 1..k_max, node budgets from NODE_BUDGETS above the depth (a tree no
    larger than its depth is a chain) up to nodes_max and the full tree."""
    out, w = [], 2
    while w <= width_max:
        for k in range(1, k_max + 1):
            out += [(k, w, n) for n in NODE_BUDGETS if k < n <= min(nodes_max, max_nodes(k, w))]
        w *= 2
    return out


class TreeTable:
    """A drafter's tree options with their expected accepted drafts a step tabled over
    acceptance (GRID): a batch's expected tokens under every option is one product with the
    histogram of its rows' acceptance."""

    def __init__(self, options: list[tuple[int, int, int]], a_ref: float, gain: float):
        self.options = options
        self.shapes = [tree_shape(k, w, n, a_ref, gain) for k, w, n in options]
        self.accepted = np.array([s.expected_accepted(GRID, gain) for s in self.shapes]).reshape(len(options), -1)

    @staticmethod
    def histogram(a: np.ndarray) -> np.ndarray:
        """Rows per GRID level (each row at its nearest level)."""
        return np.bincount(np.rint(np.clip(a, 0.0, 1.0) * (len(GRID) - 1)).astype(np.int64), minlength=len(GRID))

    def tokens(self, a: np.ndarray, drain: bool = False) -> np.ndarray:
        """Expected tokens a step of each option, summed over rows of acceptance `a` (with
        `drain`, as `draft.drain_tokens` counts them: B^2 / sum_i 1 / E_i)."""
        hist = self.histogram(a)
        if drain:
            return len(a) ** 2 / ((1.0 / (1.0 + self.accepted)) @ hist)
        return len(a) + self.accepted @ hist
