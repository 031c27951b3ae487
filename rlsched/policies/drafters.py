"""The drafter kinds, torch-free: the executor builds drafters of these kinds, the simulator
and the replay price them. What a drafter argument is (`executor.setup.drafter_kind`) needs
the executor, since an EAGLE-3 head is told by its folder."""

from __future__ import annotations

HOST_DRAFTERS = ("ngram", "suffix")  # drafters without a model: they draft from earlier text


def drafter_names(kind: str) -> tuple[str, ...]:
    """The drafters a policy may name, for a drafter of this kind."""
    return () if kind == "off" else (kind,)
