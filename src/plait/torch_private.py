"""torch APIs that are not public, each behind a function here, so a torch upgrade that moves one breaks one
place (and its test), not the callers. (Older uses elsewhere are being moved here.)"""

from __future__ import annotations


def local_box(dtensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, global offset) of this rank's shard of a DTensor: the box of the global tensor it holds,
    for any placements, FSDP2's strided shards on top of tensor parallelism included. torch's own helper
    for this is what DCP uses to place shards in a checkpoint."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return compute_local_shape_and_global_offset(dtensor.shape, dtensor.device_mesh, dtensor.placements)


def init_fake_process_group(world_size: int, rank: int = 0) -> None:
    """A process group of `world_size` ranks in this one process whose collectives do nothing: shapes,
    placements and each rank's shards are real, values are not. For sizing a layout with no cluster."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def heartbeat_store(timeout_s: float = 30.0):
    """A store client of its own for the hang watchdog's heartbeats (a second client of the job's TCPStore,
    so the watchdog thread never shares a socket with the training thread), or None where the job has no
    such store (one process, a fake group). Raises if the store cannot be reached."""
    import os
    from datetime import timedelta

    import torch.distributed as dist

    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not (addr and port and dist.is_initialized() and dist.get_world_size() > 1):
        return None
    store = dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))
    from plait.parallel.env import restart_count

    return dist.PrefixStore(f"plait_attempt_{restart_count()}/heartbeat", store)
