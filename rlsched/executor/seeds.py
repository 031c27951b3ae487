"""Seeds derived from a run's seed and a purpose, so randomness depends on nothing else."""

from __future__ import annotations

import hashlib
import json


def derive_seed(*parts) -> int:
    """A 63-bit seed from the run's seed and a purpose (any JSON-able parts)."""
    h = hashlib.blake2b(json.dumps(parts).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & (2**63 - 1)
