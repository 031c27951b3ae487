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
KL(p_target || q_head), step j weighted decay**j (`eagle_train.py`). The training text is the
target's own answers (`target_responses`): the states the head reads are those the target
reaches on its own text. The decoder layer is vLLM's EAGLE-3 layer: the residual stream starts
from the un-normalised fused state, and the state fed back is the layer's pre-norm output.

The folder `save_head` writes is the layout vLLM's `eagle3` speculative method loads
(`speculative_config={"method": "eagle3", "model": folder}`): config.json with architecture
`LlamaForCausalLMEagle3`, `draft_vocab_size` and the aux layer ids, and model.safetensors under
the names of EAGLE-3 checkpoints (`midlayer.*`, `fc`, `norm`, `lm_head`, `d2t`, `t2d`; no
embedding: vLLM shares the target's).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from rlsched.atomic import atomic_folder
from rlsched.errors import UserError
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
