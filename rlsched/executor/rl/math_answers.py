"""The `math` reward: a response's final answer (the last `\\boxed{...}`, else the last
number) compared with the reference numerically, else as normalised text."""

from __future__ import annotations

import math
import re

# A number not glued to a word or to another number: integer or decimal, optional thousands
# separators (1,234,567), exponent, or a simple fraction (3/4, -1/2).
_NUM = (
    r"(?:\d{1,3}(?:,\d{3})+(?!,?\d)|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?"
    r"|\.\d+(?:[eE][-+]?\d+)?"
)
NUMBER = re.compile(rf"(?<![\w.])-?(?:{_NUM})(?:/\d+(?:\.\d+)?)?")
_FRAC = re.compile(r"\\[dt]?frac\s*\{\s*(-?[\d.,]+)\s*\}\s*\{\s*(-?[\d.,]+)\s*\}")
_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mathbf)\s*\{([^{}]*)\}")
REL_TOL = 1e-6


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (nested braces kept), or None."""
    found = None
    for m in re.finditer(r"\\boxed\s*\{", text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            found = text[m.end() : i - 1]
    return found


def normalise(text: str) -> str:
    """Stripped, surrounding $ and a trailing period removed, LaTeX \\text{} unwrapped,
    lowercase, runs of whitespace as one space."""
    s = _TEXT.sub(r"\1", text).strip()
    while len(s) >= 2 and s.startswith("$") and s.endswith("$"):
        s = s[1:-1].strip()
    s = s.strip("$").strip()
    if s.endswith("."):
        s = s[:-1]
    return " ".join(s.lower().split())


def parse_number(text: str) -> float | None:
    """The value of `text` when all of it is one number (see NUMBER; \\frac{a}{b} too), else None."""
    s = _FRAC.sub(r"\1/\2", normalise(text)).replace("\\!", "").replace("\\,", "")
    if not NUMBER.fullmatch(s):
        return None
    return _value(s)


def _value(s: str) -> float | None:
    s = s.replace(",", "")
    try:
        if "/" in s:
            num, den = s.split("/")
            return float(num) / float(den) if float(den) != 0 else None
        return float(s)
    except ValueError:
        return None


def last_number(text: str) -> str | None:
    """The last number written in `text` (LaTeX fractions read as a/b), or None."""
    found = NUMBER.findall(_FRAC.sub(r"\1/\2", text))
    return found[-1] if found else None


def extract_answer(response: str) -> str | None:
    """The final answer of a response: the last \\boxed{} content, else the last number."""
    boxed = last_boxed(response)
    return boxed if boxed is not None else last_number(response)


def math_reward(prompt: str, response: str, answer: str) -> float:
    """1.0 when the response's final answer equals `answer` (numerically within a relative
    1e-6, or as normalised text), else 0.0. Without a \\boxed{} answer the whole response is
    also compared as text, so a reference like "x+1" can match a plain "x+1"."""
    want_text = normalise(answer)
    want = parse_number(answer)
    boxed = last_boxed(response)
    got = boxed if boxed is not None else last_number(response)
    texts = [got] if boxed is not None else [got, response]
    if got is not None and want is not None:
        candidates = [got] + ([got.rsplit("=", 1)[1]] if "=" in got else [])  # \boxed{x = 5}
        for c in candidates:
            x = parse_number(c)
            if x is not None and math.isclose(x, want, rel_tol=REL_TOL, abs_tol=1e-12):
                return 1.0
    return float(any(t is not None and normalise(t) == want_text for t in texts))
