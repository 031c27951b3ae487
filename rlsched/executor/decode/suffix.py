"""A suffix drafter: drafts from what followed the same context in a prompt's earlier rollouts
and in the row itself, from counts kept up to date token by token.

RL samples every prompt again and again (G samples a step, every epoch), and a prompt's
answers repeat one another (DAS, SPEC-RL). For each prompt the drafter keeps, for every context
of 1..`depth` tokens seen in its newest `max_history` rollouts, how often each token followed
it; each running row keeps the same counts over its own tokens. A draft walks forward from the
row's end: at each position the longest context (up to `depth` tokens) that either index has
seen picks the token that followed it most often, and the walk goes on while the product of
those tokens' shares stays at or above `min_confidence`, so a well-worn path drafts long and a
fork stops it: the budget grows with the match's length and frequency.

Adding a rollout costs its length x depth updates; evicting the oldest subtracts the same;
drafting costs k x depth lookups however many rollouts a prompt has.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable

import torch

from rlsched.executor.decode.speculative import Seq


class SuffixCounts:
    """Next-token counts after every context of 1..depth tokens of the sequences added."""

    def __init__(self, depth: int):
        self.depth = depth
        self.counts: dict[tuple[int, ...], dict[int, int]] = {}

    def add(self, tokens: list[int], start: int = 1, sign: int = 1) -> None:
        """Count (or with sign -1 uncount) the token at each position >= start after the
        contexts ending just before it."""
        for i in range(max(start, 1), len(tokens)):
            nxt = tokens[i]
            for n in range(1, min(self.depth, i) + 1):
                key = tuple(tokens[i - n : i])
                c = self.counts.get(key)
                if c is None:
                    c = self.counts[key] = {}
                v = c.get(nxt, 0) + sign
                if v > 0:
                    c[nxt] = v
                else:
                    c.pop(nxt, None)
                    if not c:
                        del self.counts[key]

    def longest(self, context: list[int]) -> tuple[int, dict[int, int] | None]:
        """The longest suffix of `context` (up to depth tokens) seen here: its length and counts."""
        for n in range(min(self.depth, len(context)), 0, -1):
            c = self.counts.get(tuple(context[-n:]))
            if c:
                return n, c
        return 0, None

    def __len__(self) -> int:
        return sum(len(c) for c in self.counts.values())


class NgramIndex:
    """Where every n-gram of min_n..max_n tokens occurs in a prompt's newest `max_history`
    rollouts (None: all), with a token after it: the n-gram drafter's lookup into earlier
    rollouts, in time independent of how many there are. Occurrences are kept oldest first, so
    the newest is the last and evicting a rollout pops from the front."""

    def __init__(self, min_n: int, max_n: int, max_history: int | None):
        self.min_n, self.max_n, self.max_history = min_n, max_n, max_history
        self.rollouts: deque[list[int]] = deque()
        self.first = 0  # serial number of rollouts[0]
        self.where: dict[tuple[int, ...], deque[tuple[int, int]]] = {}

    def _grams(self, tokens: list[int]):
        for i in range(len(tokens) - 1):  # an occurrence needs a token after it
            for n in range(self.min_n, min(self.max_n, len(tokens) - 1 - i) + 1):
                yield tuple(tokens[i : i + n]), i

    def add(self, tokens: list[int]) -> None:
        serial = self.first + len(self.rollouts)
        self.rollouts.append(tokens)
        for gram, i in self._grams(tokens):
            self.where.setdefault(gram, deque()).append((serial, i))
        if self.max_history is not None and len(self.rollouts) > self.max_history:
            for gram, _ in self._grams(self.rollouts.popleft()):
                at = self.where[gram]
                at.popleft()
                if not at:
                    del self.where[gram]
            self.first += 1

    def continuation(self, pattern: list[int], k: int) -> list[int]:
        """Up to k tokens after the newest occurrence of `pattern` ([] if none)."""
        at = self.where.get(tuple(pattern))
        if not at:
            return []
        serial, i = at[-1]
        return self.rollouts[serial - self.first][i + len(pattern) : i + len(pattern) + k]


class HostDrafter:
    """What the n-gram and suffix drafters share: a memory of each prompt's earlier rollouts
    (`_past[prompt_id].rollouts`), handed to checkpoints as `history`, and chains of the
    tokens `draft_one` proposes for each row."""

    _past: dict

    def add_history(self, prompt_id: Hashable, tokens: list[int]) -> None:
        raise NotImplementedError

    def draft_one(self, seq: Seq, k: int) -> list[int]:
        raise NotImplementedError

    def begin(self, rows: list[Seq]) -> None:
        """Called with the running rows before they draft."""

    @property
    def history(self) -> dict[Hashable, list[list[int]]]:
        """The rollouts remembered, per prompt (what a checkpoint keeps)."""
        return {pid: list(memory.rollouts) for pid, memory in self._past.items()}

    @history.setter
    def history(self, value: dict[Hashable, list[list[int]]]) -> None:
        self._past = {}
        for pid, rollouts in value.items():
            for tokens in rollouts:
                self.add_history(pid, tokens)

    def propose(self, rows, k):
        self.begin(rows)
        b = len(rows)
        tokens = torch.zeros((b, k), dtype=torch.long)
        kr = torch.zeros(b, dtype=torch.long)
        for r, seq in enumerate(rows):
            d = self.draft_one(seq, k) if k > 0 else []
            if d:
                tokens[r, : len(d)] = torch.tensor(d)
                kr[r] = len(d)
        return tokens, None, kr


class _Counted:
    """A prompt's newest rollouts and the counts over them."""

    def __init__(self, depth: int):
        self.counts, self.rollouts = SuffixCounts(depth), deque()


class SuffixDrafter(HostDrafter):
    name = "suffix"

    def __init__(self, depth: int = 8, max_history: int = 64, min_confidence: float = 0.3):
        if depth < 1 or max_history < 1 or not 0.0 < min_confidence <= 1.0:
            raise ValueError("suffix drafter needs depth >= 1, max_history >= 1 and 0 < min_confidence <= 1")
        self.depth, self.max_history, self.min_confidence = depth, max_history, min_confidence
        self._past: dict[Hashable, _Counted] = {}
        self._rows: dict[int, tuple[Seq, SuffixCounts, list[int]]] = {}  # id(seq) -> (seq, counts, [indexed])

    def add_history(self, prompt_id: Hashable, tokens: list[int]) -> None:
        """An earlier rollout (prompt + response) of `prompt_id`; only the newest
        `max_history` per prompt are counted."""
        memory = self._past.get(prompt_id)
        if memory is None:
            memory = self._past[prompt_id] = _Counted(self.depth)
        tokens = list(tokens)
        memory.counts.add(tokens)
        memory.rollouts.append(tokens)
        if len(memory.rollouts) > self.max_history:
            memory.counts.add(memory.rollouts.popleft(), sign=-1)

    def _own(self, seq: Seq) -> SuffixCounts:
        """The row's own counts, brought up to its current tokens."""
        entry = self._rows.get(id(seq))
        if entry is None or entry[0] is not seq:
            entry = self._rows[id(seq)] = (seq, SuffixCounts(self.depth), [0])
        _, counts, indexed = entry
        counts.add(seq.tokens, start=indexed[0])
        indexed[0] = len(seq.tokens)
        return counts

    def draft_one(self, seq: Seq, k: int) -> list[int]:
        own = self._own(seq)
        past = self._counts_of(seq)
        context, out, confidence = list(seq.tokens), [], 1.0
        while len(out) < k:
            ranked = _ranked(own, past, context)
            if not ranked:
                break
            token, best = ranked[0]
            confidence *= best / sum(v for _, v in ranked)
            if confidence < self.min_confidence:
                break
            out.append(token)
            context.append(token)
        return out

    def propose_tree(self, rows, tree):
        """A draft tree per row (`tree_verify.DraftTree`): each node's children are the tokens
        that most often followed its context, in rank order (deterministic candidates); a node
        with fewer known continuations than children leaves the rest absent."""
        self.begin(rows)
        b = len(rows)
        tokens = torch.zeros((b, tree.n), dtype=torch.long)
        present = torch.zeros((b, tree.n), dtype=torch.bool)
        for r, seq in enumerate(rows):
            own = self._own(seq)
            past = self._counts_of(seq)
            context = {-1: list(seq.tokens)}
            for node in [-1, *range(tree.n)]:
                kids = tree.children(node)
                if not kids or node not in context:
                    continue
                for j, (token, _) in zip(kids, _ranked(own, past, context[node])):
                    tokens[r, j], present[r, j] = token, True
                    context[j] = context[node] + [token]
        return tokens, None, present

    def _counts_of(self, seq: Seq) -> SuffixCounts | None:
        memory = self._past.get(seq.prompt_id) if seq.prompt_id is not None else None
        return None if memory is None else memory.counts

    def begin(self, rows) -> None:
        live = {id(s) for s in rows}
        for key in [key for key in self._rows if key not in live]:  # rows that left
            del self._rows[key]


def _ranked(own: SuffixCounts, past: SuffixCounts | None, context: list[int]) -> list[tuple[int, int]]:
    """The tokens that followed the longest suffix of `context` either index has seen, most
    frequent first (ties: the lower id), with their counts; at equal match lengths both
    indexes' counts add up."""
    n_own, c_own = own.longest(context)
    n_past, c_past = past.longest(context) if past is not None else (0, None)
    if n_own == n_past == 0:
        return []
    counts = dict(c_own if n_own >= n_past else c_past)
    if n_own == n_past:
        for t, v in c_past.items():
            counts[t] = counts.get(t, 0) + v
    return sorted(counts.items(), key=lambda tv: (-tv[1], tv[0]))
