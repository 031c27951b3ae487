"""Load a local Hugging Face model folder: config.json, *.safetensors (single or sharded) and
tokenizer.json, into `model.Transformer`.

Everything that can be wrong with a folder (missing or unsupported config field, absent or
corrupt weights, missing or unexpected tensors, wrong shapes) is a `UserError` that names the
folder and the field or tensor, so that the CLI prints one line and exits 2.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from rlsched.errors import UserError
from rlsched.executor.model.rope import SUPPORTED_SCALINGS, RopeScaling
from rlsched.executor.model.transformer import ModelConfig, Transformer

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
INDEX_FILE = "model.safetensors.index.json"


@dataclass
class LoadedModel:
    model: Transformer
    config: ModelConfig
    tokenizer: object | None  # tokenizers.Tokenizer, or None without tokenizer.json
    path: Path


def load_model(path, *, device="cpu", dtype="float32") -> LoadedModel:
    """The model of folder `path` on `device` in `dtype` (float32 or bfloat16), in eval mode
    and without gradients."""
    folder = Path(path)
    config = load_config(folder)
    dt = _dtype(dtype)
    dev = _device(device)
    with torch.device("meta"):
        model = Transformer(config)
    state = _load_weights(folder, config, dev, dt)
    model.load_state_dict(state, strict=True, assign=True)
    model.rope.materialize(dev)
    model.eval().requires_grad_(False)  # rollouts; an RL update turns gradients back on
    return LoadedModel(model, config, load_tokenizer(folder), folder)


# --- config ---------------------------------------------------------------------------------


def load_config(path) -> ModelConfig:
    """Read and validate `config.json` of a model folder."""
    folder = Path(path)
    if not folder.is_dir():
        raise UserError(
            f"model folder {folder} does not exist (give a local folder with config.json and *.safetensors)"
        )
    file = folder / "config.json"
    if not file.is_file():
        raise UserError(f"model folder {folder} has no config.json")
    try:
        raw = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise UserError(f"{file} must hold a JSON object")
    return config_from_hf(raw, folder)


def config_from_hf(raw: dict, folder: Path | str = "<config>") -> ModelConfig:
    """A `ModelConfig` from the fields of a HF config dict (transformers v4 and v5 layouts)."""
    f = _Fields(raw, Path(folder))
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        shown = "missing" if model_type is None else f"{model_type!r}"
        raise UserError(
            f"{f.where}: field 'model_type' is {shown}; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} (decoder-only Llama-family models)"
        )
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise UserError(f"{f.where}: field 'hidden_act' is {act!r}; only 'silu' (SwiGLU) is supported")
    hidden = f.int("hidden_size")
    heads = f.int("num_attention_heads")
    kv_heads = f.int("num_key_value_heads", heads)
    if heads % kv_heads:
        raise UserError(
            f"{f.where}: field 'num_key_value_heads' ({kv_heads}) must divide 'num_attention_heads' ({heads})"
        )
    head_default = 128 if model_type == "qwen3" else (hidden // heads if hidden % heads == 0 else None)
    head_dim = f.int("head_dim", head_default)
    if head_dim % 2:
        raise UserError(f"{f.where}: field 'head_dim' must be even for rotary embeddings (got {head_dim})")
    layers = f.int("num_hidden_layers")
    theta, scaling = _rope(raw, f)
    bias = f.bool("attention_bias", False)
    return ModelConfig(
        vocab_size=f.int("vocab_size"),
        hidden_size=hidden,
        intermediate_size=f.int("intermediate_size"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=f.float("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=f.int("max_position_embeddings", 2048),
        tie_word_embeddings=f.bool("tie_word_embeddings", False),
        qkv_bias=True if model_type == "qwen2" else bias,
        o_bias=False if model_type == "qwen2" else bias,
        mlp_bias=f.bool("mlp_bias", False) if model_type == "llama" else False,
        qk_norm=model_type == "qwen3",
        sliding_window=_sliding_window(raw, model_type, layers, f),
        model_type=model_type,
    )


class _Fields:
    """Typed access to config fields with errors that name the field and the folder."""

    def __init__(self, raw: dict, folder: Path):
        self.raw, self.where = raw, f"{folder / 'config.json'}"

    def _get(self, name, default):
        value = self.raw.get(name)
        if value is None:
            if default is None:
                raise UserError(f"{self.where}: field '{name}' is missing")
            return default
        return value

    def int(self, name: str, default: int | None = None) -> int:
        value = self._get(name, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"{self.where}: field '{name}' must be a positive integer (got {value!r})")
        return value

    def float(
        self, name: str, default: float | None = None, sub: dict | None = None, label: str | None = None
    ) -> float:
        src = self.raw if sub is None else sub
        value = src.get(name)
        if value is None:
            if default is None:
                raise UserError(f"{self.where}: field '{label or name}' is missing")
            value = default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise UserError(f"{self.where}: field '{label or name}' must be a positive number (got {value!r})")
        return float(value)

    def bool(self, name: str, default: bool) -> bool:
        value = self.raw.get(name, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise UserError(f"{self.where}: field '{name}' must be true or false (got {value!r})")
        return value


def _rope(raw: dict, f: _Fields) -> tuple[float, RopeScaling | None]:
    """rope_theta and scaling from `rope_parameters` (transformers v5) or `rope_theta` +
    `rope_scaling` (v4 and most published checkpoints)."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and params:
        field = "rope_parameters"
        theta = f.float("rope_theta", raw.get("rope_theta", 10000.0), sub=params, label="rope_parameters.rope_theta")
    else:
        field = "rope_scaling"
        params = raw.get("rope_scaling") or {}
        theta = f.float("rope_theta", 10000.0)
    if not isinstance(params, dict):
        raise UserError(f"{f.where}: field '{field}' must be an object or null (got {params!r})")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in SUPPORTED_SCALINGS:
        raise UserError(f"{f.where}: field '{field}.rope_type' is {kind!r}; supported: {', '.join(SUPPORTED_SCALINGS)}")
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise UserError(f"{f.where}: field 'partial_rotary_factor' is {partial!r}; only 1.0 is supported")
    if kind == "default":
        return theta, None

    def num(name, default=None):
        return f.float(name, default, sub=params, label=f"{field}.{name}")

    if kind in ("linear", "dynamic"):
        return theta, RopeScaling(kind, factor=num("factor"))
    original = params.get("original_max_position_embeddings")
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        raise UserError(
            f"{f.where}: field '{field}.original_max_position_embeddings' must be a positive integer (got {original!r})"
        )
    low, high = num("low_freq_factor"), num("high_freq_factor")
    if high <= low:
        raise UserError(f"{f.where}: field '{field}.high_freq_factor' must exceed low_freq_factor")
    return theta, RopeScaling(
        "llama3",
        factor=num("factor"),
        low_freq_factor=low,
        high_freq_factor=high,
        original_max_position_embeddings=original,
    )


def _sliding_window(raw: dict, model_type: str, layers: int, f: _Fields) -> int | None:
    """The window the model declares and uses in at least one layer, else None."""
    window = raw.get("sliding_window")
    if window is None:
        return None
    if model_type in ("qwen2", "qwen3"):
        # Qwen slides only with use_sliding_window, and only in layers >= max_window_layers.
        if not raw.get("use_sliding_window", False) or raw.get("max_window_layers", layers) >= layers:
            return None
    elif model_type != "mistral":
        return None
    return f.int("sliding_window")


# --- weights --------------------------------------------------------------------------------


def weight_map(config: ModelConfig) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """Each parameter of `Transformer` -> the HF tensors (name, shape) concatenated into it."""
    c = config
    h, hd = c.hidden_size, c.head_dim
    q, kv = c.num_heads * hd, c.num_kv_heads * hd
    out = {
        "embed.weight": [("model.embed_tokens.weight", (c.vocab_size, h))],
        "norm.weight": [("model.norm.weight", (h,))],
    }
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = [("lm_head.weight", (c.vocab_size, h))]
    for i in range(c.num_layers):
        hf, me = f"model.layers.{i}.", f"layers.{i}."
        out[me + "attn_norm.weight"] = [(hf + "input_layernorm.weight", (h,))]
        out[me + "mlp_norm.weight"] = [(hf + "post_attention_layernorm.weight", (h,))]
        parts = [("q_proj", q), ("k_proj", kv), ("v_proj", kv)]
        out[me + "attn.qkv.weight"] = [(f"{hf}self_attn.{p}.weight", (n, h)) for p, n in parts]
        if c.qkv_bias:
            out[me + "attn.qkv.bias"] = [(f"{hf}self_attn.{p}.bias", (n,)) for p, n in parts]
        out[me + "attn.o.weight"] = [(hf + "self_attn.o_proj.weight", (h, q))]
        if c.o_bias:
            out[me + "attn.o.bias"] = [(hf + "self_attn.o_proj.bias", (h,))]
        if c.qk_norm:
            out[me + "attn.q_norm.weight"] = [(hf + "self_attn.q_norm.weight", (hd,))]
            out[me + "attn.k_norm.weight"] = [(hf + "self_attn.k_norm.weight", (hd,))]
        i_sz = c.intermediate_size
        out[me + "mlp.gate_up.weight"] = [
            (hf + "mlp.gate_proj.weight", (i_sz, h)),
            (hf + "mlp.up_proj.weight", (i_sz, h)),
        ]
        out[me + "mlp.down.weight"] = [(hf + "mlp.down_proj.weight", (h, i_sz))]
        if c.mlp_bias:
            out[me + "mlp.gate_up.bias"] = [(hf + "mlp.gate_proj.bias", (i_sz,)), (hf + "mlp.up_proj.bias", (i_sz,))]
            out[me + "mlp.down.bias"] = [(hf + "mlp.down_proj.bias", (h,))]
    return out


def _ignorable(name: str, config: ModelConfig) -> bool:
    """Tensors some checkpoints carry that the model does not need."""
    return name.endswith(".rotary_emb.inv_freq") or (config.tie_word_embeddings and name == "lm_head.weight")


def _load_weights(
    folder: Path, config: ModelConfig, device: torch.device, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    where = _locate_tensors(folder)
    wanted = weight_map(config)
    needed = {name for parts in wanted.values() for name, _ in parts}
    missing = sorted(needed - where.keys())
    if missing:
        raise UserError(f"model folder {folder}: missing weight(s) {_names(missing)}")
    unexpected = sorted(n for n in where.keys() - needed if not _ignorable(n, config))
    if unexpected:
        raise UserError(
            f"model folder {folder}: unexpected weight(s) {_names(unexpected)} "
            f"(not a {config.model_type} checkpoint matching config.json?)"
        )
    handles = {}
    state = {}
    try:
        for mine, parts in wanted.items():
            tensors = []
            for name, shape in parts:
                file = where[name]
                if file not in handles:
                    handles[file] = safe_open(str(file), framework="pt", device="cpu")
                t = handles[file].get_tensor(name)
                if tuple(t.shape) != shape:
                    raise UserError(
                        f"model folder {folder}: weight {name} has shape {tuple(t.shape)}, config.json implies {shape}"
                    )
                tensors.append(t)
            t = tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)
            state[mine] = t.to(device=device, dtype=dtype)
    except (SafetensorError, OSError) as e:
        raise UserError(f"model folder {folder}: cannot read weights: {e}") from None
    return state


def _locate_tensors(folder: Path) -> dict[str, Path]:
    """Tensor name -> the .safetensors file that holds it (from the index when sharded)."""
    from safetensors import SafetensorError, safe_open

    index = folder / INDEX_FILE
    if index.is_file():
        try:
            mapping = json.loads(index.read_text())["weight_map"]
            assert isinstance(mapping, dict)
        except (OSError, ValueError, KeyError, TypeError, AssertionError):
            raise UserError(f"{index} is not a valid safetensors index (needs a 'weight_map' object)") from None
        files = {f: folder / f for f in set(mapping.values())}
        absent = sorted(f for f, p in files.items() if not p.is_file())
        if absent:
            raise UserError(f"model folder {folder}: shard(s) {', '.join(absent)} named in {INDEX_FILE} are missing")
        return {name: files[f] for name, f in mapping.items()}
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        other = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt")]
        hint = f" (found {', '.join(sorted(other))}: convert to safetensors)" if other else ""
        raise UserError(f"model folder {folder} has no *.safetensors weights{hint}")
    where = {}
    for shard in shards:
        try:
            with safe_open(str(shard), framework="pt", device="cpu") as h:
                for name in h.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                    where.setdefault(name, shard)
        except (SafetensorError, OSError) as e:
            raise UserError(f"model folder {folder}: cannot read {shard.name}: {e}") from None
    return where


def _names(names: list[str], shown: int = 5) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


# --- tokenizer, device, dtype ---------------------------------------------------------------


def load_tokenizer(path):
    """tokenizers.Tokenizer from tokenizer.json, or None when the folder has none (a
    sentencepiece-only folder counts as none: convert it with transformers first)."""
    file = Path(path) / "tokenizer.json"
    if not file.is_file():
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        raise UserError(f"{file} cannot be read as a tokenizer: {str(e).splitlines()[0]}") from None


def _dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise UserError(f"dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}")


def _device(device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise UserError(f"device {device!r} is not a torch device (use cpu or cuda[:N])") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device {device!r} asked for but CUDA is not available here; use --device cpu")
    if dev.type not in ("cpu", "cuda"):
        raise UserError(f"device {device!r} is not supported; use cpu or cuda[:N]")
    return dev
