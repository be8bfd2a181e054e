"""A Transformer to load weights into: built on the meta device, placed, with its rotary tables, without
drawing initial values (for billions of parameters that are overwritten at once that would cost minutes on a
CPU). Every floor that reads a model from a file builds it here: generation, export, import, evaluation."""

from __future__ import annotations

import torch

from plait.model.args import ModelArgs
from plait.model.llama import Transformer
from plait.model.rope import rope_tables


def empty_model(args: ModelArgs, device: str | torch.device = "cpu") -> Transformer:
    """A Transformer with uninitialised parameters and correct rotary tables, to load weights into."""
    with torch.device("meta"):
        model = Transformer(args)
    device = torch.device(device)
    model.to_empty(device=device)
    model.tie_weights()  # to_empty unties
    with torch.no_grad():
        for buffer in model.buffers():  # MoE balancing state and statistics start at zero
            buffer.zero_()
        cos, sin = rope_tables(args, device=device)
        model.rope_cos.copy_(cos)
        model.rope_sin.copy_(sin)
    return model
