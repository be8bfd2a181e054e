"""The lighthouse of a fault-tolerant run: torchft's quorum server, which every replica group asks before each
step who is alive. `plait train --replicas R` starts one in its launcher; runs of several jobs (Slurm) start one
with `plait lighthouse` and name it in parallel.lighthouse."""

from __future__ import annotations

import os
import socket

JOIN_TIMEOUT_MS = 1000  # a quorum waits this long for more groups once min_replicas are there (start-up, rejoin)
HEARTBEAT_TIMEOUT_MS = 5000  # a group silent this long is left out of the next quorum


def start_lighthouse(min_replicas: int, port: int = 0):
    """A running lighthouse and its address (http://HOST:PORT) for the groups."""
    os.environ.setdefault("RUST_LOG", "warn")  # torchft logs every quorum at INFO otherwise
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(
        bind=f"[::]:{port}", min_replicas=min_replicas, join_timeout_ms=JOIN_TIMEOUT_MS,
        heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS,
    )  # fmt: skip
    _, _, bound = server.address().rpartition(":")
    return server, f"http://{socket.gethostname()}:{bound}"
