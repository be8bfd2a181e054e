"""Materialisation: a model parallelised on the meta device allocated on its device, each rank its own shards,
and filled with exactly the values the single-process model would have (same seed, same names), each rank
drawing or reading only its shards' part, so parallel runs are comparable bit for bit. Also the one way a
rank fills its shard of a parameter from a larger value it reads a box of (load_local_shard)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from functools import partial

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from plait.core import torch_private
from plait.core.errors import ConfigError
from plait.core.torch_private import local_box
from plait.model.llama import Transformer
from plait.parallel.placement import allocate


@torch.no_grad()
def load_local_shard(param: torch.Tensor, read_box: Callable[[tuple[int, ...], tuple[int, ...]], torch.Tensor]) -> None:
    """Fill this rank's shard of a parameter from ``read_box(offset, shape)``: the box of the full value that
    the shard covers (``local_box``), which the caller reads alone (a slice of a file), so no rank ever
    reads or holds another rank's part. A plain (unsharded) parameter reads the whole box."""
    if not isinstance(param, DTensor):
        param.copy_(read_box((0,) * param.dim(), tuple(param.shape)))
        return
    local = param.to_local()
    shape, offset = local_box(param)
    if local.numel() == 0:
        return
    if tuple(local.shape) != tuple(shape):
        raise RuntimeError(f"local shard {tuple(local.shape)} is not the box {tuple(shape)} torch reports")
    local.copy_(read_box(tuple(offset), tuple(shape)))


def init_local_shard(param: torch.Tensor, rows) -> None:
    """Initialise this rank's shard of a parameter from `rows(start, stop)` (the full value's rows, see
    `Transformer.init_weights`): only the rows the shard covers are drawn, then its columns cut out, so
    neither time nor memory depends on the full parameter's size beyond this rank's rows."""

    def read_box(offset: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        value = rows(offset[0], offset[0] + shape[0])
        return value[(slice(None), *(slice(o, o + n) for o, n in zip(offset[1:], shape[1:], strict=True)))]

    load_local_shard(param, read_box)


def materialize_module(model: nn.Module, device: torch.device, *, seed: int, cpu_offload: bool = False) -> None:
    """Allocate a model built on meta (each rank its shards) and initialise it: its own init_weights() if it
    has one (which must set every parameter and buffer), else every module's reset_parameters(), run on a
    full-size copy of that module's own tensors alone, seeded by run.seed and the module's name, each rank
    keeping its shard: the same values for every layout, and never more than one module in full. seed:
    run.seed; cpu_offload: parallel.cpu_offload (FSDP2 then keeps the shards on the CPU)."""
    allocate(model, device, cpu_offload=cpu_offload)  # buffers on the device, offloaded parameters on the CPU
    if callable(getattr(model, "init_weights", None)):
        with torch.no_grad():
            getattr(model, "init_weights")()  # noqa: B009 - your model's own (nn.Module does not declare it)
        return
    buffers = [name for name, _ in model.named_buffers()]
    if buffers:
        raise ConfigError(
            f"your model has buffers ({', '.join(buffers[:3])}) that a model built on the meta device loses; give "
            "it an init_weights() method that sets them (and its parameters)"
        )
    for name, module in model.named_modules():
        if callable(getattr(module, "reset_parameters", None)):
            _reset_in_full(module, _seed(seed, name))


def _seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") >> 1


@torch.no_grad()
def _reset_in_full(module: nn.Module, seed: int) -> None:
    owners = [(m, key, p) for m in module.modules() for key, p in m.named_parameters(recurse=False)]
    full = {id(p): torch.empty(p.shape, dtype=p.dtype) for _, _, p in owners}  # global shapes, on the CPU
    try:
        torch_private.swap_parameters((m, key, nn.Parameter(full[id(p)], requires_grad=False)) for m, key, p in owners)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            getattr(module, "reset_parameters")()  # noqa: B009 - what the module defines (checked by the caller)
    finally:
        torch_private.swap_parameters(owners)
    for _, _, p in owners:
        load_local_shard(p, partial(_box_of, full[id(p)]))


def _box_of(value: torch.Tensor, offset: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
    return value[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]


def materialize(model: Transformer, device: torch.device, *, seed: int, cpu_offload: bool = False) -> None:
    """Allocate a parallelised model built on meta (each rank its own shards), then initialise it like the
    single-process model, each rank drawing only its shards' values. With CPU offload FSDP2 keeps the
    sharded parameters on the CPU, so they are allocated there (buffers stay on the device:
    plait.parallel.placement.allocate). seed: run.seed; cpu_offload: parallel.cpu_offload."""
    allocate(model, device, cpu_offload=cpu_offload)  # buffers on the device, offloaded parameters on the CPU
    model.init_weights(seed, assign=init_local_shard)
