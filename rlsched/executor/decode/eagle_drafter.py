"""The EAGLE-3 head as a drafter of the rollout engine (`--drafter eagle`).

The head drafts from the target's own states: the residual stream entering its low, middle
and high aux layers at each position of the row (`eagle.py`). The target keeps them while the
engine runs (`Transformer.capture`), and after every step the engine hands this drafter the
states of the positions the row kept (`observe`): the last token and the accepted drafts. A
row's states before that (its prompt, or the tokens a migrated row brings) come from the
target's prefill (`remember`), or else are computed when the row first drafts, by one
cache-less target forward over them; the samples of a prompt share them. The head attends to
the row's last `window` positions (its own context) and then to its own earlier drafts; the
states of older positions are dropped.
"""

from __future__ import annotations

import torch

from rlsched.executor.decode.eagle import EagleHead, target_features
from rlsched.executor.decode.sampling import GREEDY, SamplingParams, sample
from rlsched.executor.decode.speculative import Seq


class EagleDrafter:
    name = "eagle"

    def __init__(self, head: EagleHead, target, sampling, generator: torch.Generator | None = None, window: int = 8):
        self.head, self.target, self.sampling, self.generator, self.window = head, target, sampling, generator, window
        target.capture = tuple(head.config.aux_layers)
        self._rows: dict[int, tuple[Seq, torch.Tensor, int]] = {}  # slot -> (seq, last states, positions covered)
        self._prompts: dict[tuple, torch.Tensor] = {}  # a prompt's states (its samples share them)

    def reset(self) -> None:
        self._rows.clear()
        self._prompts.clear()

    def release(self, rows: list[Seq]) -> None:
        for s in rows:
            self._rows.pop(s.slot, None)

    def move(self, src: int, dst: int) -> None:
        if src in self._rows:
            self._rows[dst] = self._rows.pop(src)

    @torch.inference_mode()
    def observe(self, rows: list[Seq], states: torch.Tensor, kept: list[list[int]]) -> None:
        """After a target forward over [last, drafts or tree nodes] of each row (its states
        `states` (B, q, A*h)): row b kept the positions kept[b] (its last token first), which
        now precede the row's new last token. Call after the rows' tokens were extended."""
        for b, (seq, keep) in enumerate(zip(rows, kept)):
            entry = self._rows.get(seq.slot)
            covered = len(seq.tokens) - 1 - len(keep)  # the row's positions before this step
            if entry is None or entry[0] is not seq or entry[2] != covered:
                self._rows.pop(seq.slot, None)  # computed afresh when it drafts next
                continue
            new = torch.cat([entry[1], states[b, keep]])[-self.window :]
            self._rows[seq.slot] = (seq, new, covered + len(keep))

    def remember(self, tokens: list[int], states: torch.Tensor) -> None:
        """The states of a sequence the target just prefilled (`tokens`, (len, A*h)), for the
        rows that start from it (a prompt's samples)."""
        if len(self._prompts) > 1024:
            self._prompts.clear()
        self._prompts[tuple(tokens)] = states[-self.window :]

    @torch.inference_mode()
    def prepare(self, rows: list[Seq]) -> None:
        """Compute and keep the rows' states now (what `observe` hands over after each engine
        step; the profiler calls it, untimed, before it times a draft)."""
        for s in rows:
            self._states(s)

    @torch.inference_mode()
    def _states(self, seq: Seq) -> torch.Tensor:
        """The row's states at its last `window` positions before its last token."""
        n = len(seq.tokens) - 1
        entry = self._rows.get(seq.slot)
        if entry is not None and entry[0] is seq and entry[2] == n:
            return entry[1]
        key = tuple(seq.tokens[:n])
        states = self._prompts.get(key)
        if states is None:
            states, _ = target_features(
                self.target,
                torch.tensor([seq.tokens[:n]], device=self.target.embed.weight.device),
                self.head.config.aux_layers,
            )
            self.remember(seq.tokens[:n], states[0])
            states = self._prompts[key]
        self._rows[seq.slot] = (seq, states, n)
        return states

    def _groups(self, rows: list[Seq]):
        """(row indices, aux states, tokens) of the rows with as many positions to attend to:
        they draft together."""
        dev = self.target.embed.weight.device
        states = [self._states(s) for s in rows]
        groups: dict[int, list[int]] = {}
        for i, st in enumerate(states):
            groups.setdefault(st.shape[0], []).append(i)
        for t, idx in groups.items():
            aux = torch.stack([states[i] for i in idx])
            nxt = torch.tensor([rows[i].tokens[len(rows[i].tokens) - t :] for i in idx], device=dev)
            yield idx, aux, nxt

    @torch.inference_mode()
    def propose_tree(self, rows: list[Seq], tree):
        """A draft tree per row (`draft_tree`): tokens (B, n), draft_probs (B, n + 1, V)
        or None (greedy) and present (B, n), for `tree_verify`."""
        b, n, v = len(rows), tree.n, self.head.config.vocab_size
        dev = self.target.embed.weight.device
        tokens = torch.zeros((b, n), dtype=torch.long, device=dev)
        present = torch.zeros((b, n), dtype=torch.bool, device=dev)
        dists = None if self.sampling.greedy else torch.zeros((b, n + 1, v), device=dev)
        for idx, aux, nxt in self._groups(rows):
            x, q, ok = draft_tree(self.head, aux, nxt, tree, self.sampling, self.generator)
            tokens[idx], present[idx] = x, ok
            if dists is not None:
                dists[idx] = q
        return tokens, dists, present

    @torch.inference_mode()
    def propose(self, rows: list[Seq], k: int):
        b, v = len(rows), self.head.config.vocab_size
        dev = self.target.embed.weight.device
        tokens = torch.zeros((b, k), dtype=torch.long, device=dev)
        probs = torch.zeros((b, k, v), device=dev)
        if k == 0 or b == 0:
            return tokens.cpu(), probs, torch.zeros(b, dtype=torch.long)
        for idx, aux, nxt in self._groups(rows):
            d, q = draft(self.head, aux, nxt, k, self.sampling, self.generator)
            tokens[idx], probs[idx] = d, q
        return tokens.cpu(), probs, torch.full((b,), k, dtype=torch.long)


@torch.no_grad()
def draft(
    head: EagleHead,
    aux: torch.Tensor,
    tokens: torch.Tensor,
    k: int,
    sampling: SamplingParams = GREEDY,
    generator: torch.Generator | None = None,
):
    """k chain drafts per row. aux (B, T, A*h): the target's aux states at a row's positions
    0..T-1 (`target_features`; T = 1 gives the head the last position only); tokens (B, T):
    the token after each of those positions, the last being the token the target chose
    after the row's last verified position. Rows have equal length. Drafts are drawn from
    `sampling.probs` over the draft vocabulary (greedy: its argmax). Returns target ids
    (B, k) and the distributions they were drawn from over the target vocabulary (B, k, V),
    zero outside the draft vocabulary."""
    b, t, _ = aux.shape
    ids = head.draft_ids
    out_tokens = torch.zeros((b, k), dtype=torch.long, device=aux.device)
    out_probs = torch.zeros((b, k, head.config.vocab_size), device=aux.device)
    if k == 0:
        return out_tokens, out_probs
    positions = torch.arange(t, device=aux.device).expand(b, t)
    hidden, logits, ctx = head.layer(tokens, head.fc(aux), positions)
    hidden, logits, own = hidden[:, -1:], logits[:, -1], []
    for j in range(k):
        p = sampling.probs(logits)
        d = p.argmax(-1) if sampling.greedy else sample(p, generator)
        out_tokens[:, j] = ids[d]
        out_probs[:, j, ids] = p
        if j + 1 < k:
            hidden, logits, _ = head.layer(out_tokens[:, j : j + 1], hidden, positions[:, -1:] + j + 1, ctx, own)
            logits = logits[:, -1]
    return out_tokens, out_probs


@torch.no_grad()
def draft_tree(
    head: EagleHead,
    aux: torch.Tensor,
    tokens: torch.Tensor,
    tree,
    sampling: SamplingParams = GREEDY,
    generator: torch.Generator | None = None,
):
    """A draft tree (`tree_verify.DraftTree`, n nodes) per row, from the inputs `draft` takes.
    Each node's children are drawn without replacement from the head's distribution there
    (`tree_verify.draw_children`; greedy: its top tokens). The nodes of one depth go through
    the layer together, each as its own chain: fed its parent's output and its own token at
    the position of its depth, attending to the context anchors and to its ancestors' keys
    (what chain step j attends to at steps < j). Returns target ids (B, n), the
    distributions the children were drawn from over the target vocabulary (B, n + 1, V;
    index 0 the root's, i + 1 node i's; None when greedy) and present (B, n)."""
    from rlsched.executor.decode.tree_verify import draw_level

    b, t, _ = aux.shape
    n, ids, dev = tree.n, head.draft_ids, aux.device
    out_tokens = torch.zeros((b, n), dtype=torch.long, device=dev)
    present = torch.zeros((b, n), dtype=torch.bool, device=dev)
    dists = None if sampling.greedy else torch.zeros((b, n + 1, head.config.vocab_size), device=dev)
    positions = torch.arange(t, device=dev).expand(b, t)
    hidden, logits, (ctx_k, ctx_v) = head.layer(tokens, head.fc(aux), positions)
    node_hidden = torch.zeros((b, n, hidden.shape[-1]), dtype=hidden.dtype, device=dev)
    root_hidden, logits = hidden[:, -1:], logits[:, -1:]  # (B, 1, h), (B, P, D) over this level's parents
    level_kv: dict[int, tuple] = {}  # depth -> (k, v) of its nodes, (B, n_d, KV, 1, hd)
    anc = tree.ancestors()
    for d in range(tree.k):
        if d == 0:
            parents = [-1]
        else:  # the nodes of depth d, each a one-token chain step, give their children's distributions
            lo, hi = tree.level(d)
            parents, m = list(range(lo, hi)), hi - lo
            x = torch.where(present[:, lo:hi], out_tokens[:, lo:hi], 0).reshape(b * m, 1)
            par = [tree.parent[i] for i in parents]
            h_in = torch.stack([root_hidden[:, 0] if j < 0 else node_hidden[:, j] for j in par], 1)
            own = []
            for e in range(1, d):  # each node's ancestor at depth e, as the chain's step e
                elo, _ = tree.level(e)
                at = [int(anc[i, elo : elo + level_kv[e][0].shape[1]].nonzero()[0]) for i in parents]
                own.append(tuple(kv[:, at].reshape(b * m, *kv.shape[2:]) for kv in level_kv[e]))
            pos = torch.full((b * m, 1), t - 1 + d, dtype=torch.long, device=dev)
            ctx = (ctx_k.repeat_interleave(m, 0), ctx_v.repeat_interleave(m, 0))
            h_out, lg, (k_d, v_d) = head.layer(x, h_in.reshape(b * m, 1, -1), pos, ctx, own)
            node_hidden[:, lo:hi] = h_out.view(b, m, -1)
            level_kv[d] = (k_d.view(b, m, *k_d.shape[1:]), v_d.view(b, m, *v_d.shape[1:]))
            logits = lg.view(b, m, -1)
        p = sampling.probs(logits)  # (B, P, D)
        if dists is not None:
            dists[:, parents[0] + 1 : parents[-1] + 2, ids] = p
        for kids, x, ok in draw_level(tree, parents, logits, None if sampling.greedy else p, present, generator):
            out_tokens[:, kids] = ids[x]
            present[:, kids] = ok
    return out_tokens, dists, present
