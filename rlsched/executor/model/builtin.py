"""The built-in tiny model pair: a target trained on the synthetic task corpus and a drafter
distilled from it. Both are Llama-architecture HF folders with a character tokenizer.

Why trained and not random: speculative decoding's gain is set by how often the drafter
agrees with the target, and a random pair agrees by chance only. A target that learned the
tasks (count, add, sort, reverse, repeat) is confident where the text is predictable and
unsure where it is not (the random numbers of a prompt); a drafter distilled from it with
KL(p_target || q_drafter) then agrees often but not always: realistic acceptance, realistic
variation from prompt to prompt.

The shapes are chosen for the CPU: at batch 1 a forward costs about the same per layer
whatever its width (kernel launches, not FLOPs), so the 16-layer target costs several times
the 2-layer drafter, as a 7B target costs several times a 0.5B drafter on a GPU.

Where the pair comes from: the package ships the default recipe's pair (folder
`builtin_pair/` beside this module: `target/`, `drafter/` and `build.json`, which holds the
recipe and its hash), its weights stored in bfloat16 and loaded in whatever dtype is asked for.
It is read-only: nothing writes there. Any other recipe (`WIDE`, or a changed default) is
built on first use and cached in `$RLSCHED_CACHE` or `~/.cache/rlsched`, folder
`builtin-<recipe hash>`; concurrent first uses wait on a lock and build once.

Regenerating the shipped pair (after changing the recipe or the training code), from the
repository root:

    python -m rlsched.executor.model.builtin --export rlsched/executor/model/builtin_pair

builds the recipe into the cache (or reuses a cached build of it: point `RLSCHED_CACHE` at an
empty folder to train afresh) and writes the bfloat16 copy.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from rlsched.atomic import atomic_folder
from rlsched.executor.model.saving import TOKENIZER_FILES, save_model
from rlsched.executor.model.transformer import ModelConfig, Transformer
from rlsched.tasks.synthetic import ALPHABET, make_examples

SPECIALS = ("<pad>", "<eos>", "<unk>")
PAD, EOS = 0, 1


@dataclass(frozen=True)
class Recipe:
    """Everything that decides the built pair; its hash names the cache folder."""

    vocab_size: int = 64
    max_len: int = 256
    target: tuple = (
        ("hidden_size", 128),
        ("intermediate_size", 384),
        ("num_layers", 16),
        ("num_heads", 4),
        ("num_kv_heads", 2),
    )
    drafter: tuple = (
        ("hidden_size", 128),
        ("intermediate_size", 384),
        ("num_layers", 2),
        ("num_heads", 4),
        ("num_kv_heads", 2),
    )
    # progressive stacking: (layers, steps) per stage, each stage's layers its predecessor's
    # stacked twice; the last stage is the target
    stages: tuple = ((4, 1200), (8, 400), (16, 400))
    drafter_steps: int = 400
    batch: int = 32
    lr: float = 1e-3  # 2e-3 and more stalled 4-8 layer targets in trials
    deep_lr: float = 5e-4
    drafter_lr: float = 1e-3
    seed: int = 0
    version: int = 1

    def __post_init__(self):
        if dict(self.target)["num_layers"] != self.stages[-1][0]:
            raise ValueError(
                f"Recipe: the target has {dict(self.target)['num_layers']} layers but the last "
                f"stacking stage trains {self.stages[-1][0]}; make them equal"
            )

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:10]

    def model_config(self, which: str, layers: int | None = None) -> ModelConfig:
        d = dict(self.target if which == "target" else self.drafter)
        if layers is not None:
            d["num_layers"] = layers
        return ModelConfig(
            vocab_size=self.vocab_size,
            head_dim=d["hidden_size"] // d["num_heads"],
            max_position_embeddings=self.max_len,
            tie_word_embeddings=True,
            rope_theta=10000.0,
            rms_norm_eps=1e-6,
            **d,
        )


# The same recipe twice as wide (target and drafter: the drafter starts from the target's first
# layers), for the drain benchmark (bench/engine.py, section drain_wide). On the CPU a verify of
# several tokens a row at many rows costs more, relative to one token's, than on the default
# target: nearer a GPU at a large batch, where the k that pays at the head of a drain (many rows)
# and at its tail (one row) differ most. Not shipped: built on first use.
WIDE = Recipe(
    target=(
        ("hidden_size", 256),
        ("intermediate_size", 768),
        ("num_layers", 16),
        ("num_heads", 4),
        ("num_kv_heads", 2),
    ),
    drafter=(
        ("hidden_size", 256),
        ("intermediate_size", 768),
        ("num_layers", 2),
        ("num_heads", 4),
        ("num_kv_heads", 2),
    ),
)


@dataclass(frozen=True)
class BuiltinPair:
    target: Path
    drafter: Path
    info: dict


def cache_root() -> Path:
    return Path(os.environ.get("RLSCHED_CACHE") or Path.home() / ".cache" / "rlsched")


SHIPPED = Path(__file__).with_name("builtin_pair")  # the default recipe's pair, bfloat16 weights
SHIPPED_DTYPE = torch.bfloat16


def shipped_pair() -> BuiltinPair | None:
    """The pair shipped with the package, or None where the package has none."""
    info_file = SHIPPED / "build.json"
    if not info_file.is_file():
        return None
    return BuiltinPair(SHIPPED / "target", SHIPPED / "drafter", json.loads(info_file.read_text()))


def builtin_pair(recipe: Recipe = Recipe(), *, log=None) -> BuiltinPair:
    """The pair's folders: the shipped ones when they were built from `recipe` (nothing is
    built or written), else `built_pair(recipe)`."""
    shipped = shipped_pair()
    if shipped is not None and shipped.info.get("key") == recipe.key():
        return shipped
    return built_pair(recipe, log=log)


def built_pair(recipe: Recipe = Recipe(), *, log=None) -> BuiltinPair:
    """The pair built from `recipe` in the cache (fp32 weights), building it first if this
    machine has none cached. Never the shipped pair."""

    def build(folder: Path) -> None:
        with atomic_folder(folder) as tmp:
            _build(recipe, tmp, log or (lambda msg: None))

    folder = cached_build(f"builtin-{recipe.key()}", build)
    info = json.loads((folder / "build.json").read_text())
    return BuiltinPair(folder / "target", folder / "drafter", info)


def cached_build(name: str, build) -> Path:
    """The cache's folder `name` (`cache_root`), made by `build(folder)` unless it already holds
    a build.json: concurrent first uses wait on a lock and build once."""
    root = cache_root()
    folder = root / name
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / "build.json").is_file():
            build(folder)
    return folder


def export_builtin(dest, recipe: Recipe = Recipe(), *, log=None) -> Path:
    """Write the pair built from `recipe` (`built_pair`: the cached build, or a fresh one) to
    folder `dest` (replaced whole) with its weights in bfloat16: what the package ships in
    `SHIPPED`. Returns `dest`."""
    import shutil

    from safetensors.torch import load_file, save_file

    pair = built_pair(recipe, log=log)
    dest = Path(dest)
    dtype_name = str(SHIPPED_DTYPE).removeprefix("torch.")
    with atomic_folder(dest) as tmp:
        for which in ("target", "drafter"):
            src, out = getattr(pair, which), tmp / which
            out.mkdir()
            weights = load_file(str(src / "model.safetensors"))
            save_file(
                {name: t.to(SHIPPED_DTYPE).contiguous() for name, t in weights.items()},
                str(out / "model.safetensors"),
                metadata={"format": "pt"},
            )
            os.chmod(out / "model.safetensors", 0o644)  # as the other files (safetensors writes 0600)
            config = json.loads((src / "config.json").read_text())
            config["torch_dtype"] = dtype_name
            (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            for name in TOKENIZER_FILES:
                if (src / name).is_file():
                    shutil.copyfile(src / name, out / name)
        info = {**pair.info, "weights_dtype": dtype_name}
        (tmp / "build.json").write_text(json.dumps(info, indent=2) + "\n")
    if log:
        log(f"exported the pair of recipe {recipe.key()} to {dest} ({dtype_name} weights)")
    return dest


# --- tokenizer ------------------------------------------------------------------------------


def write_tokenizer(folder: Path, vocab_size: int) -> None:
    """A character-level `tokenizers` tokenizer (tokenizer.json) that transformers and vLLM
    also load (tokenizer_config.json names PreTrainedTokenizerFast)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    symbols = list(SPECIALS) + list(ALPHABET)
    assert len(symbols) <= vocab_size
    tok = Tokenizer(models.WordLevel({s: i for i, s in enumerate(symbols)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIALS))
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<eos>",
                "pad_token": "<pad>",
                "unk_token": "<unk>",
                "model_max_length": 256,
                "clean_up_tokenization_spaces": False,
            },
            indent=2,
        )
        + "\n"
    )


def encode(text: str) -> list[int]:
    """Token ids of `text` under the built-in tokenizer (the same mapping as tokenizer.json)."""
    index = {c: i + len(SPECIALS) for i, c in enumerate(ALPHABET)}
    return [index.get(c, SPECIALS.index("<unk>")) for c in text]


def decode(ids) -> str:
    """Text of `ids`; special tokens and the unused ids past the alphabet (a model sampling at
    temperature > 0 can draw them) are skipped, as `skip_special_tokens` does."""
    n = len(SPECIALS)
    return "".join(ALPHABET[i - n] for i in ids if n <= i < n + len(ALPHABET))


# --- training -------------------------------------------------------------------------------


def _batches(recipe: Recipe, steps: int, seed: int, chunk: int = 16):
    """`steps` batches of task texts (prompt, answer, <eos>), right-padded, with a mask of the
    positions whose next token is part of the answer (the loss is taken there only: the
    prompts' random digits and letters cannot be predicted, and learning them would take
    most of a small model's training). Texts of similar length share a batch (sorted within
    chunks of `chunk` batches), which halves padding."""
    texts = [(encode(e.prompt), encode(e.answer) + [EOS]) for e in make_examples(steps * recipe.batch, seed)]
    order = torch.randperm(steps, generator=torch.Generator().manual_seed(seed)).tolist()
    batches = []
    for c in range(0, len(texts), chunk * recipe.batch):
        group = sorted(texts[c : c + chunk * recipe.batch], key=lambda t: len(t[0]) + len(t[1]))
        batches += [group[i : i + recipe.batch] for i in range(0, len(group), recipe.batch)]
    from rlsched.executor.rl.algos import make_batch

    for s in order:
        b = make_batch([p for p, _ in batches[s]], [a for _, a in batches[s]], None, PAD)
        yield b.ids, b.mask


def lr_schedule(step: int, total: int, warmup: int = 30) -> float:
    """The learning-rate factor at `step` of `total`: a linear warm-up over `warmup` steps, then
    a cosine decay to a tenth."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def init_weights(model: Transformer, std: float = 0.02) -> None:
    """GPT-2 style: normal(0, std) weights, residual outputs scaled by 1/sqrt(2 * layers),
    zero biases; without it the tied embedding gives huge first logits."""
    out_std = std / math.sqrt(2 * model.config.num_layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                continue
            if name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0, out_std if name.endswith(("attn.o.weight", "mlp.down.weight")) else std)


def _train(model: Transformer, recipe: Recipe, steps: int, seed: int, lr: float, loss_fn, log, what: str) -> float:
    model.train().requires_grad_(True)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_schedule(s, steps))
    recent = []
    for i, (ids, answer) in enumerate(_batches(recipe, steps, seed)):
        loss = loss_fn(model, ids, answer)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        recent = (recent + [loss.item()])[-50:]
        if (i + 1) % 100 == 0 or i + 1 == steps:
            log(f"{what}: step {i + 1}/{steps}, loss {sum(recent) / len(recent):.3f}")
    model.eval().requires_grad_(False)
    return sum(recent) / len(recent)


def lm_loss(model: Transformer, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy where `mask` (B, T-1) is set."""
    logits = model(ids[:, :-1])
    targets = ids[:, 1:].masked_fill(~mask, -100)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)


def distill_loss(target: Transformer, drafter: Transformer, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of KL(p_target || q_drafter) over the positions where `mask` is set."""
    with torch.no_grad():
        logp = F.log_softmax(target(ids[:, :-1]), -1)
    logq = F.log_softmax(drafter(ids[:, :-1]), -1)
    kl = (logp.exp() * (logp - logq)).sum(-1)
    keep = mask.float()
    return (kl * keep).sum() / keep.sum()


def _fresh(config: ModelConfig) -> Transformer:
    m = Transformer(config)
    m.rope.materialize("cpu")
    init_weights(m)
    return m


def _copy_layers(dst: Transformer, src: Transformer, layer_map: list[int]) -> None:
    """dst's embedding and final norm from src, and dst layer i from src layer layer_map[i]."""
    with torch.no_grad():
        dst.embed.weight.copy_(src.embed.weight)
        dst.norm.weight.copy_(src.norm.weight)
        for i, j in enumerate(layer_map):
            dst.layers[i].load_state_dict(src.layers[j].state_dict())


def _build(recipe: Recipe, out: Path, log) -> None:
    """Progressive stacking (Gong et al., 2019): a shallow target learns the tasks, its layers
    are stacked to twice the depth and the deep model trains on, and again; a deep model from
    scratch learned far slower on 2 cores. The drafter starts from the target's first layers and is
    distilled from it (two layers: copying from the prompt needs an induction circuit, which
    one layer cannot form)."""
    start = time.perf_counter()
    log(f"building the built-in model pair of recipe {recipe.key()} in {out.parent} (once; minutes on a few cores)")
    torch.manual_seed(recipe.seed)
    (first, steps), *stacked = recipe.stages
    target = _fresh(recipe.model_config("target", first))
    t_loss = _train(target, recipe, steps, recipe.seed, recipe.lr, lm_loss, log, f"target ({first} layers)")
    for stage, (layers, steps) in enumerate(stacked):
        shallow, target = target, _fresh(recipe.model_config("target", layers))
        _copy_layers(target, shallow, [i % shallow.config.num_layers for i in range(layers)])
        t_loss = _train(
            target,
            recipe,
            steps,
            recipe.seed + 2 + stage,
            recipe.deep_lr,
            lm_loss,
            log,
            f"target ({layers} layers, stacked)",
        )
    t_time = time.perf_counter() - start
    torch.manual_seed(recipe.seed + 1)
    drafter = _fresh(recipe.model_config("drafter"))
    _copy_layers(drafter, target, list(range(drafter.config.num_layers)))
    d_loss = _train(
        drafter,
        recipe,
        recipe.drafter_steps,
        recipe.seed + 1,
        recipe.drafter_lr,
        lambda m, ids, mask: distill_loss(target, m, ids, mask),
        log,
        "drafter",
    )
    tok = out / "tokenizer"
    write_tokenizer(tok, recipe.vocab_size)
    extra = {"eos_token_id": EOS, "pad_token_id": PAD, "bos_token_id": None}
    save_model(target, out / "target", tokenizer_from=tok, extra_config=extra)
    save_model(drafter, out / "drafter", tokenizer_from=tok, extra_config=extra)
    info = {
        "recipe": asdict(recipe),
        "key": recipe.key(),
        "target_loss": t_loss,
        "drafter_kl": d_loss,
        "target_seconds": t_time,
        "seconds": time.perf_counter() - start,
        "target_params": sum(p.numel() for p in target.parameters()),
        "drafter_params": sum(p.numel() for p in drafter.parameters()),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "built": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    (out / "build.json").write_text(json.dumps(info, indent=2) + "\n")
    log(f"built in {info['seconds']:.0f} s: target loss {t_loss:.3f}, drafter KL {d_loss:.3f}")


def main(argv=None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description="The built-in model pair of the default recipe.")
    ap.add_argument(
        "--export",
        metavar="DIR",
        required=True,
        help="write the pair, weights in bfloat16, to DIR (what the package ships: "
        "rlsched/executor/model/builtin_pair); builds it into the cache first if absent",
    )
    args = ap.parse_args(argv)
    export_builtin(args.export, log=print)


if __name__ == "__main__":
    main()
