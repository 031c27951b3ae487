"""The lossless speculative step: verify k drafts per row in one target forward.

`verify` is the standard rule (Leviathan et al. 2023; Chen et al. 2023): draft x_i, drawn
from q_i, is accepted with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection the
emitted token is drawn from normalize(max(0, p_i - q_i)); when all k_b drafts of a row are
accepted a bonus token is drawn from p at position k_b. Every emitted token is then distributed
exactly as plain sampling from p (after the same temperature / top-k / top-p, see
`sampling.probs`). Deterministic drafts (n-gram) are q = one-hot, passed as `draft_probs=None`.
Greedy: accept while the draft equals the target's argmax, then emit the argmax.

Cache convention of `step`: each row's cache holds its context except the last token, which
is passed as `last`; one forward over [last, d_1..d_k] (ragged: n_new = k_b + 1) gives p at
k + 1 positions; afterwards the row keeps last + the accepted drafts (`KVCache.trim`), and the
newly emitted last token is fed by the next step. A plain decode step is the same with k = 0.
`tree_step` is the step of a draft tree (`tree_verify.py`), leaving the cache the same way.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch

from rlsched.executor.decode.sampling import SamplingParams, sample
from rlsched.executor.model.kvcache import KVCache

PAD = -1  # emitted-token padding


@dataclass
class Seq:
    tokens: list[int]  # prompt + generated so far (the last one not yet in the target's cache)
    slot: int  # KV cache row
    prompt_id: Hashable | None = None


@dataclass
class VerifyResult:
    accepted: torch.Tensor  # (B,) int64: drafts accepted per row
    tokens: torch.Tensor  # (B, K+1) int64: accepted drafts then the corrected/bonus token, PAD after
    logprobs: torch.Tensor  # (B, K+1) float32: log p(token) under the processed target distribution, 0 after

    @property
    def emitted(self) -> torch.Tensor:
        """(B,) tokens emitted per row: accepted + 1."""
        return self.accepted + 1

    def row_tokens(self, b: int) -> list[int]:
        return self.tokens[b, : int(self.accepted[b]) + 1].tolist()

    def row_logprobs(self, b: int) -> list[float]:
        return self.logprobs[b, : int(self.accepted[b]) + 1].tolist()


def _k_per_row(k_per_row, b: int, k: int, device) -> torch.Tensor:
    if k_per_row is None:
        return torch.full((b,), k, dtype=torch.long, device=device)
    kr = torch.as_tensor(k_per_row, dtype=torch.long, device=device).expand(b)
    if bool((kr < 0).any()) or bool((kr > k).any()):
        raise ValueError(f"k per row must lie in [0, {k}]")
    return kr


def verify(
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    k_per_row=None,
    generator: torch.Generator | None = None,
    *,
    greedy: bool = False,
) -> VerifyResult:
    """Accept or reject the drafts of every row at once.

    target_probs (B, K+1, V): p at each verified position (after `sampling.probs`);
    draft_tokens (B, K); draft_probs (B, K, V) the distributions the drafts were drawn from,
    or None for deterministic drafts (one-hot q); k_per_row (B,) how many drafts each row
    really has (the rest is padding, never accepted; default K). `greedy` uses exact match
    against the target's argmax and draws nothing."""
    b, k1, _ = target_probs.shape
    kr = _k_per_row(k_per_row, b, k1 - 1, target_probs.device)
    return _verify(target_probs, draft_tokens, draft_probs, kr, generator, greedy)


def _verify(
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    kr: torch.Tensor,
    generator: torch.Generator | None,
    greedy: bool,
) -> VerifyResult:
    """`verify` with k per row already checked (`_k_per_row`): `step` checks it once."""
    b, k1, v = target_probs.shape
    k = k1 - 1
    dev = target_probs.device
    if draft_tokens.shape != (b, k):
        raise ValueError(f"draft_tokens must have shape ({b}, {k}), got {tuple(draft_tokens.shape)}")
    if draft_probs is not None and draft_probs.shape != (b, k, v):
        raise ValueError(f"draft_probs must have shape ({b}, {k}, {v}), got {tuple(draft_probs.shape)}")
    drafts = draft_tokens.to(dev).long().clamp(0, v - 1)  # padding may hold anything
    pos = torch.arange(k, device=dev)
    valid = pos[None, :] < kr[:, None]
    rows = torch.arange(b, device=dev)

    if greedy:
        best = target_probs.argmax(-1)  # (B, K+1)
        ok = (drafts == best[:, :k]) & valid
    else:
        p_x = target_probs[:, :k].gather(-1, drafts[..., None])[..., 0]
        q_x = (
            torch.ones_like(p_x)
            if draft_probs is None
            else draft_probs.to(dev).float().gather(-1, drafts[..., None])[..., 0]
        )
        u = torch.rand((b, k), generator=generator, device=dev)
        ok = (u * q_x < p_x) & valid  # u < p/q without dividing; u < 1 so p >= q always accepts
    accepted = ok.cumprod(-1).sum(-1)  # drafts before the first rejection (int64)

    # The token after the accepted drafts: residual at a rejection, p itself for the bonus.
    p_at = target_probs[rows, accepted]  # (B, V)
    if greedy:
        last = best[rows, accepted]
    else:
        rejected = accepted < kr
        j = accepted.clamp(max=max(k - 1, 0))
        if k == 0:
            dist = p_at
        else:
            if draft_probs is None:
                q_at = torch.zeros_like(p_at).scatter_(-1, drafts[rows, j][:, None], 1.0)
            else:
                q_at = draft_probs.to(dev).float()[rows, j]
            residual = (p_at - q_at).clamp_min_(0.0)
            # `sample` draws i with probability dist_i / sum(dist), so the residual is not
            # normalised. A residual without mass (a rejection of probability 0, up to
            # rounding) falls back to p itself.
            dist = torch.where(rejected[:, None] & (residual.sum(-1, keepdim=True) > 0), residual, p_at)
        last = sample(dist, generator)

    tokens = torch.full((b, k + 1), PAD, dtype=torch.long, device=dev)
    keep = pos[None, :] < accepted[:, None]
    tokens[:, :k] = torch.where(keep, drafts, tokens[:, :k])
    tokens[rows, accepted] = last
    emitted = tokens != PAD
    lp = target_probs.gather(-1, tokens.clamp_min(0)[..., None])[..., 0].clamp_min(1e-45).log()
    logprobs = torch.where(emitted, lp, torch.zeros_like(lp))
    return VerifyResult(accepted, tokens, logprobs)


@torch.no_grad()
def prefill(
    model, cache: KVCache, slots, prompts: list[list[int]], max_tokens: int | None = -1, states: dict | None = None
) -> torch.Tensor:
    """Cache every prompt but its last token (ragged) in rows `slots`; returns the last
    tokens (B,), which the first step feeds. Prompts go in forwards of similar lengths
    (`length_groups`) of at most `max_tokens` padded tokens each (default
    `prefill_token_budget(model)`; None: no limit), a row at least. With a model that keeps
    states (`Transformer.capture`), `states` gets prompt i's (its tokens but the last)."""
    if any(len(p) < 1 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    dev = cache.lengths.device
    slots = torch.as_tensor(slots, dtype=torch.long, device=dev)
    cache.free(slots)
    if max_tokens == -1:
        max_tokens = prefill_token_budget(model)
    for group in length_groups([len(p) - 1 for p in prompts]):
        q = max(len(prompts[i]) - 1 for i in group)
        if q == 0:
            continue
        per = len(group) if max_tokens is None else max(1, max_tokens // q)
        for chunk in (group[j : j + per] for j in range(0, len(group), per)):
            n = [len(prompts[i]) - 1 for i in chunk]
            ids = torch.tensor([prompts[i][:-1] + [0] * (q - n_i) for i, n_i in zip(chunk, n)], device=dev)
            rows = slots if len(chunk) == len(prompts) else slots[torch.tensor(chunk, device=dev)]
            model(ids, cache, slots=rows, n_new=n)
            if states is not None and model.capture is not None:
                for j, (i, n_i) in enumerate(zip(chunk, n)):
                    states[i] = model.captured[j, :n_i]
    return torch.tensor([p[-1] for p in prompts], dtype=torch.long, device=dev)


PREFILL_ACTIVATION_BYTES = 16 << 20


def prefill_token_budget(model) -> int | None:
    """Most tokens one prefill forward takes on a CPU: its widest activation (gate and up,
    2 x intermediate values per token) within PREFILL_ACTIVATION_BYTES, about what the
    last-level cache holds: past it a token costs about twice as much. None (no limit) on a
    GPU, where larger forwards only pay better."""
    w = model.embed.weight
    if w.device.type != "cpu":
        return None
    return max(1, PREFILL_ACTIVATION_BYTES // (2 * model.config.intermediate_size * w.element_size()))


def length_groups(lengths: list[int], waste: float = 0.25, overhead: int = 64) -> list[list[int]]:
    """Indices of `lengths` in forwards of similar lengths: a padded forward computes every
    row to the longest, so one forward over prompts of very different lengths does several
    times the work it needs. Rows
    are taken longest first; a group closes when padding would pass `waste` of its tokens,
    unless it is still cheaper than a forward's fixed cost (`overhead` tokens' worth)."""
    if lengths and (max(lengths) - min(lengths)) * len(lengths) <= overhead:
        return [list(range(len(lengths)))]  # padding all to the longest costs less than a forward
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups, cur, total = [], [], 0
    for i in order:
        if cur:
            padded = lengths[cur[0]] * (len(cur) + 1)
            if padded - total - lengths[i] > max(waste * padded, overhead):
                groups.append(sorted(cur))  # in the caller's order within a group: slots ascending
                cur, total = [], 0
        cur.append(i)
        total += lengths[i]
    if cur:
        groups.append(sorted(cur))
    if len(groups) == 1:
        return [list(range(len(lengths)))]  # one forward in the caller's order (slots stay consecutive)
    return groups


@torch.no_grad()
def step(
    model,
    cache: KVCache,
    slots,
    last: torch.Tensor,
    sampling: SamplingParams,
    draft_tokens: torch.Tensor | None = None,
    draft_probs: torch.Tensor | None = None,
    k_per_row=None,
    generator: torch.Generator | None = None,
) -> VerifyResult:
    """One engine step: ONE target forward over [last, drafts] per row (n_new = k_b + 1),
    verification, and the cache trimmed to last + accepted drafts. Without drafts (or K = 0)
    it is a plain decode step. Every row needs K + 1 free cache positions (padding of rows
    with fewer drafts is written, then dropped)."""
    dev = cache.lengths.device
    slots = torch.as_tensor(slots, dtype=torch.long, device=dev)
    b = slots.shape[0]
    last = last.to(dev).long().view(b, 1)
    if draft_tokens is None:
        draft_tokens = torch.zeros((b, 0), dtype=torch.long, device=dev)
    k = draft_tokens.shape[1]
    if k == 0:  # plain decoding: sample, no verification machinery (a few ops, not dozens)
        logits = model(last, cache, slots=slots)
        p = sampling.probs(logits[:, 0])
        tok = p.argmax(-1) if sampling.greedy else sample(p, generator)
        lp = p.gather(-1, tok[:, None]).clamp_min(1e-45).log()
        return VerifyResult(torch.zeros(b, dtype=torch.long, device=dev), tok[:, None], lp)
    kr = _k_per_row(k_per_row, b, k, dev)
    drafts = draft_tokens.to(dev).long()
    ids = torch.cat([last, torch.where(torch.arange(k, device=dev) < kr[:, None], drafts, 0)], 1)
    start = cache.lengths[slots].clone()
    logits = model(ids, cache, slots=slots, n_new=kr + 1)
    p = sampling.probs(logits)
    out = _verify(p, drafts, draft_probs, kr, generator, sampling.greedy)
    cache.trim(slots, start + 1 + out.accepted, check=False)  # at most the k + 1 just written
    return out


@torch.no_grad()
def tree_step(
    model,
    cache: KVCache,
    slots,
    last: torch.Tensor,
    sampling: SamplingParams,
    tree,
    tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    present: torch.Tensor,
    generator: torch.Generator | None = None,
):
    """One engine step over a draft tree (`tree_verify.DraftTree`, n nodes): ONE target forward
    over [last, node tokens] per row with the tree's attention mask, `tree_verify`, and the
    cache left holding last + the accepted path (`KVCache.keep_path`), as `step` leaves it for
    a chain. tokens and present (B, n), draft_probs (B, n + 1, V) or None: see `tree_verify`.
    Every row needs n + 1 free cache positions. Returns a `TreeVerifyResult`."""
    from rlsched.executor.decode.tree_verify import tree_verify

    dev = cache.lengths.device
    slots = torch.as_tensor(slots, dtype=torch.long, device=dev)
    b = slots.shape[0]
    tokens, present = tokens.to(dev).long(), present.to(dev).bool()
    ids = torch.cat([last.to(dev).long().reshape(b, 1), torch.where(present, tokens, 0)], 1)
    start = cache.lengths[slots].clone()
    logits = model(ids, cache, slots=slots, tree=tree.target_mask(dev))
    out = tree_verify(tree, sampling.probs(logits), tokens, draft_probs, present, generator, sampling.greedy)
    cache.keep_path(slots, start, out.path.clamp_min(0), out.accepted)
    return out


def decode_step(
    model, cache: KVCache, slots, last: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None = None
) -> VerifyResult:
    """Plain decoding: one token per row, through the same path (k = 0)."""
    return step(model, cache, slots, last, sampling, generator=generator)


@torch.inference_mode()
def generate(
    model,
    prompts: list[list[int]],
    max_new: int,
    sampling: SamplingParams,
    *,
    drafter=None,
    k: int = 0,
    k_per_row=None,
    prompt_ids=None,
    generator: torch.Generator | None = None,
) -> tuple[list[list[int]], list[list[float]], dict]:
    """Batched rollouts (all rows at once, rows stop at max_new tokens): plain decoding when
    `drafter` is None or k = 0, else speculative steps with `drafter.propose`. Returns the
    generated tokens and their target log-probs per row, and counts (steps, drafted,
    accepted). A reference loop for tests and benchmarks; the rollout engine builds on `step`."""
    b = len(prompts)
    cache = model.new_cache(b, max(len(p) for p in prompts) + max_new + k + 1)
    slots = torch.arange(b)
    last = prefill(model, cache, slots, prompts)
    seqs = [Seq(list(p), i, None if prompt_ids is None else prompt_ids[i]) for i, p in enumerate(prompts)]
    gen = [[] for _ in range(b)]
    lps = [[] for _ in range(b)]
    stats = dict(steps=0, drafted=0, accepted=0)
    active = list(range(b))
    if drafter is not None and hasattr(drafter, "reset"):
        drafter.reset()
    while active:
        idx = torch.tensor(active)
        rows = [seqs[i] for i in active]
        if drafter is None or k == 0:
            out = step(model, cache, idx, last[idx], sampling, generator=generator)
        else:
            d, dq, dk = drafter.propose(rows, k)
            if k_per_row is not None:
                dk = torch.minimum(dk, torch.as_tensor(k_per_row)[idx])
            out = step(model, cache, idx, last[idx], sampling, d, dq, dk, generator)
            stats["drafted"] += int(dk.sum())
            stats["accepted"] += int(out.accepted.sum())
        stats["steps"] += 1
        still = []
        for r, i in enumerate(active):
            toks, lp = out.row_tokens(r), out.row_logprobs(r)
            seqs[i].tokens.extend(toks)
            room = max_new - len(gen[i])
            gen[i].extend(toks[:room])
            lps[i].extend(lp[:room])
            last[i] = toks[-1]
            if len(gen[i]) < max_new:
                still.append(i)
            elif drafter is not None and hasattr(drafter, "release"):
                drafter.release([seqs[i]])
        active = still
    return gen, lps, stats
