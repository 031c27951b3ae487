"""Write a model as a HF folder (config.json + model.safetensors), the inverse of `loading`.

So a model trained here (the built-in pair, an RL actor, a distilled drafter) is a folder that
`load_model`, transformers and vLLM all read. Written whole or not at all (`atomic_folder`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from rlsched.atomic import atomic_folder
from rlsched.executor.model.loading import weight_map
from rlsched.executor.model.transformer import ModelConfig, Transformer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def hf_config(c: ModelConfig, **extra) -> dict:
    """The config.json fields of `c` (models without RoPE scaling; a loaded model keeps its
    own config.json instead: pass it as `raw_config` to `save_model`)."""
    if c.rope_scaling is not None:
        raise ValueError("hf_config writes configs without rope_scaling; pass the original config.json")
    return {
        "architectures": [_ARCH[c.model_type]],
        "model_type": c.model_type,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": c.tie_word_embeddings,
        "attention_bias": c.o_bias,
        "mlp_bias": c.mlp_bias,
        "torch_dtype": "float32",
        **extra,
    }


def hf_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """The model's weights under HF names (fused qkv and gate_up split back)."""
    return hf_weights(model.state_dict(), model.config)


def hf_weights(state: dict, config: ModelConfig) -> dict[str, torch.Tensor]:
    """A state dict of `Transformer(config)` under HF names."""
    out = {}
    for mine, parts in weight_map(config).items():
        sizes = [shape[0] for _, shape in parts]
        for (name, _), t in zip(parts, state[mine].split(sizes, dim=0)):
            out[name] = t.detach().to("cpu").contiguous()
    return out


def save_model(
    model: Transformer, folder, *, raw_config: dict | None = None, tokenizer_from=None, extra_config: dict | None = None
) -> Path:
    """Write `model` to `folder` (replaced whole). `raw_config` is kept as config.json when
    given (a loaded model's own); tokenizer files are copied from folder `tokenizer_from`."""
    from safetensors.torch import save_file

    config = dict(raw_config) if raw_config is not None else hf_config(model.config)
    config.update(extra_config or {})
    folder = Path(folder)
    with atomic_folder(folder) as tmp:
        save_file(hf_state_dict(model), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if tokenizer_from is not None:
            for name in TOKENIZER_FILES:
                src = Path(tokenizer_from) / name
                if src.is_file():
                    shutil.copyfile(src, tmp / name)
    return folder
