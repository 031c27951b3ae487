"""Rewards of RL samples: `resolve_reward(spec)` -> a `RewardFunction` whose `score(items)`
returns one float per sample, NaN where the reward failed.

Specs:

- `exact_match`: 1.0 when the response (stripped) is the reference answer, else 0.0.
- `math`: the final answer of the response (the last `\\boxed{...}`, else the last number)
  compared with the reference numerically (relative tolerance 1e-6), else as normalised text.
- `pkg.mod:fn` or `path/to/file.py:fn`: a user function `fn(prompt, response, answer) -> float`
  called per sample; with `fn.batched = True` it is called once with three lists and returns
  one float per sample.
- `model:DIR`: a local HF `*ForSequenceClassification` folder with one label (a reward model),
  run on this project's transformer: the score head applied to the final hidden state of the
  last token of prompt + response.

A sample whose reward cannot be computed (no reference answer, the user function raised or
returned something that is not a finite number) is marked failed with a one-line reason; the
other samples are still scored, so one bad sample never loses a batch. A spec that cannot be
resolved (unknown name, import failure, missing function or folder) is a `UserError`.

Only the `model:` reward imports torch, and only when resolved.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import inspect
import json
import math
import numbers
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rlsched.errors import UserError
from rlsched.executor.rl.math_answers import math_reward
from rlsched.tasks.synthetic import exact_match

BUILTIN = ("exact_match", "math")
SPEC_HELP = "exact_match, math, pkg.module:function, path/to/file.py:function or model:DIR"


@dataclass(frozen=True)
class RewardInput:
    """One sample to score."""

    prompt: str
    response: str
    answer: str | None  # reference answer, when the dataset has one
    prompt_id: int
    sample_id: int


@dataclass
class RewardBatch:
    rewards: np.ndarray  # float64, NaN where failed
    failed: np.ndarray  # bool
    errors: list[str]  # one line per failed sample: "sample 3 (prompt 1): ValueError: ..."

    @classmethod
    def empty(cls, n: int) -> RewardBatch:
        return cls(np.full(n, np.nan), np.zeros(n, dtype=bool), [])

    def fail(self, i: int, item: RewardInput, reason: str) -> None:
        self.rewards[i] = np.nan
        self.failed[i] = True
        self.errors.append(f"{_who(item)}: {reason}")


class RewardFunction:
    """Scores samples; `name` is the spec it was resolved from."""

    name: str

    def score(self, items: list[RewardInput]) -> RewardBatch:
        raise NotImplementedError


def resolve_reward(spec: str, *, device="cpu") -> RewardFunction:
    """The reward function of `spec` (see the module's docstring); `device` is where a reward
    model runs."""
    if not isinstance(spec, str) or not spec.strip():
        raise UserError(f"reward {spec!r} is empty; give one of {SPEC_HELP}")
    spec = spec.strip()
    if spec == "exact_match":
        return _PerSample(spec, lambda prompt, response, answer: exact_match(response, answer), needs_answer=True)
    if spec == "math":
        return _PerSample(spec, math_reward, needs_answer=True)
    if spec.startswith("model:"):
        return RewardModel(spec[len("model:") :], device=device, name=spec)
    if ":" not in spec:
        raise UserError(f"reward {spec!r} is not known; give one of {SPEC_HELP}")
    return _user_function(spec)


def _who(item: RewardInput) -> str:
    return f"sample {item.sample_id} (prompt {item.prompt_id})"


def _one_line(e: BaseException | str, limit: int = 200) -> str:
    if isinstance(e, BaseException):
        text = str(e).strip().splitlines()
        text = f"{type(e).__name__}: {text[0]}" if text else type(e).__name__
    else:
        text = e
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _BadValue(Exception):
    pass


def _as_reward(value) -> float:
    """`value` as a finite float, or _BadValue saying what it was."""
    if not isinstance(value, numbers.Real) and getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        value = value.item()  # a 0-d numpy array or torch tensor
    if not isinstance(value, numbers.Real):
        shown = repr(value)
        shown = shown if len(shown) <= 40 else shown[:37] + "..."
        raise _BadValue(f"returned {type(value).__name__} {shown}, not a number")
    x = float(value)
    if not math.isfinite(x):
        raise _BadValue(f"returned {x}, not a finite number")
    return x


# --- per-sample and batched functions -------------------------------------------------------


class _PerSample(RewardFunction):
    """`fn(prompt, response, answer) -> float` called once per sample."""

    def __init__(self, name: str, fn: Callable, needs_answer: bool = False):
        self.name, self.fn, self.needs_answer = name, fn, needs_answer

    def score(self, items: list[RewardInput]) -> RewardBatch:
        out = RewardBatch.empty(len(items))
        for i, item in enumerate(items):
            if self.needs_answer and item.answer is None:
                out.fail(
                    i,
                    item,
                    f'the dataset lacks an "answer" for this prompt, which the {self.name} '
                    'reward needs (add an "answer" field to every line)',
                )
                continue
            try:
                out.rewards[i] = _as_reward(self.fn(item.prompt, item.response, item.answer))
            except _BadValue as e:
                out.fail(i, item, f"{self.name} {e}")
            except Exception as e:  # a user's bug fails this sample, not the batch
                out.fail(i, item, _one_line(e))
        return out


class _Batched(RewardFunction):
    """`fn(prompts, responses, answers) -> sequence of floats`, called once per batch."""

    def __init__(self, name: str, fn: Callable):
        self.name, self.fn = name, fn

    def score(self, items: list[RewardInput]) -> RewardBatch:
        out = RewardBatch.empty(len(items))
        if not items:
            return out
        try:
            values = self.fn([it.prompt for it in items], [it.response for it in items], [it.answer for it in items])
            if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
                raise _BadValue(f"returned {type(values).__name__}, not a sequence of {len(items)} floats")
            values = list(values)
            if len(values) != len(items):
                raise _BadValue(f"returned {len(values)} values for {len(items)} samples")
        except Exception as e:
            why = f"{self.name} {e}" if isinstance(e, _BadValue) else _one_line(e)
            for i, item in enumerate(items):
                out.fail(i, item, f"batched reward failed: {why}")
            return out
        for i, (item, v) in enumerate(zip(items, values)):
            try:
                out.rewards[i] = _as_reward(v)
            except _BadValue as e:
                out.fail(i, item, f"{self.name} {e}")
        return out


def _user_function(spec: str) -> RewardFunction:
    target, _, attr = spec.rpartition(":")
    fix = "give pkg.module:function (importable) or path/to/file.py:function"
    if not target or not attr.isidentifier():
        raise UserError(f"reward {spec!r} is not of the form module:function; {fix}")
    if target.endswith(".py") or "/" in target or os.sep in target:
        module = _import_file(spec, Path(target))
    else:
        if os.getcwd() not in sys.path and "" not in sys.path:
            sys.path.append(os.getcwd())  # as `python -m` would: modules next to the run
        try:
            module = importlib.import_module(target)
        except Exception as e:
            raise UserError(
                f"reward {spec!r}: cannot import module {target!r} ({_one_line(e)}); check it is "
                f"on PYTHONPATH, or {fix}"
            ) from None
    if not hasattr(module, attr):
        raise UserError(
            f"reward {spec!r}: module {target!r} has no attribute {attr!r}; define "
            f"`def {attr}(prompt, response, answer) -> float` there or fix the name"
        )
    fn = getattr(module, attr)
    if not callable(fn):
        raise UserError(
            f"reward {spec!r}: {attr!r} is a {type(fn).__name__}, not a function; it must be "
            "`def f(prompt, response, answer) -> float`"
        )
    batched = getattr(fn, "batched", False) is True
    try:
        inspect.signature(fn).bind("prompt", "response", "answer")
    except TypeError:
        args = "(prompts, responses, answers) lists" if batched else "(prompt, response, answer)"
        raise UserError(f"reward {spec!r}: {attr} must accept three positional arguments {args}") from None
    except ValueError:
        pass  # no signature to check (some builtins)
    return _Batched(spec, fn) if batched else _PerSample(spec, fn)


def _import_file(spec: str, path: Path):
    if not path.is_file():
        raise UserError(
            f"reward {spec!r}: file {path} does not exist; give path/to/file.py:function "
            "(relative to the working directory) or pkg.module:function"
        )
    path = path.resolve()
    name = "rlsched_reward_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    loader_spec = importlib.util.spec_from_file_location(name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise UserError(f"reward {spec!r}: {path} cannot be imported as a Python file")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module
    try:
        loader_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise UserError(f"reward {spec!r}: importing {path} failed ({_one_line(e)}); fix the file") from None
    return module


# --- reward model ---------------------------------------------------------------------------


class RewardModel(RewardFunction):
    """A local HF sequence-classification folder (num_labels 1) on this project's transformer.

    The backbone is read with loading.py's config and weight-name mapping (as a tied model, so
    no lm_head is needed); `score.weight` (and `score.bias`) separately. A sample's score is
    the head applied to the final hidden state of the last token of prompt + response, encoded
    with the folder's tokenizer.json without special tokens; rows are right-padded in batches
    of `batch_size`, sorted by length, and read at their own last token."""

    def __init__(self, folder, *, device="cpu", batch_size: int = 32, name: str | None = None):
        try:
            import torch
        except ImportError:
            raise UserError("the model: reward needs torch; pip install 'rlsched[executor]'") from None
        from rlsched.executor.model import loading
        from rlsched.executor.model.transformer import Transformer

        folder = Path(folder)
        if not str(folder).strip() or str(folder) == ".":
            raise UserError("reward model: give a folder, as model:path/to/reward-model")
        self.name = name or f"model:{folder}"
        self.folder, self.batch_size = folder, batch_size
        self.device = loading._device(device)
        config = loading.load_config(folder)  # the folder's and config.json's checks and messages
        raw = json.loads((folder / "config.json").read_text())
        _check_classifier(raw, folder)
        # the backbone only: read as a tied model, so no lm_head is expected
        self.config = config = dataclasses.replace(config, tie_word_embeddings=True)
        self.tokenizer = loading.load_tokenizer(folder)
        if self.tokenizer is None:
            raise UserError(
                f"reward model folder {folder} has no tokenizer.json (convert its tokenizer "
                "with transformers: AutoTokenizer.from_pretrained(...).save_pretrained(...))"
            )
        pad = raw.get("pad_token_id")
        self.pad_id = pad if isinstance(pad, int) and 0 <= pad < config.vocab_size else 0
        state, head_w, head_b = _load_reward_weights(folder, config, self.device)
        with torch.device("meta"):
            model = Transformer(config)
        model.load_state_dict(state, strict=True, assign=True)
        model.rope.materialize(self.device)
        self.model = model.eval().requires_grad_(False)
        self.head_w, self.head_b = head_w, head_b

    def score(self, items: list[RewardInput]) -> RewardBatch:
        import torch

        out = RewardBatch.empty(len(items))
        rows = []
        window, vocab = self.config.sliding_window, self.config.vocab_size
        for i, item in enumerate(items):
            ids = self.tokenizer.encode(item.prompt + item.response, add_special_tokens=False).ids
            if not ids:
                out.fail(i, item, "prompt + response is empty; a reward model needs at least one token")
            elif max(ids) >= vocab:
                out.fail(
                    i,
                    item,
                    f"token id {max(ids)} is outside the reward model's vocabulary ({vocab}); "
                    "its tokenizer.json does not match config.json",
                )
            elif window is not None and len(ids) > window:
                out.fail(i, item, f"{len(ids)} tokens exceed the reward model's sliding window ({window})")
            else:
                rows.append((i, ids))
        rows.sort(key=lambda r: len(r[1]), reverse=True)
        with torch.inference_mode():
            for start in range(0, len(rows), self.batch_size):
                chunk = rows[start : start + self.batch_size]
                width = len(chunk[0][1])
                ids = torch.full((len(chunk), width), self.pad_id, dtype=torch.long)
                for r, (_, seq) in enumerate(chunk):
                    ids[r, : len(seq)] = torch.tensor(seq)
                last = torch.tensor([len(seq) - 1 for _, seq in chunk], device=self.device)
                h = self.model.features(ids.to(self.device))
                h = h[torch.arange(len(chunk), device=self.device), last]
                scores = torch.nn.functional.linear(h, self.head_w, self.head_b)[:, 0].float().cpu().numpy()
                for (i, _), s in zip(chunk, scores):
                    if math.isfinite(float(s)):
                        out.rewards[i] = float(s)
                    else:
                        out.fail(i, items[i], f"reward model gave {float(s)}")
        return out


def _check_classifier(raw: dict, folder: Path) -> None:
    """A UserError unless config.json describes a one-label sequence classifier."""
    where = folder / "config.json"
    arch = raw.get("architectures")
    if isinstance(arch, list) and arch and not any(str(a).endswith("ForSequenceClassification") for a in arch):
        raise UserError(
            f"{where}: field 'architectures' is {arch}; a reward model is a "
            "*ForSequenceClassification folder (one score head), not a causal LM"
        )
    labels = raw.get("num_labels")
    field = "num_labels"
    if labels is None and isinstance(raw.get("id2label"), dict):
        labels, field = len(raw["id2label"]), "id2label"
    if labels is not None and labels != 1:
        raise UserError(
            f"{where}: field '{field}' gives {labels} labels; a reward model needs num_labels=1 "
            "(one score per sequence)"
        )


def _load_reward_weights(folder: Path, config, device):
    """The backbone's state dict (our parameter names) and the score head's weight and bias."""
    import torch
    from safetensors import SafetensorError, safe_open

    from rlsched.executor.model.loading import _locate_tensors, _names, weight_map

    where = _locate_tensors(folder)
    if "score.weight" not in where:
        raise UserError(
            f"reward model folder {folder} has no score.weight; a reward model is a "
            "*ForSequenceClassification checkpoint (save it with save_pretrained)"
        )
    wanted = weight_map(config)
    needed = {name for parts in wanted.values() for name, _ in parts}
    missing = sorted(needed - where.keys())
    if missing:
        raise UserError(f"reward model folder {folder}: missing weight(s) {_names(missing)}")
    known = needed | {"score.weight", "score.bias", "lm_head.weight"}
    unexpected = sorted(n for n in where.keys() - known if not n.endswith(".rotary_emb.inv_freq"))
    if unexpected:
        raise UserError(
            f"reward model folder {folder}: unexpected weight(s) {_names(unexpected)} "
            f"(not a {config.model_type} checkpoint matching config.json?)"
        )
    handles = {}

    def get(name):
        file = where[name]
        if file not in handles:
            handles[file] = safe_open(str(file), framework="pt", device="cpu")
        return handles[file].get_tensor(name)

    h = config.hidden_size
    try:
        state = {}
        for mine, parts in wanted.items():
            tensors = []
            for name, shape in parts:
                t = get(name)
                if tuple(t.shape) != shape:
                    raise UserError(
                        f"reward model folder {folder}: weight {name} has shape {tuple(t.shape)}, "
                        f"config.json implies {shape}"
                    )
                tensors.append(t)
            t = tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)
            state[mine] = t.to(device=device, dtype=torch.float32)
        w = get("score.weight")
        b = get("score.bias") if "score.bias" in where else None
    except (SafetensorError, OSError) as e:
        raise UserError(f"reward model folder {folder}: cannot read weights: {e}") from None
    if tuple(w.shape) != (1, h):
        raise UserError(
            f"reward model folder {folder}: score.weight has shape {tuple(w.shape)} "
            f"(num_labels={w.shape[0]}); a reward model needs num_labels=1, shape (1, {h})"
        )
    if b is not None and tuple(b.shape) != (1,):
        raise UserError(f"reward model folder {folder}: score.bias has shape {tuple(b.shape)}, expected (1,)")
    w = w.to(device=device, dtype=torch.float32)
    b = None if b is None else b.to(device=device, dtype=torch.float32)
    return state, w, b
