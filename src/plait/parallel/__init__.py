"""Parallelism from outside the model: layout and mesh, TP/SP, activation checkpointing, FSDP2, pipelines.

The layout rules (`plait.parallel.dims`) load without torch, so bad layouts are refused in milliseconds; the
process-group set-up loads on first use. `parallelize` and `materialize` are imported from
`plait.parallel.parallelize` (a lazy package attribute of that name would be shadowed by the module)."""

from plait.parallel.dims import Meshes, ParallelDims, validate_layout

__all__ = ["DistEnv", "Meshes", "ParallelDims", "init_distributed", "validate_layout"]


def __getattr__(name: str):
    if name in ("DistEnv", "init_distributed"):
        from plait.parallel import env

        return getattr(env, name)
    raise AttributeError(f"module 'plait.parallel' has no attribute {name!r}")
