"""Parallelism from outside the model: layout and mesh, TP/SP, activation checkpointing, FSDP2, pipelines."""

from plait.parallel.dims import Meshes, ParallelDims, validate_layout
from plait.parallel.env import DistEnv, init_distributed
from plait.parallel.parallelize import materialize, parallelize

__all__ = ["DistEnv", "Meshes", "ParallelDims", "init_distributed", "materialize", "parallelize", "validate_layout"]
