"""The built-in pair's EAGLE-3 head: trained on the built-in target's answers to task prompts
on first use and cached, like the pair itself (`model/builtin.py`)."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from rlsched.executor.decode.eagle import EagleHead, HeadConfig, save_head
from rlsched.executor.decode.eagle_train import frequent_tokens, target_responses, train_head
from rlsched.executor.decode.sampling import SamplingParams
from rlsched.executor.model.builtin import cached_build


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
