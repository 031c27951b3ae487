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


def check_cluster_address(address: str | None, what: str, timeout: float = 3.0) -> None:
    """A UserError at once when `address` (host:port, ray://host:port; 'auto', 'local' or
    None are left to Ray) names no listening port: ray.init retries such an address for
    minutes before it gives up."""
    import socket

    if not address or address in ("auto", "local"):
        return
    hostport = address.split("://", 1)[-1].rstrip("/")
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        raise UserError(
            f"{what}: '{address}' is not a Ray address; give host:port (as `ray start --head` prints) or 'auto'"
        )
    try:
        socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=timeout).close()
    except OSError as e:
        raise UserError(
            f"{what}: no Ray cluster answers at {hostport} ({e.strerror or e}); start one with "
            "`ray start --head`, or give the address it printed"
        ) from None
