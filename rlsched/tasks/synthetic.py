"""Built-in synthetic tasks with verifiable answers, written in a small character alphabet.

They are the corpus the built-in tiny model pair is trained on and (later) the RL tasks with
exact-match rewards. Each task is a deterministic function of a numpy Generator, so a seed
fixes the corpus. Response lengths have a long tail (spans, list and word lengths are
lognormal, clipped): a few samples run far longer than the median, as RL rollouts do.

    count 3 to 11=3 4 5 6 7 8 9 10 11
    add 482+917=1399
    sort 5 2 9 1=1 2 5 9
    rev hello=olleh
    repeat ab 4=ab ab ab ab

A prompt ends with '='; the answer follows and then the end-of-sequence token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

SEPARATOR = "="
ALPHABET = " 0123456789abcdefghijklmnopqrstuvwxyz+=:,.-"
LETTERS = "abcdefghijklmnopqrstuvwxyz"


@dataclass(frozen=True)
class Example:
    task: str
    prompt: str  # ends with SEPARATOR
    answer: str


def _longtail(rng: np.random.Generator, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(np.clip(round(median * np.exp(sigma * rng.standard_normal())), lo, hi))


def _count(rng):
    start = int(rng.integers(0, 60))
    span = _longtail(rng, 6, 0.8, 1, 40)
    return f"count {start} to {start + span}", " ".join(str(i) for i in range(start, start + span + 1))


def _add(rng):
    a, b = (int(rng.integers(0, 10 ** int(rng.integers(1, 4)))) for _ in range(2))
    return f"add {a}+{b}", str(a + b)


def _sort(rng):
    n = _longtail(rng, 5, 0.6, 2, 24)
    xs = [int(x) for x in rng.integers(0, 100, n)]
    return "sort " + " ".join(map(str, xs)), " ".join(map(str, sorted(xs)))


def _rev(rng):
    n = _longtail(rng, 6, 0.5, 2, 24)
    word = "".join(rng.choice(list(LETTERS), n))
    return f"rev {word}", word[::-1]


def _repeat(rng):
    n = _longtail(rng, 4, 0.7, 1, 20)
    unit = "".join(rng.choice(list(LETTERS), int(rng.integers(1, 4))))
    return f"repeat {unit} {n}", " ".join([unit] * n)


TASKS: dict[str, Callable[[np.random.Generator], tuple[str, str]]] = {
    "count": _count,
    "add": _add,
    "sort": _sort,
    "rev": _rev,
    "repeat": _repeat,
}


def make_example(rng: np.random.Generator, tasks: tuple[str, ...] = tuple(TASKS)) -> Example:
    name = tasks[int(rng.integers(len(tasks)))]
    prompt, answer = TASKS[name](rng)
    return Example(name, prompt + SEPARATOR, answer)


def make_examples(n: int, seed: int, tasks: tuple[str, ...] = tuple(TASKS)) -> list[Example]:
    """`n` examples drawn from `tasks` in equal shares, reproducible from `seed`."""
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown task(s) {', '.join(unknown)}; known: {', '.join(TASKS)}")
    rng = np.random.default_rng(seed)
    return [make_example(rng, tasks) for _ in range(n)]


def exact_match(response: str, answer: str) -> float:
    """1.0 when the response (whitespace stripped at both ends) is the answer, else 0.0."""
    return float(response.strip() == answer.strip())
