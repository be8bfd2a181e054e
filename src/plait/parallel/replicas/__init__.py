"""plait's torchft replica groups: fault-tolerant data-parallel replicas that heal a restarted group from a live
peer. `transport.SafeTransport` moves the peer's state (weights, optimizer, step, data position) as safetensors
bytes and JSON, checked against this replica's own state, so nothing a peer sends is executed."""

from plait.parallel.replicas.transport import FORMAT, HealRefused, SafeTransport, serialize_state

__all__ = ["FORMAT", "HealRefused", "SafeTransport", "serialize_state"]
