"""Prompt sources of an RL run, whose order is a pure function of (seed, step).

`source.batch(step, size)` returns the prompts of RL step `step` and depends on nothing but
the seed, the step and the size: a run resumed at step s draws exactly the prompts the
uninterrupted run would have, with no sampler state to checkpoint.

- `builtin_tasks(tasks, seed)`: an endless stream of synthetic task examples
  (rlsched.tasks.synthetic), each step's drawn from its own generator seeded by (seed, step).
- `jsonl_dataset(path, seed)`: a JSONL file ({"prompt": str, "answer"?: str, "id"?: str|int}
  per line) read in epochs; epoch e is a permutation seeded by (seed, e), and step s takes
  items s*size .. s*size+size-1 of the epochs laid end to end, so every item is drawn once per
  epoch and a batch that crosses an epoch's end continues into the next.
- `builtin_set(tasks, n, seed)`: a fixed set of n such examples, read in epochs like a file.
- `make_source(spec, seed)`: "builtin", "builtin:count,repeat,rev", "builtin:count,repeat@64"
  (a fixed set) or a path to a JSONL file.

`prompt_key(text)` is a prompt's id across steps and epochs.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from rlsched.errors import UserError
from rlsched.executor.prompts import load_prompts
from rlsched.tasks.synthetic import TASKS, make_example

# Streams are seeded by SeedSequence(seed, spawn_key=(tag, n)): the tag keeps the data order
# independent of anything else a run seeds from (seed, step), such as its sampling.
_BUILTIN_TAG = 0x64617461  # "data"
_EPOCH_TAG = 0x65706F63  # "epoc"
_SET_TAG = 0x73657420  # "set "


@dataclass(frozen=True)
class Item:
    prompt: str
    answer: str | None
    key: str  # the file's "id" (else its line number), or "step.index" for built-in tasks
    task: str | None  # the built-in task's name; None for a file


def prompt_key(text: str) -> int:
    """A prompt's id across steps and epochs (the n-gram history and acceptance key by it)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little")


def _rng(seed: int, tag: int, n: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(seed % 2**64, spawn_key=(tag, n)))


def _check(step: int, size: int) -> None:
    if step < 0 or size < 1:
        raise ValueError(f"batch(step={step}, size={size}): step must be >= 0 and size >= 1")


class PromptSource:
    """The prompts of each RL step; `size` is the number of distinct items (None: endless)."""

    size: int | None = None

    def __len__(self) -> int:
        if self.size is None:
            raise TypeError(f"{type(self).__name__} is endless; read .size (None) instead of len()")
        return self.size

    def __bool__(self) -> bool:
        return True

    def batch(self, step: int, size: int) -> list[Item]:
        raise NotImplementedError


class BuiltinTasks(PromptSource):
    """Endless synthetic task examples; step s's are drawn from a generator seeded by (seed, s)."""

    def __init__(self, tasks: tuple[str, ...], seed: int):
        tasks = tuple(tasks)
        unknown = [t for t in tasks if t not in TASKS]
        if unknown or not tasks:
            what = f"unknown built-in task(s) {', '.join(map(repr, unknown))}" if unknown else "no built-in task given"
            raise UserError(f"{what}; known: {', '.join(TASKS)} (as builtin:count,repeat,rev)")
        self.tasks, self.seed = tasks, seed

    def batch(self, step: int, size: int) -> list[Item]:
        _check(step, size)
        rng = _rng(self.seed, _BUILTIN_TAG, step)
        out = []
        for i in range(size):
            e = make_example(rng, self.tasks)
            out.append(Item(e.prompt, e.answer, f"{step}.{i}", e.task))
        return out


class EpochSource(PromptSource):
    """A fixed list of items drawn in seeded epochs (see the module's docstring)."""

    def __init__(self, items: list[Item], seed: int, shuffle: bool = True):
        self.items, self.seed, self.shuffle = items, seed, shuffle
        self.size = len(items)
        self._orders: dict[int, np.ndarray] = {}

    def order(self, epoch: int) -> np.ndarray:
        """The item indices of epoch `epoch`, in draw order."""
        if epoch not in self._orders:
            if len(self._orders) >= 4:  # a step touches one or two epochs: keep a few
                self._orders.pop(next(iter(self._orders)))
            n = self.size
            self._orders[epoch] = _rng(self.seed, _EPOCH_TAG, epoch).permutation(n) if self.shuffle else np.arange(n)
        return self._orders[epoch]

    def batch(self, step: int, size: int) -> list[Item]:
        _check(step, size)
        n = self.size
        out = []
        for g in range(step * size, step * size + size):
            epoch, pos = divmod(g, n)
            out.append(self.items[int(self.order(epoch)[pos])])
        return out


class JsonlDataset(EpochSource):
    """A JSONL file's prompts in seeded epochs."""

    def __init__(self, path, seed: int, shuffle: bool = True):
        self.path = Path(path)
        super().__init__(_read_jsonl(self.path), seed, shuffle)


def builtin_set(tasks: tuple[str, ...], n: int, seed: int) -> PromptSource:
    """A fixed training set of `n` built-in task examples (drawn once from the seed), read in
    epochs as a dataset is: RL revisits each prompt every epoch."""
    BuiltinTasks(tasks, seed)  # checks the names
    rng = _rng(seed, _SET_TAG, n)
    items = []
    for i in range(n):
        e = make_example(rng, tuple(tasks))
        items.append(Item(e.prompt, e.answer, f"set.{i}", e.task))
    return EpochSource(items, seed)


def builtin_tasks(tasks: tuple[str, ...], seed: int) -> PromptSource:
    return BuiltinTasks(tasks, seed)


def jsonl_dataset(path, seed: int, shuffle: bool = True) -> PromptSource:
    return JsonlDataset(path, seed, shuffle)


def make_source(spec: str, seed: int) -> PromptSource:
    """ "builtin" (every task), "builtin:count,repeat,rev" (those tasks), either with "@N" (a
    fixed set of N examples read in epochs, as "builtin:count,repeat@64"), or a JSONL file."""
    spec = str(spec).strip()
    if spec == "builtin" or spec.startswith(("builtin:", "builtin@")):
        rest, _, size = spec[len("builtin") :].partition("@")
        names = tuple(t.strip() for t in rest[1:].split(",") if t.strip()) if rest.startswith(":") else tuple(TASKS)
        if not size:
            return builtin_tasks(names, seed)
        if not size.strip().isdigit() or int(size) < 1:
            raise UserError(
                f"data '{spec}': the set size after '@' must be a whole number >= 1 (as builtin:count,repeat@64)"
            )
        return builtin_set(names, int(size), seed)
    return jsonl_dataset(spec, seed)


class _NoTokens:
    """load_prompts tokenizes each prompt; data sources only need the text."""

    _none = SimpleNamespace(ids=[])

    def encode(self, text, add_special_tokens=False):
        return self._none


def _read_jsonl(path: Path) -> list[Item]:
    """The file's items, checked as every prompts file is (file, line number, fix)."""
    if not path.is_file():
        raise UserError(
            f'prompts file {path} does not exist (give a JSONL file, one {{"prompt": ...,'
            f' "answer": ...}} per line, or builtin / builtin:{",".join(TASKS)})'
        )
    return [Item(p.text, p.answer, p.key, None) for p in load_prompts(path, _NoTokens())]
