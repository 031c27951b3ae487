"""The suffix drafter: counts kept up to date, drafts that follow the worn path and stop at forks."""

from __future__ import annotations

import random

from rlsched.executor.decode.speculative import Seq
from rlsched.executor.decode.suffix import SuffixCounts, SuffixDrafter


def test_counts_add_and_evict_exactly():
    c = SuffixCounts(depth=3)
    a, b = [1, 2, 3, 1, 2, 4], [5, 1, 2, 3]
    c.add(a)
    c.add(b)
    assert c.counts[(1, 2)] == {3: 2, 4: 1} and c.counts[(3, 1, 2)] == {4: 1}
    assert c.longest([9, 9, 1, 2]) == (2, {3: 2, 4: 1})
    c.add(a, sign=-1)
    c.add(b, sign=-1)
    assert c.counts == {} and len(c) == 0


def test_it_drafts_what_earlier_rollouts_of_the_prompt_say_and_stops_at_a_fork():
    d = SuffixDrafter(depth=4, min_confidence=0.5)
    past = [10, 11, 12, 13, 14, 15, 16, 17]
    for _ in range(3):
        d.add_history("p", past)
    d.add_history("p", [10, 11, 12, 13, 14, 99])  # a fork after 14: 15 three times of four
    seq = Seq(tokens=[10, 11, 12], slot=0, prompt_id="p")
    assert d.draft_one(seq, 8) == [13, 14, 15, 16, 17]  # 0.75 at the fork, then certain
    strict = SuffixDrafter(depth=4, min_confidence=0.8)
    for _ in range(3):
        strict.add_history("p", past)
    strict.add_history("p", [10, 11, 12, 13, 14, 99])
    assert strict.draft_one(Seq(tokens=[10, 11, 12], slot=0, prompt_id="p"), 8) == [13, 14]
    # another prompt's rollouts are not drafted from
    assert d.draft_one(Seq(tokens=[10, 11, 12], slot=1, prompt_id="q"), 8) == []


def test_it_drafts_from_the_row_itself_as_the_row_grows():
    d = SuffixDrafter(depth=3)
    seq = Seq(tokens=[1, 2, 3, 4, 1, 2], slot=0)
    assert d.draft_one(seq, 3) == [3, 4, 1]
    seq.tokens += [3, 4, 7, 1, 2]  # 1, 2 was followed by 3 twice, 3, 4 by 1 and 7 once each
    assert d.draft_one(seq, 1) == [3]
    tokens, probs, kr = d.propose([seq, Seq(tokens=[5], slot=1)], 2)
    assert probs is None and kr.tolist() == [2, 0] and tokens[0, :2].tolist() == [3, 4]


def test_memory_is_bounded_per_prompt():
    rng = random.Random(0)
    d = SuffixDrafter(depth=4, max_history=8)
    rollouts = [[rng.randrange(50) for _ in range(100)] for _ in range(40)]
    for r in rollouts:
        d.add_history("p", r)
    counts, kept = d._past["p"].counts, d._past["p"].rollouts
    assert len(kept) == 8
    fresh = SuffixCounts(4)
    for r in rollouts[-8:]:
        fresh.add(r)
    assert counts.counts == fresh.counts  # exactly the newest eight, the rest uncounted


def test_rows_that_leave_are_forgotten():
    d = SuffixDrafter()
    rows = [Seq(tokens=[1, 2, 1], slot=i) for i in range(3)]
    d.propose(rows, 2)
    assert len(d._rows) == 3
    d.propose(rows[:1], 2)
    assert len(d._rows) == 1


def test_history_round_trips_through_a_checkpoint():
    """`history` is what a checkpoint keeps (as for the n-gram drafter): set back, the drafts match."""
    import pickle

    d = SuffixDrafter(depth=3, max_history=2)
    for t in ([1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 4, 6]):
        d.add_history("p", t)
    again = SuffixDrafter(depth=3, max_history=2)
    again.history = pickle.loads(pickle.dumps(d.history))
    assert again.history == {"p": [[1, 2, 3, 5], [1, 2, 3, 4, 6]]}  # the newest two
    seq = Seq(tokens=[1, 2], slot=0, prompt_id="p")
    assert again.draft_one(seq, 4) == d.draft_one(Seq(tokens=[1, 2], slot=0, prompt_id="p"), 4)


def test_ngram_index_finds_what_a_scan_of_the_newest_rollouts_finds():
    """The index answers as scanning the newest `max_history` rollouts, newest first and the
    last occurrence in each, would: for every pattern, across evictions."""
    from rlsched.executor.decode.drafters import _find
    from rlsched.executor.decode.suffix import NgramIndex

    rng = random.Random(1)
    index = NgramIndex(1, 3, max_history=5)
    kept = []
    for _ in range(30):
        t = [rng.randrange(6) for _ in range(rng.randrange(1, 25))]
        index.add(t)
        kept = (kept + [t])[-5:]
        for _ in range(20):
            pattern = [rng.randrange(6) for _ in range(rng.randrange(1, 4))]
            scan = next((f for h in reversed(kept) if (f := _find(h, pattern, 4, len(h)))), [])
            assert index.continuation(pattern, 4) == scan, (pattern, kept)
    assert len(index.rollouts) == 5 and all(at for at in index.where.values())
