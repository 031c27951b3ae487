"""Drafters behind one interface: `propose(rows, k) -> (tokens (B, k), probs (B, k, V) | None,
k_per_row (B,))`.

`rows` are the running sequences (`Seq`: the tokens so far, prompt then generated, the cache
slot, the prompt id). A drafter may propose fewer than k tokens for a row (an n-gram without a
match); `k_per_row` says how many, the rest of the row is padding. `probs` is None for
deterministic drafts (q one-hot), else the distributions the drafts were sampled from,
processed with the same `SamplingParams` as the target.

- `off`: nothing (k_per_row all 0).
- `ngram`: the longest suffix of the row (n = max_n down to min_n tokens) that occurred
  before, in the row itself (prompt and generated text) or in earlier rollouts of the same
  prompt given with `add_history` (RL samples each prompt again every epoch); the tokens
  that followed it are the draft. Most recent occurrence first, the row itself before history.
- `suffix`: counts of what followed each recent context in the prompt's earlier rollouts and
  in the row (`executor/decode/suffix.py`); drafts while it stays confident.
- `model`: a small LM with the same vocabulary and its own KV cache, sampling its drafts.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Protocol

import torch

from rlsched.executor.decode.sampling import SamplingParams, sample
from rlsched.executor.decode.speculative import Seq, length_groups
from rlsched.executor.decode.suffix import HostDrafter, NgramIndex


class Drafter(Protocol):
    name: str

    def propose(self, rows: list[Seq], k: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]: ...


class OffDrafter:
    name = "off"

    def propose(self, rows, k):
        b = len(rows)
        return torch.zeros((b, k), dtype=torch.long), None, torch.zeros(b, dtype=torch.long)


def _find(hay: list[int], pattern: list[int], k: int, end: int) -> list[int]:
    """Continuation (up to k tokens) after the most recent occurrence of `pattern` in
    hay[:end] whose continuation is non-empty."""
    n = len(pattern)
    first = pattern[0]
    for i in range(min(end, len(hay) - 1) - n, -1, -1):
        if hay[i] == first and hay[i : i + n] == pattern:
            return hay[i + n : i + n + k]
    return []


class NgramDrafter(HostDrafter):
    name = "ngram"

    def __init__(self, max_n: int = 3, min_n: int = 1, max_history: int | None = None):
        if not 1 <= min_n <= max_n:
            raise ValueError("ngram drafter needs 1 <= min_n <= max_n")
        self.max_n, self.min_n, self.max_history = max_n, min_n, max_history
        self._past: dict[Hashable, NgramIndex] = {}

    def add_history(self, prompt_id: Hashable, tokens: list[int]) -> None:
        """An earlier rollout (prompt + response) of `prompt_id`, searched after the row itself;
        only the newest `max_history` per prompt are kept (the policy moves on: RL)."""
        index = self._past.get(prompt_id)
        if index is None:
            index = self._past[prompt_id] = NgramIndex(self.min_n, self.max_n, self.max_history)
        index.add(list(tokens))

    def draft_one(self, seq: Seq, k: int) -> list[int]:
        t = seq.tokens
        past = self._past.get(seq.prompt_id) if seq.prompt_id is not None else None
        for n in range(min(self.max_n, len(t)), self.min_n - 1, -1):
            pattern = t[-n:]
            found = _find(t, pattern, k, len(t) - 1)  # not the suffix itself
            if not found and past is not None:
                found = past.continuation(pattern, k)  # the newest earlier rollout's, indexed
            if found:
                return found
        return []


class ModelDrafter:
    """A small LM drafting k tokens by sampling (same SamplingParams as the target).

    Its cache row `seq.slot` holds a prefix of the row's tokens; each `propose` keeps the
    part that still agrees with the row (accepted drafts do), feeds the rest in one ragged
    forward, then k - 1 one-token forwards. A ragged forward pads every row to the longest
    feed (a fresh row's prompt), so size `max_len` for the longest context plus the longest
    prompt (`drafter_cache_len`); rows that would not fit are fed one by one. Fresh rows
    with the same tokens (a prompt's samples) are fed once (`_feed`)."""

    name = "model"

    def __init__(
        self, model, sampling: SamplingParams, max_batch: int, max_len: int, generator: torch.Generator | None = None
    ):
        self.model, self.sampling, self.generator = model, sampling, generator
        self.new_cache(max_batch, max_len)
        # slot -> (the Seq, the tokens in its cache row, how many of those are the Seq's own:
        # the rest are drafts, kept as far as they were accepted)
        self.cached: dict[int, tuple[Seq, list[int], int]] = {}
        self.catch_up = 0  # tokens the last propose fed beyond two a row (see StepOutcome.catch_up)

    @torch.inference_mode()
    def new_cache(self, max_batch: int, max_len: int) -> None:
        """A fresh cache, of inference tensors (as the engine's own): views of them cost less
        to make than of normal tensors in inference mode (a drafter forward reads and writes
        the cache through several a layer), and a compiled model (`compiled.py`) was compiled
        for them. So the drafter's methods all run in inference mode."""
        self.cache = self.model.new_cache(max_batch, max_len)

    @torch.inference_mode()
    def reset(self) -> None:
        self.cache.free(torch.arange(self.cache.max_batch))
        self.cached.clear()

    @torch.inference_mode()
    def release(self, rows: list[Seq]) -> None:
        slots = [s.slot for s in rows]
        self.cache.free(slots)
        for s in slots:
            self.cached.pop(s, None)

    @torch.inference_mode()
    def move(self, src: int, dst: int) -> None:
        """The row in slot `src` now lives in the empty slot `dst` (the engine compacts)."""
        self.cache.move(src, dst)
        self.cached.pop(dst, None)
        if src in self.cached:
            self.cached[dst] = self.cached.pop(src)

    @torch.inference_mode()
    def rewind(self, rows: list[Seq], lengths: list[int]) -> None:
        """Row i's cache back to its sequence's first lengths[i] tokens, as if it had just
        reached them: the profiler replays one step from the same context again and again."""
        slots = torch.tensor([s.slot for s in rows], dtype=torch.long, device=self.cache.lengths.device)
        self.cache.trim(slots, torch.tensor(lengths, device=slots.device))
        for s, n in zip(rows, lengths):
            self.cached[s.slot] = (s, s.tokens[:n], n)

    @torch.inference_mode()
    def propose(self, rows, k):
        b = len(rows)
        if k == 0:
            return torch.zeros((b, 0), dtype=torch.long), None, torch.zeros(b, dtype=torch.long)
        slots, logits = self._catch_up(rows)
        toks, dists = [], []
        for i in range(k):
            p = self.sampling.probs(logits[:, 0])
            x = p.argmax(-1) if self.sampling.greedy else sample(p, self.generator)
            toks.append(x)
            dists.append(p)
            if i < k - 1:
                logits = self.model(x[:, None], self.cache, slots=slots)
        tokens = torch.stack(toks, 1)
        for r, s in enumerate(rows):
            self.cached[s.slot] = (s, s.tokens + tokens[r, : k - 1].tolist(), len(s.tokens))
        return tokens.cpu(), torch.stack(dists, 1), torch.full((b,), k, dtype=torch.long)

    @torch.inference_mode()
    def propose_tree(self, rows, tree) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Draft a tree (`tree_verify.DraftTree`, n nodes) per row: the children of each node
        are drawn without replacement from this model's processed distribution there
        (`draw_children`; greedy: its top tokens), one forward per depth over the nodes of
        the depth above, written after the row's context with the tree's attention mask.
        Returns tokens (B, n), draft_probs (B, n + 1, V) (index 0: the root's; None when
        greedy) and present (B, n), on this model's device, for `tree_verify`. Afterwards the
        cache holds each row's tokens only (the next proposal feeds what was accepted); it
        needs room for the nodes above the deepest level."""
        from rlsched.executor.decode.tree_verify import draw_level

        b, n = len(rows), tree.n
        slots, logits = self._catch_up(rows)
        context = self.cache.lengths[slots].clone()
        dev = logits.device
        tokens = torch.zeros((b, n), dtype=torch.long, device=dev)
        present = torch.zeros((b, n), dtype=torch.bool, device=dev)
        greedy = self.sampling.greedy
        dists = None if greedy else torch.zeros((b, n + 1, logits.shape[-1]), device=dev)
        for d in range(tree.k):
            if d == 0:
                parents = [-1]
            else:  # the nodes of depth d, in one forward, give their children's distributions
                lo, hi = tree.level(d)
                parents = list(range(lo, hi))
                ids = torch.where(present[:, lo:hi], tokens[:, lo:hi], 0)
                logits = self.model(ids, self.cache, slots=slots, tree=tree.level_mask(d, dev))
            p = None if greedy else self.sampling.probs(logits)
            if p is not None:
                dists[:, parents[0] + 1 : parents[-1] + 2] = p
            for kids, x, ok in draw_level(tree, parents, logits, p, present, self.generator):
                tokens[:, kids] = x
                present[:, kids] = ok
        self.cache.trim(slots, context, check=False)
        for s in rows:
            self.cached[s.slot] = (s, list(s.tokens), len(s.tokens))
        return tokens, dists, present

    def _catch_up(self, rows) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' slots and the logits (B, 1, V) after each row's cache holds all its
        tokens: the part of the row the cache still agrees with is kept, the rest fed."""
        dev = self.cache.lengths.device
        slots = torch.tensor([s.slot for s in rows], dtype=torch.long, device=dev)
        keep, new = [], []
        for s in rows:
            owner, have, c = self.cached.get(s.slot, (None, [], 0))
            if owner is not s:  # another sequence took the slot: check from the start
                c = 0
            limit = min(len(have), len(s.tokens) - 1)  # feed at least the last token
            c = min(c, limit)
            while c < limit and have[c] == s.tokens[c]:
                c += 1
            keep.append(c)
            new.append(s.tokens[c:])
        self.cache.trim(slots, torch.tensor(keep, device=dev), check=False)  # keep[i] <= len(have): cached
        self.catch_up = sum(max(0, len(t) - 2) for t in new)
        return slots, self._feed(slots, keep, new)

    def _feed(self, slots: torch.Tensor, keep: list[int], new: list[list[int]]) -> torch.Tensor:
        """Logits (B, 1, V) after each row takes in its new tokens. Rows that take in the same
        tokens from an empty cache row (the samples of one prompt at their first draft) are
        fed once: the others copy that row's KV and its logits. Feeds of very different lengths
        go in separate forwards (`length_groups`): a row that just joined feeds its whole prompt,
        and padding every running row's one or two tokens to that length would make such a
        step's drafting cost a prefill of the whole batch."""
        first: dict[tuple, int] = {}
        fed, copies = [], []
        for i, (c, t) in enumerate(zip(keep, new)):
            if c == 0:
                j = first.setdefault(tuple(t), i)
                if j != i:
                    copies.append((i, j))
                    continue
            fed.append(i)
        parts = [[fed[g] for g in group] for group in length_groups([len(new[i]) for i in fed])]
        if len(parts) == 1 and not copies:
            return self._forward(slots, keep, new)
        out = None
        for idx in parts:
            logits = self._forward(slots[idx], [keep[i] for i in idx], [new[i] for i in idx])
            if out is None:
                out = logits.new_empty((len(new), *logits.shape[1:]))
            out[idx] = logits
        for i, j in copies:
            self.cache.copy_prefix(int(slots[j]), int(slots[i]), len(new[j]))
            out[i] = out[j]
        return out

    def _forward(self, slots: torch.Tensor, keep: list[int], new: list[list[int]]) -> torch.Tensor:
        dev = slots.device
        q = max(len(t) for t in new)
        if max(keep) + q <= self.cache.max_len:
            ids = torch.tensor([t + [0] * (q - len(t)) for t in new], device=dev)
            n_new = [len(t) for t in new]
            if min(n_new) == q:  # not ragged (always at batch 1): the forward skips the per-row bookkeeping
                n_new = None
            return self.model(ids, self.cache, slots=slots, n_new=n_new, last_only=True)
        # a ragged feed pads every row to the longest: row by row where that would overflow
        return torch.cat(
            [
                self.model(torch.tensor([t], device=dev), self.cache, slots=slots[i : i + 1], last_only=True)
                for i, t in enumerate(new)
            ]
        )


def drafter_cache_len(longest_prompt: int, max_new_tokens: int, k_max: int) -> int:
    """A model drafter's cache length: a row's longest context plus a ragged feed as long as
    the longest prompt (see ModelDrafter), plus the drafts."""
    return 2 * longest_prompt + max_new_tokens + 2 * k_max + 8


def make_drafter(name: str, **kwargs):
    if name == "off":
        return OffDrafter()
    if name == "ngram":
        return NgramDrafter(**kwargs)
    if name == "suffix":
        from rlsched.executor.decode.suffix import SuffixDrafter

        return SuffixDrafter(**kwargs)
    if name == "model":
        return ModelDrafter(**kwargs)
    raise ValueError(f"unknown drafter {name!r}; known: off, ngram, suffix, model")
