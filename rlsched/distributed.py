"""Ray, where work spans processes or machines (`compare --ray`, `learn --ray`, rollout
instances): one import with one clear line when it is missing."""

from __future__ import annotations

from rlsched.errors import UserError

RAY_HINT = "pip install 'rlsched[distributed]' (or pip install ray)"


def import_ray(what: str):
    """The ray module, or a UserError saying that `what` needs it and how to get it."""
    try:
        import ray
    except ImportError:
        raise UserError(f"{what} needs Ray, which is not installed: {RAY_HINT}") from None
    return ray
