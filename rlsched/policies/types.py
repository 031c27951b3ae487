"""The seams shared by the simulator and the real executor.

A policy sees only what is defined here (EngineState, StepOutcome, InstanceView, a CostModel)
and never the simulator's or the executor's internals, so the very same policy object runs
in both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

from rlsched.policies.tree import max_nodes

if TYPE_CHECKING:
    from rlsched.policies.acceptance import AcceptanceEstimator


@dataclass(frozen=True, slots=True)
class Strategy:
    """What one engine step does: plain decoding (`drafter=None`) or drafts from a named
    drafter: a chain of `k` tokens (width 1), or a tree `k` levels deep whose drafter forwards
    extend each branch by its `width` likeliest tokens, of which the best `nodes` go to the
    target (SGLang's steps, topk and num_draft_tokens - 1; `policies/tree.py`). `nodes` 0
    means all k x width.

    `k_per_row`, when given, is each running sequence's own draft length (aligned with the
    EngineState's sample_ids; 0 drafts nothing for that row) and `k` is their maximum: the
    verify step is ragged, sequences that draft more cost more."""

    drafter: str | None = None
    k: int = 0
    width: int = 1
    nodes: int = 0
    k_per_row: np.ndarray | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if (self.drafter is None) != (self.k == 0):
            raise ValueError("a strategy drafts k >= 1 tokens with a drafter, or is off (no drafter, k = 0)")
        if self.k < 0 or self.width < 1:
            raise ValueError("k must be >= 0 and width >= 1")
        if self.nodes == 0:
            object.__setattr__(self, "nodes", self.k * self.width)
        elif not self.k <= self.nodes <= max_nodes(self.k, self.width):
            raise ValueError(
                f"a tree of depth {self.k} and width {self.width} verifies {self.k} to "
                f"{max_nodes(self.k, self.width)} nodes, not {self.nodes}; a chain verifies k"
            )
        if self.k_per_row is not None and (self.width != 1 or int(self.k_per_row.max(initial=0)) != self.k):
            raise ValueError("per-sequence draft lengths are chains whose maximum is k")

    def row_lengths(self, room, k_max: int) -> np.ndarray:
        """Each row's draft length: `k` (or `k_per_row`), at most the row's `room` (the drafts
        it could still keep) and `k_max`; 0 for every row when off. A tree drafts its `k`
        levels on every row."""
        n = len(room)
        if self.is_off:
            return np.zeros(n, dtype=np.int64)
        if self.is_tree:
            return np.full(n, self.k, dtype=np.int64)
        want = (
            np.asarray(self.k_per_row, dtype=np.int64)
            if self.k_per_row is not None
            else np.full(n, self.k, dtype=np.int64)
        )
        return np.clip(np.minimum(want, np.minimum(np.asarray(room, dtype=np.int64), k_max)), 0, None)

    @property
    def is_tree(self) -> bool:
        return self.width > 1

    @property
    def drafted_per_row(self) -> float:
        """Mean draft tokens the target verifies per sequence."""
        return float(self.k_per_row.mean()) if self.k_per_row is not None else float(self.nodes)

    @property
    def is_off(self) -> bool:
        return self.drafter is None

    @property
    def tokens_per_row(self) -> float:
        """Tokens the target verifies per sequence (mean): the last token plus the draft."""
        return 1 + self.drafted_per_row

    @property
    def label(self) -> str:
        if self.is_off:
            return "off"
        if self.k_per_row is not None:
            return f"{self.drafter}:~{self.drafted_per_row:.1f}"
        return f"{self.drafter}:{self.k}" + (f"x{self.width}:{self.nodes}" if self.is_tree else "")


OFF = Strategy()


@dataclass(slots=True)
class EngineState:
    """What a DraftPolicy sees before a step of one instance."""

    instance: int
    step: int
    time: float  # seconds since the rollout began
    sample_ids: np.ndarray  # running sequences (ids are unique within a rollout)
    ctx_lens: np.ndarray  # context length of each running sequence
    ctx_tokens: int  # sum of ctx_lens
    waiting: int  # sequences queued on this instance, not yet running
    kv_free_tokens: int
    acceptance: AcceptanceEstimator

    @property
    def batch(self) -> int:
        return len(self.sample_ids)

    def accept_est(self, drafter: str) -> np.ndarray:
        """Estimated per-token acceptance of `drafter` for each running sequence."""
        return self.acceptance.estimates(drafter, self.sample_ids)


@dataclass(slots=True)
class StepOutcome:
    """What happened in one engine step; policies learn from it."""

    instance: int
    step: int
    strategy: Strategy
    batch: int
    drafted: int  # draft tokens proposed, all sequences
    accepted: int  # draft tokens accepted, all sequences
    emitted: int  # tokens appended, all sequences (accepted + bonus, capped by what was left)
    step_time: float  # seconds
    draft_time: float
    verify_time: float
    sample_ids: np.ndarray | None = None
    accepted_per_row: np.ndarray | None = None
    catch_up: int = 0  # tokens the drafter took in beyond a steady step's 1-2 a row (a row that
    # just joined, or drafting back on after off steps): its draft_time then holds a prefill


@runtime_checkable
class CostModel(Protocol):
    """Seconds for the pieces of an engine step. `q` and `k` may be numpy arrays, so that a
    policy prices every draft length at once. `ctx_tokens` is the sum of the batch's contexts.
    The analytic roofline and fitted models (from measured profiles) both implement it."""

    def verify_time(self, batch: int, q, ctx_tokens): ...

    def draft_time(self, drafter: str, batch: int, k, ctx_tokens, width: int = 1): ...

    def draft_time_per_row(self, drafter: str, ks: np.ndarray, ctx_tokens): ...

    def prefill_time(self, n_tokens: int, sum_sq_tokens: int | None = None) -> float: ...

    def drafter_prefill_time(self, drafter: str, n_tokens: int, sum_sq_tokens: int | None = None) -> float: ...

    def kv_transfer_time(self, ctx_tokens: int, n_seqs: int) -> float: ...


NEVER_CHANGES = 1 << 30  # steady_steps of a policy whose choice never changes


class DraftPolicy(Protocol):
    """Picks each step's Strategy. Optional attributes let an engine skip work a policy does
    not need: `needs_acceptance = False` (no estimator updates), `observes = False` (no
    StepOutcomes), and `steady_steps(state, strategy, max_growth) -> int`: how many further
    steps `choose` is guaranteed to return the same strategy while the batch keeps its
    sequences and its context grows by at most `max_growth` tokens a step (0 if unknown)."""

    name: str

    def choose(self, state: EngineState) -> Strategy: ...

    def observe(self, outcome: StepOutcome) -> None: ...


@dataclass(slots=True)
class InstanceView:
    """What a ReallocPolicy sees of one instance at an event."""

    instance: int
    running_ids: np.ndarray
    running_ctx: np.ndarray
    running_remaining_hint: np.ndarray | None  # only where known (the simulator's oracle); else None
    waiting_ids: Sequence[int]
    kv_free_tokens: int
    max_batch: int

    @property
    def load(self) -> int:
        return len(self.running_ids) + len(self.waiting_ids)


@dataclass(frozen=True, slots=True)
class Migration:
    """Move these sequences from `src` to `dst`. `mode` is 'kv' (ship the KV cache),
    'reprefill' (ship tokens, recompute), or 'auto' (the cheaper by the cost model)."""

    src: int
    dst: int
    sample_ids: tuple[int, ...]
    mode: str = "auto"


@dataclass(slots=True)
class ReallocEvent:
    kind: str  # 'finished' (sequences ended), 'drained' (running + queued below threshold) or 'idle'
    instance: int
    time: float
    views: list[InstanceView] = field(default_factory=list)


class ReallocPolicy(Protocol):
    name: str

    def on_event(self, event: ReallocEvent, cost: CostModel) -> list[Migration]: ...
