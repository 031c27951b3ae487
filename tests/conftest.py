"""Fixtures shared by the test files: the model pairs the executor's tests run on, each built
once per test module."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def pair():
    """The built-in model pair's folders (`.target`, `.drafter`): the pair the package ships."""
    pytest.importorskip("torch")
    from rlsched.executor.model.builtin import builtin_pair

    return builtin_pair()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random pair, vocabulary 16 (`support.tiny_pair`): `.target`, `.drafter` (loaded
    models) and `.folder` (the target's files)."""
    pytest.importorskip("transformers")
    from support import TinyPair, tiny_pair

    folder = tmp_path_factory.mktemp("tiny") / "tiny"
    return TinyPair(*tiny_pair(folder, 16), folder)
