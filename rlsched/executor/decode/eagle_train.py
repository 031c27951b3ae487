"""Training an EAGLE-3 head (`eagle.py`) on its target's own answers: the unrolled
distillation loss (EAGLE-3's training-time test), training from scratch, and keeping the head
fresh as the actor trains in RL (`distill_head`)."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
import torch.nn.functional as F

from rlsched.executor.decode.eagle import EagleHead, target_features
from rlsched.executor.decode.sampling import SamplingParams
from rlsched.executor.model.builtin import lr_schedule
from rlsched.executor.model.transformer import Transformer


def ttt_loss(
    head: EagleHead,
    aux: torch.Tensor,
    target_logits: torch.Tensor,
    ids: torch.Tensor,
    mask: torch.Tensor,
    *,
    ttt_steps: int = 3,
    weights: torch.Tensor | None = None,
    temperature: float = 1.0,
    decay: float = 1.0,
) -> tuple[torch.Tensor, list[float]]:
    """The head's unrolled distillation loss on sequences `ids` (B, T) with the target's aux
    states and logits of them: the mean over chain steps of the mean KL(p || q) over the
    positions where `mask` (B, T-1, as the drafter's: position i's next token counts) is
    set, each token weighted by its row's `weights` (B,) (default 1). p is the target's
    distribution restricted to the draft vocabulary and renormalised; both at `temperature`.
    Step j counts `decay`**j (normalised). Returns (loss, the unweighted mean KL of every step)."""
    b, t = ids.shape
    n = t - 1
    tokens = F.pad(ids[:, 1:], (0, ttt_steps - 1))  # the padding feeds only anchors never scored
    steps = head.unroll(aux[:, :n], tokens, ttt_steps)
    logp = F.log_softmax(target_logits[..., head.draft_ids] / temperature, dim=-1)
    w = torch.ones(b, device=ids.device) if weights is None else weights.to(ids.device)
    total, kls, norm = 0.0, [], 0.0
    for j, logits in enumerate(steps):
        scored = n - 1 - j  # anchor t is scored against position t + 1 + j <= T - 2
        if scored <= 0:
            break
        p = logp[:, 1 + j : n]
        kl = (p.exp() * (p - F.log_softmax(logits[:, :scored] / temperature, dim=-1))).sum(-1)
        m = mask[:, 1 + j :].float()
        denom = m.sum().clamp(min=1.0)
        total = total + decay**j * (kl * m * w[:, None]).sum() / denom
        norm += decay**j
        kls.append(float((kl.detach() * m).sum() / denom))
    return total / max(norm, 1e-9), kls


def train_head(
    target: Transformer,
    head: EagleHead,
    batches: Iterable,
    *,
    epochs: int = 1,
    lr: float = 3e-3,
    ttt_steps: int = 3,
    decay: float = 1.0,
    seed: int = 0,
    log=None,
) -> dict:
    """`epochs` passes over `batches` ((ids, mask) pairs), in a fresh random order each pass,
    one AdamW step of `ttt_loss` per batch; the learning rate warms up and decays over all
    steps. The target's states and logits of every batch are computed once (kept for the
    later passes); the target is not trained. Returns the mean loss of the first and the last
    20 steps and the per-step KL of the last batch."""
    batches = list(batches)
    total = epochs * len(batches)
    head.train().requires_grad_(True)
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_schedule(s, total, warmup=20))
    order = torch.Generator().manual_seed(seed)
    features: dict[int, tuple] = {}
    losses, kls = [], []
    try:
        for _ in range(epochs):
            for i in torch.randperm(len(batches), generator=order).tolist():
                ids, mask = batches[i]
                got = features.get(i)
                if got is None:
                    with torch.no_grad():
                        got = target_features(target, ids, head.config.aux_layers)
                    if epochs > 1:
                        features[i] = got
                aux, logits = got
                loss, kls = ttt_loss(head, aux, logits, ids, mask, ttt_steps=ttt_steps, decay=decay)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
                opt.step()
                sched.step()
                losses.append(loss.item())
                if log and (len(losses) % 100 == 0 or len(losses) == total):
                    log(f"eagle head: step {len(losses)}/{total}, loss {np.mean(losses[-50:]):.3f}")
    finally:
        head.eval().requires_grad_(False)
    return dict(loss_first=float(np.mean(losses[:20])), loss_last=float(np.mean(losses[-20:])), kl_steps=kls)


def distill_head(
    actor: Transformer,
    head: EagleHead,
    optimizer,
    buffer,
    *,
    steps: int,
    batch: int,
    weighting: str,
    weight_min: float,
    weight_max: float,
    temperature: float,
    generator: torch.Generator,
    pad_id: int,
    ttt_steps: int = 3,
) -> dict:
    """Keep the head fresh as the actor trains, with the model drafter's rule
    (`rl/distill.distill`): `steps` optimizer steps on minibatches of the replay buffer's
    samples, minimising w(r) x KL(p_actor || q_head) per response token (the unrolled
    `ttt_loss`), w the sample's `reward_weights`. The head reads the actor's states and
    embedding from now on (`attach`). Returns the unweighted KL of the first and the last
    minibatch (mean over the unrolled steps) and the number of samples."""
    from rlsched.executor.rl.distill import distill

    head.attach(actor)

    def loss_fn(ids, mask, weights):
        with torch.no_grad():
            aux, logits = target_features(actor, ids, head.config.aux_layers)
        loss, step_kls = ttt_loss(
            head, aux, logits, ids, mask, ttt_steps=ttt_steps, weights=weights, temperature=temperature
        )
        return loss, float(np.mean(step_kls)) if step_kls else float("nan")

    return distill(
        actor,
        head,
        optimizer,
        buffer,
        steps=steps,
        batch=batch,
        weighting=weighting,
        weight_min=weight_min,
        weight_max=weight_max,
        temperature=temperature,
        generator=generator,
        pad_id=pad_id,
        loss_fn=loss_fn,
    )


def target_responses(
    target: Transformer,
    prompts: list[list[int]],
    *,
    max_new: int,
    sampling: SamplingParams,
    eos_id: int,
    pad_id: int,
    batch: int = 32,
    seed: int = 0,
    chunk: int = 512,
) -> list:
    """Training batches of the target's own responses to `prompts`: what the head meets when it
    drafts is the target's text and the states the target reaches on it, which a corpus the
    target does not reproduce would not show (EAGLE's training data is regenerated by the
    target for the same reason). Each response is generated with `sampling` (up to `max_new`
    tokens, cut after `eos_id`); rows of similar length share a batch, right-padded with
    `pad_id`, with the mask of the positions whose next token is a response token."""
    from rlsched.executor.decode.speculative import generate

    texts = []
    for c in range(0, len(prompts), chunk):
        part = prompts[c : c + chunk]
        out, _, _ = generate(target, part, max_new, sampling, generator=torch.Generator().manual_seed(seed + c))
        texts += [(p, o[: o.index(eos_id) + 1] if eos_id in o else o) for p, o in zip(part, out)]
    texts.sort(key=lambda x: len(x[0]) + len(x[1]))
    from rlsched.executor.rl.algos import make_batch

    batches = []
    for i in range(0, len(texts), batch):
        b = make_batch([p for p, _ in texts[i : i + batch]], [o for _, o in texts[i : i + batch]], None, pad_id)
        batches.append((b.ids, b.mask))
    return batches


def frequent_tokens(batches: Iterable, size: int, vocab_size: int) -> list[int]:
    """The `size` target ids most frequent as next tokens where each batch's mask is set
    (ties and unseen ids by ascending id): a draft vocabulary."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids, mask in batches:
        counts += torch.bincount(ids[:, 1:][mask], minlength=vocab_size)
    order = sorted(range(vocab_size), key=lambda i: (-int(counts[i]), i))
    return sorted(order[:size])
