"""Measured step costs of a model (and its drafters) over batch size x draft length x context.

Each point times what the rollout engine runs: a prefill of B prompts, the
speculative `step` (target forward over k+1 tokens per row, verification, sampling) and the
drafters' `propose` of k tokens, with the cache rolled back after each timing so the context
stays put. As the engine runs them, each drafter's propose and the verify are timed in turn
(`_timed_in_turn`), and every row feeds the drafter two tokens (the last draft and the
bonus token, as after a full acceptance): timed back to back with one-token feeds, drafting
is priced well under what it costs in real runs. From two rows on, the rows' contexts
differ (spread over half to one and a half times the point's context, `ragged_lengths`), as
the engine's rows do: rows of different lengths take the masked attention path, dearer a
step, and a profile of equal rows prices plain decoding at large batch sizes low against
speculation, so that `goodput` would keep SD off there where it pays (the fit's forms carry
the jump from one row to two: `costs/costfile.py`). Prefill is timed on prompts of one
length (its form counts tokens and token pairs), and so is each model drafter's feed of them
(kind = feed): what a drafter pays, inside its next propose, to take in a row that joined, or
the tokens of steps decoded without it. A point's price is the median of its timed runs
(`typical_ms`). Records use the STEP trace schema (kind = prefill | feed | verify | draft;
`k` = draft length, 0 for plain decoding; `ctx_tokens` = the batch's total context), so a profile reads like a trace and
feeds `MeasuredCostModel` and the analysis layer's fits.
"""

from __future__ import annotations

import functools
import time

import numpy as np
import pandas as pd
import torch

from rlsched.executor.decode.sampling import SamplingParams
from rlsched.executor.decode.speculative import Seq, prefill, step


def _nothing() -> None:
    pass


def _timed(fn, repeats: int, sync=lambda: None) -> list[float]:
    """Wall-clock milliseconds of `repeats` runs of `fn()`, after one warm-up (`sync` waits
    for queued GPU work)."""
    return _timed_in_turn({"": fn}, repeats, sync)[""]


def _timed_in_turn(fns: dict, repeats: int, sync=lambda: None, before: dict | None = None) -> dict:
    """`_timed` of several functions called in turn, as the engine calls them (each drafter's
    propose, then the verify): each then starts with what the one before left in the CPU's
    caches. Timed alone, back to back, drafting costs well under what it does alternating with
    verification, and real runs pay the latter. `before[name]`, if given, runs untimed before
    each call of fns[name] (what the engine did in between)."""
    before = before or {}
    for name, fn in fns.items():
        before.get(name, _nothing)()
        fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            before.get(name, _nothing)()
            sync()
            t = time.perf_counter()
            fn()
            sync()
            times[name].append((time.perf_counter() - t) * 1e3)
    return times


def typical_ms(times: list[float]) -> float:
    """A point's price: the median of its timed runs, not the fastest. Runs pay the typical
    step: engine-style steps (real drafts, the contexts growing) cost about the median price
    and clearly more than the fastest run's, whatever k. The median of runs taken in several
    passes minutes apart also keeps one disturbed run from moving a point."""
    return float(np.median(times))


STATISTICS = {"median": typical_ms, "min": lambda times: float(np.min(times))}  # `rlsched profile --statistic`


def profile_cache_len(contexts, k_max: int) -> int:
    """Cache rows a profile needs: the longest row's context (`ragged_lengths`), k_max + 1
    tokens verified or fed, and slack."""
    return max(contexts) * 3 // 2 + 2 * k_max + 8


def ragged_lengths(b: int, ctx: int) -> list[int]:
    """Contexts of b rows averaging ctx, spread evenly over ctx/2..3ctx/2 (one row: ctx)."""
    if b == 1:
        return [ctx]
    lens = [round(ctx / 2 + ctx * i / (b - 1)) for i in range(b)]
    lens[-1] += b * ctx - sum(lens)
    return lens


def _record(
    kind: str,
    batch: int,
    k: int,
    ctx: int,
    runs_ms: list[float],
    drafter: str = "",
    width: int = 1,
    drafted: int | None = None,
) -> dict:
    """A STEP-schema record of one point; its times are set from `runs_ms` (the timed runs,
    merged over passes) by `profile`."""
    return dict(
        rl_step=0,
        instance=0,
        step=0,
        time_s=0.0,
        kind=kind,
        batch=batch,
        drafter=drafter,
        k=k,
        width=width,
        drafted=batch * k if drafted is None else drafted,
        accepted=0,
        emitted=0,
        draft_ms=0.0,
        verify_ms=0.0,
        step_ms=0.0,
        ctx_tokens=ctx,
        runs_ms=list(runs_ms),
    )


def profile_trees(drafters: dict, k_max: int, width_max: int) -> dict:
    """(drafter, k, width) -> the `DraftTree` the engine verifies for `tree:k:width:n` with
    n = min(k * width, k_max) (the shape the policies build, `PolicyContext.tree`), for each
    drafter that drafts trees and width 2..width_max."""
    from rlsched.executor.decode.tree_verify import DraftTree
    from rlsched.policies.draft import PolicyContext
    from rlsched.policies.types import Strategy

    out = {}
    for name, d in drafters.items():
        if not hasattr(d, "propose_tree"):
            continue
        ctx = PolicyContext(cost=None, drafters=(name,))
        for w in range(2, width_max + 1):
            for k in range(1, k_max + 1):
                out[name, k, w] = DraftTree.from_shape(ctx.tree(name, Strategy(name, k, w, min(k * w, k_max))))
    return out


def profile(
    model,
    drafters: dict,
    *,
    batch_sizes=(1, 2, 4, 8, 16, 32, 64),
    k_max: int = 6,
    contexts=(64, 192),
    repeats: int = 5,
    passes: int = 1,
    sampling: SamplingParams | None = None,
    seed: int = 0,
    progress=None,
    statistic=typical_ms,
    width_max: int = 1,
) -> list[dict]:
    """`_profile_pass` `passes` times over the whole grid with repeats / passes timed runs per
    point; a point's price is `statistic` of all its runs (`typical_ms`: their median). A
    disturbance on a shared machine lasts seconds, so runs taken minutes apart sample the
    machine's states better than back-to-back ones. With `width_max` > 1 the drafters that
    draft trees are also timed drafting trees of each width 2..width_max and depth 1..k_max
    (draft records of that `width`)."""
    passes = max(1, min(passes, repeats))
    per_pass = -(-repeats // passes)
    prefill_only = prefill_midpoints(contexts)
    points: dict[tuple, dict] = {}
    for i in range(passes):
        pass_progress = (
            None if progress is None else (lambda n, total, b, c, i=i: progress(i * total + n, passes * total, b, c))
        )
        for r in _profile_pass(
            model,
            drafters,
            batch_sizes=batch_sizes,
            k_max=k_max,
            contexts=contexts,
            prefill_only=prefill_only,
            repeats=per_pass,
            sampling=sampling,
            seed=seed,
            progress=pass_progress,
            width_max=width_max,
        ):
            key = (r["kind"], r["batch"], r["k"], r["ctx_tokens"], r["drafter"], r["width"])
            if key in points:
                points[key]["runs_ms"] += r["runs_ms"]
            else:
                points[key] = r
    out = []
    for r in points.values():
        ms = statistic(r.pop("runs_ms"))
        field = {"draft": "draft_ms", "verify": "verify_ms"}.get(r["kind"])
        if field:
            r[field] = ms
        r["step_ms"] = ms
        out.append(r)
    return out


def prefill_midpoints(contexts) -> tuple[int, ...]:
    """Contexts timed for prefill only, midway between consecutive profiled ones: prefill is one
    point per (batch, context), so a two-context grid holds too few points to fit its cache-spill
    bend once the held-out batch sizes are left out (and a prefill costs little to time)."""
    cs = sorted(set(contexts))
    return tuple(m for a, b in zip(cs, cs[1:]) if (m := (a + b) // 2) not in cs)


@torch.inference_mode()
def _profile_pass(
    model,
    drafters: dict,
    *,
    batch_sizes,
    k_max: int,
    contexts,
    repeats: int,
    sampling: SamplingParams | None,
    seed: int,
    progress,
    prefill_only=(),
    width_max: int = 1,
) -> list[dict]:
    """Step-time records for every (batch, context) point: one prefill (and each model
    drafter's feed of the same prompts: its catch-up on rows that join), verify for
    k = 0..k_max, and each drafter's propose for k = 1..k_max; at `prefill_only` contexts the
    prefills alone. `drafters`: name -> drafter (its cache, if any, must hold max(batch_sizes)
    rows of `profile_cache_len(contexts, k_max)`). Under inference mode, as the engine
    runs: under `no_grad` (every op tracking views and versions) a plain step is priced above
    what the engine pays, most at small batch sizes."""
    timer = _PointTimer(model, drafters, k_max, repeats, sampling or SamplingParams(temperature=1.0), seed, width_max)
    records = []
    points = [(b, c) for c in sorted({*contexts, *prefill_only}) for b in batch_sizes]
    for n, (b, ctx) in enumerate(points):
        cache = model.new_cache(b, profile_cache_len([ctx], k_max))
        records += timer.prefills(cache, b, ctx)
        if ctx in contexts:
            records += timer.steps(cache, b, ctx)
        if progress is not None:
            progress(n + 1, len(points), b, ctx)
    return records


class _PointTimer:
    """Times one (batch, context) point of a pass at a time; the pass's random prompts and
    drafts come from one host generator, its sampling from one on the model's device."""

    def __init__(self, model, drafters: dict, k_max: int, repeats: int, sampling, seed: int, width_max: int):
        self.model, self.drafters, self.k_max, self.repeats = model, drafters, k_max, repeats
        self.sampling, self.width_max = sampling, width_max
        self.trees = profile_trees(drafters, k_max, width_max)
        self.vocab = model.config.vocab_size
        self.gen = torch.Generator().manual_seed(seed)  # the random prompts and drafts (host)
        device = next(model.parameters()).device
        self.step_gen = torch.Generator(device=device).manual_seed(seed)  # sampling, on the model's device
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def prefills(self, cache, b: int, ctx: int) -> list[dict]:
        """A prefill of b prompts of ctx tokens, and each model drafter's feed of the same
        prompts: its catch-up on rows that join."""
        slots = torch.arange(b)
        equal = torch.randint(3, self.vocab, (b, ctx), generator=self.gen).tolist()
        times = max(1, self.repeats // 2)

        def do_prefill():
            cache.free(slots)
            return prefill(self.model, cache, slots, equal)

        records = [_record("prefill", b, 0, b * ctx, _timed(do_prefill, times, self.sync))]
        for name, drafter in self.drafters.items():
            # a model drafter: its catch-up on fresh rows (a drafter that reads the target's
            # states is handed them with each step's and the prefill's forward: nothing to catch up)
            if hasattr(drafter, "reset") and not hasattr(drafter, "observe"):
                fresh = [Seq(list(p), i, i) for i, p in enumerate(equal)]

                def do_feed(drafter=drafter, fresh=fresh):
                    drafter.reset()
                    drafter.propose(fresh, 1)

                records.append(_record("feed", b, 0, b * ctx, _timed(do_feed, times, self.sync), drafter=name))
        return records

    def steps(self, cache, b: int, ctx: int) -> list[dict]:
        """Verify for k = 0..k_max and each drafter's propose for k = 1..k_max, on b rows of
        ragged contexts around ctx (`ragged_lengths`)."""
        slots = torch.arange(b)
        prompts = [torch.randint(3, self.vocab, (n,), generator=self.gen).tolist() for n in ragged_lengths(b, ctx)]
        cache.free(slots)
        last = prefill(self.model, cache, slots, prompts)
        lengths = cache.lengths[slots].clone()
        seqs = {name: [Seq(list(p), i, i) for i, p in enumerate(prompts)] for name in self.drafters}
        for name, drafter in self.drafters.items():
            if hasattr(drafter, "reset"):
                drafter.reset()
            drafter.propose(seqs[name], 1)  # take the prompts in
        records = []
        for k in range(self.k_max + 1):
            records += self._step(cache, slots, last, lengths, prompts, seqs, b, ctx, k)
        for drafter in self.drafters.values():
            if hasattr(drafter, "reset"):
                drafter.reset()
        return records

    def _step(self, cache, slots, last, lengths, prompts, seqs: dict, b: int, ctx: int, k: int) -> list[dict]:
        """One draft length: the verify, each drafter's chain and tree drafts, timed in turn."""
        vocab, gen = self.vocab, self.gen
        drafts = torch.randint(3, vocab, (b, k), generator=gen)
        dk = torch.full((b,), k, dtype=torch.long)

        def do_verify():
            step(
                self.model,
                cache,
                slots,
                last,
                self.sampling,
                drafts if k else None,
                None,
                dk if k else None,
                self.step_gen,
            )
            cache.trim(slots, lengths)

        def new_tokens(drafter, rows):
            """The last draft and the bonus token after each row's prompt (a model drafter
            takes them in inside its propose, timed; one that reads the target's states
            is handed theirs by the engine, here untimed: `prepare`)."""
            if hasattr(drafter, "rewind"):
                drafter.rewind(rows, [len(p) for p in prompts])
            for s, p in zip(rows, prompts):
                s.tokens = p + torch.randint(3, vocab, (2,), generator=gen).tolist()
            if hasattr(drafter, "prepare"):
                drafter.prepare(rows)

        def do_draft(drafter, rows):
            drafter.propose(rows, k)

        def do_tree(drafter, rows, tree):
            drafter.propose_tree(rows, tree)

        # plain decoding runs the target alone; a speculative step drafts, then verifies
        fns, before, tree_of = {}, {}, {}
        if k:
            for name, d in self.drafters.items():
                fns[name] = functools.partial(do_draft, d, seqs[name])
                before[name] = functools.partial(new_tokens, d, seqs[name])
                for w in range(2, self.width_max + 1):
                    if (name, k, w) in self.trees:
                        key = f"{name} width {w}"
                        tree_of[key] = (name, w, self.trees[name, k, w])
                        fns[key] = functools.partial(do_tree, d, seqs[name], self.trees[name, k, w])
                        before[key] = before[name]
        ms = _timed_in_turn({**fns, "": do_verify}, self.repeats, self.sync, before)
        records = [_record("verify", b, k, b * ctx, ms[""])]
        records += [_record("draft", b, k, b * ctx, ms[name], drafter=name) for name in fns if name in self.drafters]
        records += [
            _record("draft", b, k, b * ctx, ms[key], drafter=name, width=w, drafted=b * tree.n)
            for key, (name, w, tree) in tree_of.items()
        ]
        return records


def policy_profile(
    model,
    drafter,
    *,
    policy: str,
    max_batch: int,
    k_max: int,
    typical_ctx: int,
    sampling: SamplingParams,
    seed: int = 0,
    log=None,
    width_max: int = 1,
) -> pd.DataFrame:
    """A short profile (a few seconds) for a policy that prices steps: batch sizes up to
    max_batch, k 0..k_max (and trees up to `width_max` wide), one context (the workload's
    typical one), 3 repeats."""
    sizes = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b < max_batch] + [max_batch]
    if log:
        log(f"profiling step costs for the {policy} policy (batch 1..{max_batch}, k 0..{k_max})")
    drafters = {} if drafter is None else {drafter.name: drafter}
    return pd.DataFrame(
        profile(
            model,
            drafters,
            batch_sizes=sizes,
            k_max=k_max,
            contexts=(max(8, typical_ctx),),
            repeats=3,
            sampling=sampling,
            seed=seed,
            width_max=width_max,
        )
    )
