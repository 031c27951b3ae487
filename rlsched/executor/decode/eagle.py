"""EAGLE-3 draft heads: one decoder layer on top of a target Transformer's own hidden states.

A model drafter is a small language model that reads tokens only. An EAGLE-3 head (Li et al.,
2025) reads what the target already computed: the residual stream after a low, a middle and a
high layer (`aux_layers`, vLLM's default `(2, L // 2, L - 3)`, where id i is the input of
layer i, i.e. the output of layer i - 1), fused by `fc` (3h -> h). One decoder layer attends
over concat(norm(embedding of the next token), norm(fused state)) (2h -> q, k, v), and its
output, normalised, goes through an lm_head over a reduced draft vocabulary: the `draft_vocab`
target tokens most frequent in the training data. `d2t[i]` is the offset from draft index i
to its target token (token = i + d2t[i]) and `t2d` marks the target tokens in the draft
vocabulary, as EAGLE-3 checkpoints store them. The token embedding is the target's, shared
and frozen: the head holds a reference to its target, not a copy (`attach`).

Positions and what predicts what: the head's anchor t pairs the target's states at position t
with the token x[t+1] the target chose there, and predicts x[t+2]. Chain drafting feeds the
head's own output back: its next step pairs the head's pre-norm output at the anchor (in
place of the fused target states) with the token it just drafted, at position t + 1, and
attends to the anchors' keys up to t plus its own earlier steps' keys. Training unrolls the
same chain over whole sequences (EAGLE-3's training-time test): step j of anchor t is fed the
head's output of step j - 1 at anchor t and the data token x[t+1+j], and is scored against the
target's distribution at position t + 1 + j, restricted to the draft vocabulary, with
KL(p_target || q_head), step j weighted decay**j. The training text is the target's own
answers (`target_responses`): the states the head reads are those the target reaches on its
own text. The decoder layer is vLLM's EAGLE-3 layer: the residual stream starts from the
un-normalised fused state, and the state fed back is the layer's pre-norm output.

The folder `save_head` writes is the layout vLLM's `eagle3` speculative method loads
(`speculative_config={"method": "eagle3", "model": folder}`): config.json with architecture
`LlamaForCausalLMEagle3`, `draft_vocab_size` and the aux layer ids, and model.safetensors under
the names of EAGLE-3 checkpoints (`midlayer.*`, `fc`, `norm`, `lm_head`, `d2t`, `t2d`; no
embedding: vLLM shares the target's).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from rlsched.atomic import atomic_folder
from rlsched.errors import UserError
from rlsched.executor.decode.sampling import GREEDY, SamplingParams, sample
from rlsched.executor.model.builtin import cached_build, lr_schedule
from rlsched.executor.model.rope import apply_rope
from rlsched.executor.model.transformer import MLP, ModelConfig, RMSNorm, Transformer

# What vLLM's EAGLE-3 loader (vllm/model_executor/models/llama_eagle3.py, Eagle3LlamaForCausalLM)
# reads: the architecture it is registered under, and the checkpoint names its load_weights maps
# ("midlayer." -> layers.0, q/k/v and gate/up stacked, "d2t" -> draft_id_to_target_id, "t2d" skipped).
VLLM_ARCHITECTURE = "LlamaForCausalLMEagle3"
VLLM_WEIGHTS = (
    "fc.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
)
# config.json fields vLLM reads from the draft folder: the architecture, the draft vocabulary
# size, the target layers whose states it hands over (vLLM's model runner reads the top-level
# field), the target's width (fc's input), and a Llama layer's shape.
VLLM_CONFIG_FIELDS = (
    "architectures",
    "model_type",
    "draft_vocab_size",
    "eagle_aux_hidden_state_layer_ids",
    "target_hidden_size",
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "rms_norm_eps",
    "rope_theta",
    "max_position_embeddings",
)


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """vLLM's default EAGLE-3 aux layers for a target of `num_layers` layers: (2, L // 2, L - 3)."""
    ids = (2, num_layers // 2, num_layers - 3)
    if len(set(ids)) != 3 or ids != tuple(sorted(ids)):
        raise ValueError(
            f"a target of {num_layers} layers has no three distinct default aux layers "
            f"{ids}; give aux_layers explicitly"
        )
    return ids


@dataclass(frozen=True)
class HeadConfig:
    """The head's shape. Attention heads, width and rotary embedding are the target's."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # the target's
    draft_vocab: int
    aux_layers: tuple[int, ...]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048

    def __post_init__(self):
        ids = tuple(self.aux_layers)
        if not ids or ids != tuple(sorted(set(ids))) or ids[0] < 0:
            raise ValueError(
                f"aux_layers must be distinct, ascending and >= 0 (got {ids}); "
                "vLLM concatenates the states in ascending layer order"
            )
        if not 1 <= self.draft_vocab <= self.vocab_size:
            raise ValueError(f"draft_vocab must lie in [1, {self.vocab_size}] (got {self.draft_vocab})")

    @classmethod
    def for_target(
        cls, c: ModelConfig, *, draft_vocab: int, aux_layers=None, intermediate_size: int | None = None
    ) -> HeadConfig:
        aux = tuple(aux_layers) if aux_layers is not None else default_aux_layers(c.num_layers)
        if max(aux) > c.num_layers:
            raise ValueError(f"aux layer {max(aux)} is past the target's {c.num_layers} layers")
        return cls(
            hidden_size=c.hidden_size,
            intermediate_size=intermediate_size or c.intermediate_size,
            num_heads=c.num_heads,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            vocab_size=c.vocab_size,
            draft_vocab=draft_vocab,
            aux_layers=aux,
            rms_norm_eps=c.rms_norm_eps,
            rope_theta=c.rope_theta,
            max_position_embeddings=c.max_position_embeddings,
        )

    def layer_config(self) -> ModelConfig:
        return ModelConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_layers=1,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
        )

    def hf_config(self) -> dict:
        """config.json of a saved head (a one-layer Llama config plus the EAGLE-3 fields)."""
        aux = list(self.aux_layers)
        return {
            "architectures": [VLLM_ARCHITECTURE],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": 1,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab,
            "target_hidden_size": self.hidden_size,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "mlp_bias": False,
            "torch_dtype": "float32",
            "eagle_aux_hidden_state_layer_ids": aux,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux, "use_aux_hidden_state": True},
        }

    @classmethod
    def from_hf(cls, raw: dict, where: str) -> HeadConfig:
        try:
            return cls(
                hidden_size=int(raw["hidden_size"]),
                intermediate_size=int(raw["intermediate_size"]),
                num_heads=int(raw["num_attention_heads"]),
                num_kv_heads=int(raw["num_key_value_heads"]),
                head_dim=int(raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]),
                vocab_size=int(raw["vocab_size"]),
                draft_vocab=int(raw["draft_vocab_size"]),
                aux_layers=tuple(int(i) for i in raw["eagle_aux_hidden_state_layer_ids"]),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(raw.get("rope_theta", 10000.0)),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            )
        except KeyError as e:
            raise UserError(
                f"{where}: config.json has no field {e.args[0]!r}; it is not an EAGLE-3 head "
                "(write one with rlsched.executor.decode.eagle.save_head)"
            ) from None
        except (TypeError, ValueError) as e:
            raise UserError(f"{where}: config.json of an EAGLE-3 head is invalid ({e})") from None


class EagleHead(nn.Module):
    """The head of `target`: fc, one decoder layer, norm and the draft-vocabulary lm_head.
    The target is referenced, not registered: its weights are neither the head's parameters
    nor in its state dict. The draft vocabulary starts as the first `draft_vocab` ids
    (`set_vocab` chooses it)."""

    def __init__(self, config: HeadConfig, target: Transformer):
        super().__init__()
        c = self.config = config
        h, eps = c.hidden_size, c.rms_norm_eps
        self.fc = nn.Linear(len(c.aux_layers) * h, h, bias=False)
        self.embed_norm = RMSNorm(h, eps)
        self.hidden_norm = RMSNorm(h, eps)
        self.qkv = nn.Linear(2 * h, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim, bias=False)
        self.o = nn.Linear(c.num_heads * c.head_dim, h, bias=False)
        self.mlp_norm = RMSNorm(h, eps)
        self.mlp = MLP(c.layer_config())
        self.norm = RMSNorm(h, eps)
        self.lm_head = nn.Linear(h, c.draft_vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))
        self.t2d[: c.draft_vocab] = True
        self.attach(target)

    def attach(self, target: Transformer) -> None:
        """Read the embedding, rotary tables and aux states of `target` from now on."""
        c = target.config
        if (c.hidden_size, c.vocab_size, c.head_dim) != (
            self.config.hidden_size,
            self.config.vocab_size,
            self.config.head_dim,
        ):
            raise ValueError(
                f"the head (hidden {self.config.hidden_size}, vocab {self.config.vocab_size}) does "
                f"not fit a target of hidden {c.hidden_size}, vocab {c.vocab_size}"
            )
        object.__setattr__(self, "target", target)  # a reference, not a submodule

    @property
    def draft_ids(self) -> torch.Tensor:
        """The target token of each draft index (D,)."""
        return torch.arange(self.config.draft_vocab, device=self.d2t.device) + self.d2t

    def set_vocab(self, token_ids) -> None:
        """Make `token_ids` (draft_vocab distinct target ids) the draft vocabulary, ascending."""
        ids = torch.as_tensor(sorted(int(i) for i in token_ids), dtype=torch.long)
        if (
            len(ids) != self.config.draft_vocab
            or len(set(ids.tolist())) != len(ids)
            or not 0 <= int(ids[0]) <= int(ids[-1]) < self.config.vocab_size
        ):
            raise ValueError(
                f"the draft vocabulary needs {self.config.draft_vocab} distinct ids in [0, {self.config.vocab_size})"
            )
        with torch.no_grad():
            self.d2t.copy_(ids - torch.arange(len(ids)))
            self.t2d.zero_()
            self.t2d[ids] = True

    # --- the layer ------------------------------------------------------------------------

    def _qkv(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
        c = self.config
        e = F.embedding(tokens, self.target.embed.weight)
        x = torch.cat([self.embed_norm(e), self.hidden_norm(hidden)], dim=-1)
        b, n, _ = x.shape
        qkv = self.qkv(x).view(b, n, c.num_heads + 2 * c.num_kv_heads, c.head_dim).transpose(1, 2)
        cos, sin = self.target.rope(positions, x.dtype)
        qk = apply_rope(qkv[:, : c.num_heads + c.num_kv_heads], cos, sin)
        return qk[:, : c.num_heads], qk[:, c.num_heads :], qkv[:, c.num_heads + c.num_kv_heads :]

    def _attend(self, q, ctx_k, ctx_v, own: list) -> torch.Tensor:
        """Attention of queries q (B, H, n, d) at the last n of the m context anchors: causal
        over the context keys (B, KV, m, d), plus each query's own keys of earlier chain
        steps (`own`: (k, v) pairs of shape (B, KV, n, d), one per step, the query's own
        anchor only)."""
        c = self.config
        g, scale = c.num_heads // c.num_kv_heads, c.head_dim**-0.5
        b, _, n, _ = q.shape
        m = ctx_k.shape[2]
        scores = (q @ ctx_k.repeat_interleave(g, 1).transpose(-1, -2)) * scale  # (B, H, n, m)
        later = torch.arange(m, device=q.device)[None, :] > torch.arange(m - n, m, device=q.device)[:, None]
        scores = scores.masked_fill(later, float("-inf"))
        extra = [(q * k.repeat_interleave(g, 1)).sum(-1, keepdim=True) * scale for k, _ in own]
        p = torch.softmax(torch.cat([scores, *extra], dim=-1), dim=-1)
        out = p[..., :m] @ ctx_v.repeat_interleave(g, 1)
        for i, (_, v) in enumerate(own):
            out = out + p[..., m + i : m + i + 1] * v.repeat_interleave(g, 1)
        return self.o(out.transpose(1, 2).reshape(b, n, c.num_heads * c.head_dim))

    def layer(self, tokens, hidden, positions, ctx=None, own: list | None = None):
        """One pass of the decoder layer. tokens (B, n), hidden (B, n, h): the fused target
        states or the head's previous output; `ctx`: the context anchors' (k, v), None when
        these n positions are the anchors themselves (step 0); `own`: (k, v) of the earlier
        chain steps, to which this step's are appended. Returns (pre-norm output (B, n, h),
        draft-vocabulary logits (B, n, D), this step's (k, v))."""
        q, k, v = self._qkv(tokens, hidden, positions)
        own = [] if own is None else own
        if ctx is None:
            ctx = (k, v)
        else:
            own.append((k, v))
        r = hidden + self._attend(q, ctx[0], ctx[1], own)
        r = r + self.mlp(self.mlp_norm(r))
        return r, self.lm_head(self.norm(r)), (k, v)

    def unroll(self, aux: torch.Tensor, tokens: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """The training-time test: aux (B, n, A*h) the target's aux states at positions
        0..n-1, tokens (B, n + steps - 1) with tokens[:, t] = x[t+1]. Returns the logits
        (B, n, D) of each of the `steps` chain steps; step j at anchor t predicts x[t+2+j],
        fed the head's own step j - 1 output at t and token x[t+1+j]."""
        b, n, _ = aux.shape
        if tokens.shape[1] < n + steps - 1:
            raise ValueError(f"unroll of {steps} steps over {n} anchors needs {n + steps - 1} tokens a row")
        positions = torch.arange(n, device=aux.device).expand(b, n)
        hidden, ctx, own, out = self.fc(aux), None, [], []
        for j in range(steps):
            hidden, logits, kv = self.layer(tokens[:, j : j + n], hidden, positions + j, ctx, own)
            ctx = kv if ctx is None else ctx
            out.append(logits)
        return out


# --- the target's states --------------------------------------------------------------------


def target_features(target: Transformer, ids: torch.Tensor, layers) -> tuple[torch.Tensor, torch.Tensor]:
    """The aux states (B, T, len(layers) * h) and logits (B, T, V, float32) of whole sequences
    `ids` (B, T) in one forward without cache. Layer id i is the residual stream entering
    layer i (id L: after the last layer, before the final norm), concatenated in ascending
    order, as vLLM hands them to an EAGLE-3 head."""
    b, q = ids.shape
    wanted = set(layers)
    embed = target.embed.weight
    s = target._step(b, q, ids.device, embed.dtype, None, None)
    h = F.embedding(ids, embed)
    got = []
    for i, layer in enumerate(target.layers):
        if i in wanted:
            got.append(h)
        h = layer.forward(h, i, s)
    if len(target.layers) in wanted:
        got.append(h)
    h = target.norm.forward(h)
    logits = F.linear(h, embed if target.lm_head is None else target.lm_head.weight).float()
    return torch.cat(got, dim=-1), logits


# --- training -------------------------------------------------------------------------------


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


# --- drafting -------------------------------------------------------------------------------


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


# --- folders --------------------------------------------------------------------------------


def vllm_weights(state: dict[str, torch.Tensor], config: HeadConfig) -> dict[str, torch.Tensor]:
    """A head's state_dict (an `EagleHead`'s names) under the names of EAGLE-3 checkpoints, the
    names vLLM's eagle3 model loads (from a folder, or in place with `load_weights`)."""
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    wq, wk, wv = state["qkv.weight"].split([q, kv, kv], dim=0)
    gate, up = state["mlp.gate_up.weight"].chunk(2, dim=0)
    m = "midlayer."
    out = {
        "fc.weight": state["fc.weight"],
        m + "input_layernorm.weight": state["embed_norm.weight"],
        m + "hidden_norm.weight": state["hidden_norm.weight"],
        m + "self_attn.q_proj.weight": wq,
        m + "self_attn.k_proj.weight": wk,
        m + "self_attn.v_proj.weight": wv,
        m + "self_attn.o_proj.weight": state["o.weight"],
        m + "post_attention_layernorm.weight": state["mlp_norm.weight"],
        m + "mlp.gate_proj.weight": gate,
        m + "mlp.up_proj.weight": up,
        m + "mlp.down_proj.weight": state["mlp.down.weight"],
        "norm.weight": state["norm.weight"],
        "lm_head.weight": state["lm_head.weight"],
        "d2t": state["d2t"],
        "t2d": state["t2d"],
    }
    return {name: t.detach().to("cpu").contiguous() for name, t in out.items()}


def read_head_config(folder) -> HeadConfig:
    """The HeadConfig of the head saved in `folder`; a UserError naming the folder otherwise."""
    folder = Path(folder)
    try:
        raw = json.loads((folder / "config.json").read_text())
    except FileNotFoundError:
        raise UserError(f"EAGLE-3 head folder {folder}: config.json is missing") from None
    except (OSError, ValueError) as e:
        raise UserError(f"EAGLE-3 head folder {folder} cannot be read ({e})") from None
    return HeadConfig.from_hf(raw, str(folder))


def is_head_folder(folder) -> bool:
    """Whether `folder` holds an EAGLE-3 head (its config.json names the eagle3 architecture)."""
    try:
        raw = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and VLLM_ARCHITECTURE in (raw.get("architectures") or ())


def save_head(head: EagleHead, folder, *, extra_files: dict[str, str] | None = None) -> Path:
    """Write `head` to `folder` (replaced whole) in the layout vLLM's eagle3 method loads;
    `extra_files` (name -> text) are written beside it."""
    from safetensors.torch import save_file

    folder = Path(folder)
    with atomic_folder(folder) as tmp:
        save_file(
            vllm_weights(head.state_dict(), head.config), str(tmp / "model.safetensors"), metadata={"format": "pt"}
        )
        (tmp / "config.json").write_text(json.dumps(head.config.hf_config(), indent=2) + "\n")
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
    return folder


def load_head(folder, target: Transformer) -> EagleHead:
    """The head saved in `folder` (`save_head`), attached to `target`, in eval mode without
    gradients. A folder that is not a head for this target is a UserError naming it."""
    from safetensors.torch import load_file

    folder = Path(folder)
    config = read_head_config(folder)
    try:
        state = load_file(str(folder / "model.safetensors"))
    except FileNotFoundError:
        raise UserError(f"EAGLE-3 head folder {folder}: model.safetensors is missing") from None
    except (OSError, ValueError) as e:
        raise UserError(f"EAGLE-3 head folder {folder} cannot be read ({e})") from None
    missing = [n for n in VLLM_WEIGHTS if n not in state]
    if missing:
        raise UserError(f"EAGLE-3 head folder {folder}: model.safetensors has no tensor {missing[0]!r}")
    try:
        head = EagleHead(config, target)
    except ValueError as e:
        raise UserError(f"EAGLE-3 head folder {folder}: {e}") from None
    m = "midlayer."
    mine = {
        "fc.weight": state["fc.weight"],
        "embed_norm.weight": state[m + "input_layernorm.weight"],
        "hidden_norm.weight": state[m + "hidden_norm.weight"],
        "qkv.weight": torch.cat([state[m + f"self_attn.{p}_proj.weight"] for p in "qkv"]),
        "o.weight": state[m + "self_attn.o_proj.weight"],
        "mlp_norm.weight": state[m + "post_attention_layernorm.weight"],
        "mlp.gate_up.weight": torch.cat([state[m + "mlp.gate_proj.weight"], state[m + "mlp.up_proj.weight"]]),
        "mlp.down.weight": state[m + "mlp.down_proj.weight"],
        "norm.weight": state["norm.weight"],
        "lm_head.weight": state["lm_head.weight"],
        "d2t": state["d2t"].long(),
        "t2d": state["t2d"].bool(),
    }
    dtype = target.embed.weight.dtype
    try:
        head.load_state_dict({n: t if n in ("d2t", "t2d") else t.to(dtype) for n, t in mine.items()}, strict=True)
    except RuntimeError as e:
        raise UserError(
            f"EAGLE-3 head folder {folder}: weights do not match its config.json ({str(e).splitlines()[-1].strip()})"
        ) from None
    head.to(target.embed.weight.device, dtype).eval().requires_grad_(False)  # (floating tensors only)
    return head


# --- the built-in pair's head ---------------------------------------------------------------


@dataclass(frozen=True)
class HeadRecipe:
    """Everything that decides the built-in head; its hash (with the target's) names the cache folder."""

    draft_vocab: int = 40
    prompts: int = 2048  # task prompts the target answers: the training data
    max_new: int = 64
    temperature: float = 1.0  # of the target's answers
    epochs: int = 12
    ttt_steps: int = 3
    decay: float = 0.6  # weight of unrolled step j: decay ** j
    lr: float = 3e-3
    seed: int = 11
    version: int = 1

    def key(self, target_id: str) -> str:
        blob = json.dumps({"recipe": asdict(self), "target": target_id}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:10]


@dataclass(frozen=True)
class BuiltinHead:
    folder: Path  # the head (vLLM's eagle3 draft folder)
    target: Path  # the built-in target it drafts for
    info: dict


def builtin_head(recipe: HeadRecipe = HeadRecipe(), *, log=None) -> BuiltinHead:
    """An EAGLE-3 head for the built-in pair's target (`builtin.builtin_pair()`), trained on
    the target's answers to task prompts on first use and cached in `$RLSCHED_CACHE` (or
    ~/.cache/rlsched), folder `eagle-<hash>`; concurrent first uses wait on a lock and build
    once."""
    from rlsched.executor.model.builtin import builtin_pair

    pair = builtin_pair()
    target_id = f"{pair.info['key']}-{pair.info.get('weights_dtype', 'float32')}"
    key = recipe.key(target_id)
    folder = cached_build(
        f"eagle-{key}",
        lambda folder: _build_head(recipe, pair.target, key, target_id, folder, log or (lambda msg: None)),
    )
    return BuiltinHead(folder, pair.target, json.loads((folder / "build.json").read_text()))


def _build_head(recipe: HeadRecipe, target_dir: Path, key: str, target_id: str, folder: Path, log) -> None:
    from rlsched.executor.model.builtin import EOS, PAD, encode
    from rlsched.executor.model.loading import load_model
    from rlsched.tasks.synthetic import make_examples

    start = time.perf_counter()
    log(f"training the built-in target's EAGLE-3 head {key} in {folder.parent} (once; a minute or two)")
    target = load_model(target_dir).model
    prompts = [encode(e.prompt) for e in make_examples(recipe.prompts, recipe.seed)]
    batches = target_responses(
        target,
        prompts,
        max_new=recipe.max_new,
        eos_id=EOS,
        pad_id=PAD,
        seed=recipe.seed,
        sampling=SamplingParams(temperature=recipe.temperature),
    )
    data_s = time.perf_counter() - start
    torch.manual_seed(recipe.seed)
    head = EagleHead(HeadConfig.for_target(target.config, draft_vocab=recipe.draft_vocab), target)
    head.set_vocab(frequent_tokens(batches, recipe.draft_vocab, target.config.vocab_size))
    init_head(head)
    stats = train_head(
        target,
        head,
        batches,
        epochs=recipe.epochs,
        lr=recipe.lr,
        ttt_steps=recipe.ttt_steps,
        decay=recipe.decay,
        seed=recipe.seed,
        log=log,
    )
    info = {
        "recipe": asdict(recipe),
        "key": key,
        "target": target_id,
        **stats,
        "head_params": sum(p.numel() for p in head.parameters()),
        "data_seconds": data_s,
        "seconds": time.perf_counter() - start,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "built": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    save_head(head, folder, extra_files={"build.json": json.dumps(info, indent=2) + "\n"})
    log(f"built in {info['seconds']:.0f} s: loss {stats['loss_first']:.3f} -> {stats['loss_last']:.3f}")


def init_head(head: EagleHead, std: float = 0.02) -> None:
    """normal(0, std) linears, unit norms, and the lm_head and final norm copied from the
    target's output layer (its rows of the draft tokens): the head then starts by learning to
    reproduce the target's last hidden state."""
    t = head.target
    with torch.no_grad():
        for name, p in head.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0, std)
        out = t.embed.weight if t.lm_head is None else t.lm_head.weight
        head.lm_head.weight.copy_(out[head.draft_ids])
        head.norm.weight.copy_(t.norm.weight)
