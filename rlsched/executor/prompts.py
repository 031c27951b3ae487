"""Prompts files: JSONL, one {"prompt": str, "id"?: str|int, "answer"?: str} per line, checked
line by line (file, line number, fix); or the built-in task prompts."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from rlsched.errors import UserError

DEFAULT_PROMPTS = 32  # built-in task prompts when no prompts file is given


@dataclass
class Prompt:
    index: int
    key: str  # the file's "id", or the line number
    text: str
    ids: list[int]
    answer: str | None = None


def encode(tokenizer, text: str) -> list[int]:
    """The token ids of `text`, without special tokens."""
    return tokenizer.encode(text, add_special_tokens=False).ids


def load_prompts(path: Path | None, tokenizer) -> list[Prompt]:
    """Prompts from a JSONL file ({"prompt": str, "id"?: str|int, "answer"?: str} per line), or
    the built-in task prompts."""
    if path is None:
        from rlsched.tasks.synthetic import make_examples

        return [
            Prompt(i, str(i), e.prompt, encode(tokenizer, e.prompt), e.answer)
            for i, e in enumerate(make_examples(DEFAULT_PROMPTS, seed=12345))
        ]
    path = Path(path)
    if not path.is_file():
        raise UserError(f'prompts file {path} does not exist (give a JSONL file, one {{"prompt": ...}} per line)')
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"prompts file {path} cannot be read as UTF-8 text: {e}") from None
    out = []
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(
                f"prompts file {path} line {no}: not valid JSON ({e.msg}); each line must be "
                'an object like {"prompt": "..."}'
            ) from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"]:
            raise UserError(f"prompts file {path} line {no}: needs a non-empty string field 'prompt'")
        answer = obj.get("answer")
        if answer is not None and not isinstance(answer, str):
            raise UserError(f"prompts file {path} line {no}: field 'answer' must be a string")
        key = str(obj.get("id", no))
        out.append(Prompt(len(out), key, obj["prompt"], encode(tokenizer, obj["prompt"]), answer))
    if not out:
        raise UserError(f"prompts file {path} holds no prompts")
    return out
