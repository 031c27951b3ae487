"""One acceptance estimator shared by every policy that needs it.

A chain step with k drafts is a run of Bernoulli trials that stops at the first rejection:
`n` accepted means n successes and, when n < k, one failure. So a Beta posterior per sample
is exact. Samples are shrunk towards their prompt (RL draws each prompt G times) and prompts
towards the drafter's running mean, which forgets slowly so that drift is followed.
"""

from __future__ import annotations

import numpy as np


class _DrafterStats:
    __slots__ = ("succ", "fail", "r_succ", "r_fail", "p_succ", "p_fail", "p_mean", "g_succ", "g_n", "stale")

    def __init__(self, n_samples: int, n_prompts: int, g_succ: float, g_n: float, recent: bool):
        self.succ = np.zeros(n_samples)
        self.fail = np.zeros(n_samples)
        # the same counts forgetting step by step (`sample_decay`), or the same arrays
        self.r_succ = np.zeros(n_samples) if recent else self.succ
        self.r_fail = np.zeros(n_samples) if recent else self.fail
        self.p_succ = np.zeros(n_prompts)
        self.p_fail = np.zeros(n_prompts)
        self.p_mean = np.zeros(n_prompts)
        self.g_succ, self.g_n = g_succ, g_n
        self.stale = 0


class AcceptanceEstimator:
    """Per-sample, per-prompt and per-drafter estimates of per-token acceptance."""

    def __init__(
        self,
        drafters,
        prior_mean: float = 0.6,
        prior_strength: float = 20.0,
        prompt_strength: float = 4.0,
        sample_strength: float = 4.0,
        decay: float = 0.999,
        sample_decay: float = 1.0,
    ):
        """sample_decay: the weight a sample's own trials keep from one of its steps to the
        next, for its estimate (its prompt gets every trial at full weight when it finishes).
        Below 1 the estimate follows acceptance that changes along a response (a drafter that
        falls behind in long answers, say). On the built-in task acceptance changes little
        along an answer, so the engine keeps 1.0 (`engine.SAMPLE_DECAY`)."""
        if not 0.0 < sample_decay <= 1.0:
            raise ValueError(f"sample_decay must be in (0, 1], got {sample_decay}")
        self.sample_decay = sample_decay
        self.drafters = list(drafters)
        self.prior_mean, self.prior_strength = prior_mean, prior_strength
        self.prompt_strength, self.sample_strength, self.decay = prompt_strength, sample_strength, decay
        self._stats: dict[str, _DrafterStats] = {}
        self._pending: dict = {}  # (id(ids), drafter) -> [ids, drafter, succ, fail, steps], not yet applied
        self.prompt_of = np.zeros(0, dtype=np.int64)
        self.begin_rollout(0, self.prompt_of)

    def begin_rollout(self, n_samples: int, prompt_of: np.ndarray) -> None:
        """Fresh per-sample and per-prompt counts; the drafters' running means carry over."""
        self._flush()
        self.prompt_of = np.asarray(prompt_of, dtype=np.int64)
        n_prompts = int(self.prompt_of.max()) + 1 if len(self.prompt_of) else 0
        old = self._stats
        self._stats = {}
        for d in self.drafters:
            g_succ, g_n = (old[d].g_succ, old[d].g_n) if d in old else (0.0, 0.0)
            self._stats[d] = _DrafterStats(n_samples, n_prompts, g_succ, g_n, self.sample_decay < 1.0)
            self._refresh_prompts(self._stats[d])

    def add_samples(self, prompt_of: np.ndarray) -> None:
        """More samples join the rollout (a server's requests as they arrive), of these
        prompts (ids dense from 0, new ones one past the highest so far)."""
        self._flush()
        new = np.asarray(prompt_of, dtype=np.int64)
        self.prompt_of = np.concatenate([self.prompt_of, new])
        n_prompts = int(self.prompt_of.max()) + 1 if len(self.prompt_of) else 0
        for s in self._stats.values():
            grow, more = len(new), n_prompts - len(s.p_succ)
            recent = s.r_succ is not s.succ
            s.succ, s.fail = np.pad(s.succ, (0, grow)), np.pad(s.fail, (0, grow))
            s.r_succ = np.pad(s.r_succ, (0, grow)) if recent else s.succ
            s.r_fail = np.pad(s.r_fail, (0, grow)) if recent else s.fail
            s.p_succ, s.p_fail, s.p_mean = (np.pad(a, (0, max(more, 0))) for a in (s.p_succ, s.p_fail, s.p_mean))
            self._refresh_prompts(s)

    def mean(self, drafter: str) -> float:
        self._flush()
        s = self._stats[drafter]
        return (self.prior_mean * self.prior_strength + s.g_succ) / (self.prior_strength + s.g_n)

    def _refresh_prompts(self, s: _DrafterStats) -> None:
        g = (self.prior_mean * self.prior_strength + s.g_succ) / (self.prior_strength + s.g_n)
        s.p_mean = (g * self.prompt_strength + s.p_succ) / (self.prompt_strength + s.p_succ + s.p_fail)
        s.stale = 0

    def from_trials(self, accepted, rejected):
        """A sample's per-token acceptance from its own chain trials (`accepted` drafts kept,
        `rejected` chains stopped short), shrunk towards the prior with the sample strength:
        what both engines write of a finished sample whose acceptance no estimator followed."""
        return (accepted + self.prior_mean * self.sample_strength) / (accepted + rejected + self.sample_strength)

    def estimates(self, drafter: str, ids: np.ndarray, whole: bool = False) -> np.ndarray:
        """Each sample's acceptance: from its recent steps (`sample_decay`), or with `whole` from
        all of them (what a trace records of a finished sample: its mean, which the simulator
        replays)."""
        entry = self._pending.pop((id(ids), drafter), None)
        if entry is not None:
            self._apply(*entry)
        s = self._stats[drafter]
        if s.stale >= 64:
            self._refresh_prompts(s)
        prior = s.p_mean[self.prompt_of[ids]]
        succ, fail = (s.succ[ids], s.fail[ids]) if whole else (s.r_succ[ids], s.r_fail[ids])
        return (prior * self.sample_strength + succ) / (self.sample_strength + succ + fail)

    def update(self, drafter: str, ids: np.ndarray, accepted: np.ndarray, k) -> None:
        """Record a chain step: `accepted[i]` of `k` (or `k[i]`) drafts accepted for sample `ids[i]`.

        Steps over the same batch (the same `ids` array object, one per engine between batch
        changes) are summed and applied when that batch is read or retired (`retire`) or any
        sample finishes, so an engine pays two array ops per step, not a scatter. `ids` must
        not be modified in place afterwards (engines replace their id array when the batch
        changes, and retire the old one)."""
        self.update_trials(drafter, ids, accepted, (accepted < k).astype(np.int64))

    def update_trials(self, drafter: str, ids: np.ndarray, hits: np.ndarray, misses: np.ndarray) -> None:
        """Record one step's Bernoulli trials of the drafter's first choice per sample: a chain's
        accepted drafts and its rejection, or what a tree's accepted path showed of rank 1
        (`policies/tree.draw_tree`). Pending as `update` says."""
        key = (id(ids), drafter)
        p = self._pending.get(key)
        fail = np.array(misses, dtype=np.int64)
        if p is None:
            recent = [hits.astype(float), fail.astype(float)] if self.sample_decay < 1.0 else [None, None]
            self._pending[key] = [ids, drafter, hits.astype(np.int64), fail, 1, *recent]
            return
        p[2] += hits
        p[3] += fail
        p[4] += 1
        if p[5] is not None:  # the steps pending forget as the applied ones do
            p[5] *= self.sample_decay
            p[5] += hits
            p[6] *= self.sample_decay
            p[6] += fail

    def retire(self, ids: np.ndarray) -> None:
        """An engine is about to replace this batch: apply what is pending for it."""
        for d in self.drafters:
            entry = self._pending.pop((id(ids), d), None)
            if entry is not None:
                self._apply(*entry)

    def update_many(self, drafter: str, ids: np.ndarray, accepted: np.ndarray, k: int) -> None:
        """Record several chain steps over the same batch: `accepted` is (steps, batch).
        Exactly the same as that many `update` calls, to the last bit (the decayed sums are
        accumulated step by step, as `update` does)."""
        key = (id(ids), drafter)
        fails = accepted < k
        p = self._pending.get(key)
        if p is None:
            self.update(drafter, ids, accepted[0], k)
            if len(accepted) > 1:
                self.update_many(drafter, ids, accepted[1:], k)
            return
        p[2] += accepted.sum(axis=0)
        p[3] += fails.sum(axis=0)
        p[4] += len(accepted)
        if p[5] is not None:  # the steps pending forget as the applied ones do
            for a, f in zip(accepted, fails):
                p[5] *= self.sample_decay
                p[5] += a
                p[6] *= self.sample_decay
                p[6] += f

    def _flush(self, entry=None) -> None:
        """Apply one pending entry, or (no argument) all of them."""
        if entry is not None:
            self._apply(*entry)
            return
        pending, self._pending = self._pending, {}
        for e in pending.values():
            self._apply(*e)

    def _apply(self, ids, drafter, succ, fail, steps, r_succ=None, r_fail=None) -> None:
        s = self._stats[drafter]
        if r_succ is not None:  # (the pending steps' own decayed sums: the older counts forget them all)
            keep = self.sample_decay**steps
            s.r_succ[ids] = keep * s.r_succ[ids] + r_succ
            s.r_fail[ids] = keep * s.r_fail[ids] + r_fail
        s.succ[ids] += succ
        s.fail[ids] += fail
        n_acc, n_fail = float(np.add.reduce(succ)), float(np.add.reduce(fail))
        decay = self.decay**steps
        s.g_succ = decay * s.g_succ + n_acc
        s.g_n = decay * s.g_n + n_acc + n_fail
        s.stale += steps

    def take_sample_counts(self, drafter: str, i: int) -> tuple[float, float]:
        """Sample i's own (accepted, rejected) trial counts, which it carries to another
        instance: they leave this estimator (a sample that comes back brings them again)."""
        self._flush()
        s = self._stats[drafter]
        out = float(s.succ[i]), float(s.fail[i])
        s.succ[i] = s.fail[i] = s.r_succ[i] = s.r_fail[i] = 0.0
        return out

    def add_sample_counts(self, drafter: str, i: int, succ: float, fail: float) -> None:
        """Sample i arrived from another instance with these trial counts."""
        s = self._stats[drafter]
        s.succ[i] += succ
        s.fail[i] += fail
        if s.r_succ is not s.succ:
            s.r_succ[i] += succ
            s.r_fail[i] += fail

    def finish(self, ids: np.ndarray) -> None:
        """Fold finished samples into their prompts' counts (their siblings gain from them)."""
        self._flush()
        prompts = self.prompt_of[ids]
        for s in self._stats.values():
            np.add.at(s.p_succ, prompts, s.succ[ids])
            np.add.at(s.p_fail, prompts, s.fail[ids])
            self._refresh_prompts(s)
