"""Where a parallelised model's tensors live: allocated there, and checked there.

A model is built on the meta device and parallelised there; `allocate` gives it storage. Parameters go to the
compute device, or with CPU offload to the CPU (FSDP2 keeps the sharded parameters, their gradients and the
optimizer's states there and copies each unit to the device for its compute). Buffers (rotary tables, MoE
routing biases and load counters) are not FSDP2's: they go to the compute device under every setting, as the
forward reads them there. `check_placement` refuses a model where a tensor is elsewhere, naming it: on the CPU
the compute device and the offload device are one, so no CPU run can see the mistake, and the check is what
fails instead (tests run it with the meta device standing in for an accelerator).
"""

from __future__ import annotations

import torch
from torch import nn

from plait.core.errors import PlaitError


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether two devices are one (an index left out means the current one of that type)."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def parameter_device(device: torch.device, cpu_offload: bool) -> torch.device:
    """Where the (sharded) parameters live: the CPU under parallel.cpu_offload, else the compute device."""
    return torch.device("cpu") if cpu_offload else device


def allocate(model: nn.Module, device: torch.device, *, cpu_offload: bool = False) -> None:
    """Storage for a model built on meta: parameters where `parameter_device` says, every buffer on the
    compute device. Values are uninitialised (the caller initialises them)."""
    model.to_empty(device=parameter_device(device, cpu_offload))
    if cpu_offload and not same_device(device, torch.device("cpu")):
        for module in model.modules():
            for name, buffer in list(module.named_buffers(recurse=False)):
                setattr(module, name, torch.empty_like(buffer, device=device))  # stays a buffer (persistence too)


def misplaced(model: nn.Module, device: torch.device, *, cpu_offload: bool = False) -> list[str]:
    """'kind name: on X' for every parameter, gradient and buffer not where it belongs."""
    from plait.core.torch_private import local_tensor

    wrong = []
    params_on = parameter_device(device, cpu_offload)
    for name, param in model.named_parameters():
        for kind, tensor in (("parameter", param), ("gradient", param.grad)):
            if tensor is not None and not same_device(local_tensor(tensor).device, params_on):
                wrong.append(f"{kind} {name}: on {local_tensor(tensor).device}, not {params_on}")
    for name, buffer in model.named_buffers():
        if buffer is not None and not same_device(buffer.device, device):
            wrong.append(f"buffer {name}: on {buffer.device}, not {device}")
    return wrong


def check_placement(model: nn.Module, device: torch.device, *, cpu_offload: bool = False) -> None:
    """Raise PlaitError naming the first tensors of the model that are not on their device (see `misplaced`)."""
    wrong = misplaced(model, device, cpu_offload=cpu_offload)
    if wrong:
        more = f" (and {len(wrong) - 3} more)" if len(wrong) > 3 else ""
        where = "the CPU (parallel.cpu_offload) for parameters, " if cpu_offload else ""
        raise PlaitError(
            f"tensors on the wrong device: {'; '.join(wrong[:3])}{more}. The model computes on {device}; "
            f"plait places {where}every buffer on the compute device: a model's own init_weights() or a callback "
            "that creates a tensor must create it on the device of the tensor it replaces"
        )
