"""plait's torchft replica groups: fault-tolerant data-parallel replicas that heal a restarted group from a live
peer. `transport.SafeTransport` moves the peer's state (weights, optimizer, step, data position) as safetensors
bytes and JSON, checked against this replica's own state, so nothing a peer sends is executed.

torchft is an optional extra (`plait[ft]`): this package imports it only when a name of `transport` is asked for,
so a run without replicas (every `plait train`, `bench`, `fit`) never needs it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from plait.parallel.replicas.transport import FORMAT, HealRefused, SafeTransport, serialize_state

__all__ = ["FORMAT", "HealRefused", "SafeTransport", "serialize_state"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from plait.parallel.replicas import transport

        return getattr(transport, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
