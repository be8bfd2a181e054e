"""What plait calls a model's blocks: the repeated units it checkpoints, compiles and shards one by one."""

from __future__ import annotations

from torch import nn


def blocks(model: nn.Module) -> list[tuple[str | int, nn.Module]]:
    """The repeated blocks of a model, `model.layers` as an nn.ModuleDict or nn.ModuleList (plait's Transformer
    and most models); the unit of activation checkpointing, compilation and FSDP sharding. Empty if none."""
    layers = getattr(model, "layers", None)
    if isinstance(layers, nn.ModuleDict):
        return list(layers.items())
    if isinstance(layers, nn.ModuleList):
        return list(enumerate(layers))
    return []
