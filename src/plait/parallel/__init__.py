"""Parallelism from outside the model: the layout's rules and its meshes, the plan that parallelises a model
built on meta (plait.parallel.parallelize: TP/SP, context and expert parallelism, activation checkpointing,
compilation, FSDP2, each a module of its own), pipelines, and materialisation of the sharded weights.

The layout rules (`plait.parallel.rules`, applied by `plait.parallel.dims.validate_layout`) load without torch,
so bad layouts are refused in milliseconds; the process-group set-up (`plait.parallel.env`) loads on first use.
`parallelize` is imported from `plait.parallel.parallelize` and `materialize` from `plait.parallel.materialize`
(a lazy package attribute of either name would be shadowed by its module)."""

from plait.parallel.dims import Meshes, ParallelDims, validate_layout

__all__ = ["DistEnv", "Meshes", "ParallelDims", "init_distributed", "validate_layout"]


def __getattr__(name: str):
    if name in ("DistEnv", "init_distributed"):
        from plait.parallel import env

        return getattr(env, name)
    raise AttributeError(f"module 'plait.parallel' has no attribute {name!r}")
