"""The lighthouse of a fault-tolerant run: torchft's quorum server, which every replica group asks before each
step who is alive. `plait train --replicas R` starts one in its launcher; runs of several jobs (Slurm) start one
with `plait lighthouse` and name it in parallel.lighthouse."""

from __future__ import annotations

import socket

from plait.core.errors import ConfigError

# A quorum waits up to this long for a group that is alive (heartbeating) but has not asked to join yet: one whose
# step or round ended late. A dead group stops heartbeating and is left out after HEARTBEAT_TIMEOUT_MS, so a long
# join timeout costs nothing on a failure; a short one lets a late group miss a quorum and sit out a round.
JOIN_TIMEOUT_MS = 30_000
HEARTBEAT_TIMEOUT_MS = 5000  # a group silent this long is left out of the next quorum


def require_torchft() -> None:
    """torchft, or a ConfigError saying how to install it (fault-tolerant runs only need it)."""
    try:
        import torchft  # noqa: F401
    except ImportError:
        raise ConfigError(
            "fault-tolerant replica groups run on torchft, which is not installed: pip install 'plait[ft]' "
            "(or pip install torchft)"
        ) from None


def start_lighthouse(min_replicas: int, port: int = 0):
    """A running lighthouse and its address (http://HOST:PORT) for the groups."""
    require_torchft()
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(
        bind=f"[::]:{port}", min_replicas=min_replicas, join_timeout_ms=JOIN_TIMEOUT_MS,
        heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS,
    )  # fmt: skip
    _, _, bound = server.address().rpartition(":")
    return server, f"http://{socket.gethostname()}:{bound}"
