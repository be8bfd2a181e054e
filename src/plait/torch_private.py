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


def sac_cached_tensors(caching_mode) -> list:
    """The tensors selective activation checkpointing keeps for backward in one region: the outputs its
    policy saved, held in the cache of the first dispatch mode create_selective_checkpoint_contexts returns."""
    import torch
    from torch.utils._pytree import tree_leaves

    entries = [list(by_index.values()) for by_index in caching_mode.storage.values()]
    return [leaf.val for leaf in tree_leaves(entries) if isinstance(getattr(leaf, "val", None), torch.Tensor)]
