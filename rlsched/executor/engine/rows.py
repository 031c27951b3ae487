"""What rlsched's engine generates, row by row: requests, running rows and finished samples.

A request waits in the engine's queue until batch slots and KV room allow it to join (`Row`);
each step gives a row its new tokens (`append_tokens`); a finished row leaves as a
`SampleResult`. KV room is reserved per request (prompt + token budget, `reserve`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlsched.errors import UserError
from rlsched.executor.decode.speculative import Seq


@dataclass
class Request:
    """One sample to generate."""

    prompt: list[int]
    prompt_id: int
    sample_id: int
    max_new_tokens: int
    eos_id: int | None = None


@dataclass
class SampleResult:
    """A finished sample: its tokens, their target log-probs and how it went."""

    prompt_id: int
    sample_id: int
    tokens: list[int]
    logprobs: list[float]
    finish_s: float
    steps: int  # engine steps the sample took part in
    drafted: int
    accepted: int

    @property
    def mean_accept_len(self) -> float:
        """Tokens emitted per step of this sample (1.0 without speculation)."""
        return len(self.tokens) / self.steps if self.steps else 0.0


@dataclass
class RolloutResult:
    samples: list[SampleResult]  # in the order of the requests
    # tokens, seconds, tokens_per_s, steps, drafted, accepted, mean_accept_len
    stats: dict = field(default_factory=dict)


@dataclass
class Row:
    """A running sample: its request, its Seq (prompt + generated, as drafters see it), the
    dense rollout index, and what it has produced."""

    req: Request
    index: int
    seq: Seq
    last: int  # the last token, not yet in the target's cache
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    rejected: int = 0  # speculative steps that ended in a rejection (a chain's failed trial)
    migrations: int = 0  # times it moved to another instance
    done: bool = False

    @property
    def remaining(self) -> int:
        return self.req.max_new_tokens - len(self.tokens)


def reserve(r: Request) -> int:
    """KV tokens a request may occupy at most (a step writes no further than the budget)."""
    return len(r.prompt) + r.max_new_tokens


def kv_reserved(running: dict[int, Row]) -> int:
    """KV tokens the running rows reserve."""
    return sum(reserve(r.req) for r in running.values())


def check_requests(requests: list[Request], cache_capacity: int) -> None:
    """Refuse requests that are malformed or could never fit the KV budget."""
    for r in requests:
        if not r.prompt:
            raise UserError(f"sample {r.sample_id}: the prompt is empty")
        if r.max_new_tokens < 1:
            raise UserError(f"sample {r.sample_id}: max_new_tokens must be >= 1 (got {r.max_new_tokens})")
        if reserve(r) > cache_capacity:
            raise UserError(
                f"sample {r.sample_id}: prompt + max_new_tokens ({reserve(r)} tokens) exceed "
                f"the KV cache capacity ({cache_capacity}); raise cache_capacity or lower max_new_tokens"
            )


def append_tokens(rows: list[Row], out, dk, accepted) -> tuple[int, int]:
    """Give each row its new tokens (cut at its budget and at eos) and its chain trial; returns
    the tokens emitted and the rows whose chain stopped short (a rejection)."""
    all_tokens, all_lps = out.tokens.cpu().tolist(), out.logprobs.cpu().tolist()  # one conversion
    n_acc, n_draft = accepted.tolist(), dk.tolist()
    emitted = rejected = 0
    for r, row_toks, row_lps, a, d in zip(rows, all_tokens, all_lps, n_acc, n_draft):
        new = row_toks[: a + 1]
        toks, lps = new[: r.remaining], row_lps[: a + 1][: r.remaining]
        if r.req.eos_id is not None and r.req.eos_id in toks:
            cut = toks.index(r.req.eos_id) + 1
            toks, lps = toks[:cut], lps[:cut]
            r.done = True
        r.tokens.extend(toks)
        r.logprobs.extend(lps)
        r.seq.tokens.extend(new)
        r.last = new[-1]
        r.steps += 1
        r.drafted += d
        r.accepted += a
        r.rejected += a < d
        rejected += a < d
        r.done = r.done or r.remaining <= 0
        emitted += len(toks)
    return emitted, rejected


def summary(results: list[SampleResult], totals: dict, seconds: float) -> dict:
    """A rollout's stats from its samples and the engine's running totals."""
    tokens = sum(len(s.tokens) for s in results)
    return dict(
        samples=len(results),
        tokens=tokens,
        seconds=seconds,
        tokens_per_s=tokens / seconds if seconds > 0 else 0.0,
        steps=totals["steps"],
        drafted=totals["drafted"],
        accepted=totals["accepted"],
        rejected=totals["rejected"],
        sd_rows=totals["sd_rows"],
        mean_accept_len=totals["sd_emitted"] / totals["sd_rows"] if totals["sd_rows"] else 1.0,
        kv_peak_tokens=totals["kv_peak_tokens"],
        max_running=totals["max_running"],
        draft_s=totals.get("draft_s", 0.0),
    )
