"""LoRA as a layer: a target ``nn.Linear`` (``wq`` ... ``w3``, chosen by name) becomes a ``LoRALinear`` in place.

The same object keeps the same ``weight`` parameter and gains two, ``lora_a`` (r, in) and ``lora_b`` (out, r)::

    y = x W^T + (alpha / r) * dropout(x) A^T B^T

Changing the class of the existing module rather than putting a new module in its place keeps everything
that refers to the module valid: parameter names (``layers.0.attention.wq.weight`` loads from any base
checkpoint; the adapters add ``...wq.lora_a`` / ``...wq.lora_b``), and the hooks and parameter registrations of
an FSDP2-sharded block, which swaps the gathered weight into this very module before each forward (FSDP2 itself
turns modules into FSDP subclasses the same way). B starts at zero, so a fresh adapter leaves the base model's
outputs bitwise unchanged.

It lives with the model (not with fine-tuning) because every floor that builds a model from a LoRA run's
checkpoint needs it: generation in the engine, export in interop, serving and evaluation above. Adapter files,
hashes and the fine-tuning run's wiring stay in ``plait.lifecycle.lora``.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from plait.core.errors import PlaitError
from plait.model.args import LORA_TARGETS
from plait.model.llama import canonical_name

_LORA_PARAMS = ("lora_a", "lora_b")


def fold(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
    """The merged weight W + (alpha / r) B A, in W's dtype: what a LoRALinear computes, as one matrix."""
    return weight + (lora_b.to(torch.float32) @ lora_a.to(torch.float32)).to(weight.dtype) * scaling


def lora_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """{canonical name: shape} of a LoRA model's adapter tensors."""
    return {canonical_name(n): tuple(p.shape) for n, p in model.named_parameters() if is_lora_param(n)}


class LoRALinear(nn.Linear):
    """An ``nn.Linear`` with a low-rank trainable update; made from an existing one by ``adapt``."""

    lora_a: nn.Parameter  # (r, in_features)
    lora_b: nn.Parameter  # (out_features, r)
    scaling: float
    lora_dropout: float

    @classmethod
    def adapt(cls, linear: nn.Linear, rank: int, alpha: float, dropout: float, a_init: torch.Tensor) -> LoRALinear:
        """Turn ``linear`` into a LoRALinear in place (see the module docstring for why in place)."""
        if type(linear) is not nn.Linear:
            raise PlaitError(f"LoRA applies to plain nn.Linear modules, not {type(linear).__name__}")
        device = linear.weight.device
        linear.__class__ = cls
        lora = cast(LoRALinear, linear)  # the same module, its class now swapped
        lora.lora_a = nn.Parameter(a_init.to(device=device, dtype=torch.float32))
        lora.lora_b = nn.Parameter(torch.zeros(linear.out_features, rank, device=device))
        lora.scaling = alpha / rank
        lora.lora_dropout = dropout
        return lora

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        h = F.dropout(x, self.lora_dropout, self.training) if self.lora_dropout else x
        # Adapters stay fp32 parameters; under autocast or an FSDP bf16 policy x arrives in the compute dtype.
        delta = F.linear(F.linear(h, self.lora_a.to(x.dtype)), self.lora_b.to(x.dtype))  # (..., r) -> (..., out)
        return out + delta * self.scaling

    @torch.no_grad()
    def merge(self) -> nn.Linear:
        """Fold the update into the weight (W += (alpha / r) B A) and become a plain nn.Linear again."""
        self.weight.copy_(fold(self.weight, self.lora_a, self.lora_b, self.scaling))
        for name in (*_LORA_PARAMS,):
            delattr(self, name)
        for name in ("scaling", "lora_dropout"):
            self.__dict__.pop(name, None)
        cast(nn.Linear, self).__class__ = nn.Linear  # back to a plain nn.Linear, in place
        return self

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, lora_rank={self.rank}, scaling={self.scaling:g}"


def parse_targets(targets: str | Iterable[str]) -> list[str]:
    names = [t.strip() for t in targets.split(",")] if isinstance(targets, str) else list(targets)
    names = [t for t in names if t]
    unknown = [t for t in names if t not in LORA_TARGETS]
    if not names or unknown:
        raise PlaitError(f"LoRA targets {names} must be chosen from {', '.join(LORA_TARGETS)}")
    return names


def is_lora_param(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in _LORA_PARAMS


def target_linears(model: nn.Module, targets: Iterable[str]) -> dict[str, nn.Linear]:
    """{canonical module name: module} of the linear layers named by targets (``wq`` matches ``*.wq``)."""
    wanted = set(targets)
    return {
        canonical_name(name): module
        for name, module in model.named_modules()
        if name.rsplit(".", 1)[-1] in wanted and isinstance(module, nn.Linear)
    }


def lora_a_init(name: str, rank: int, in_features: int, seed: int) -> torch.Tensor:
    """A's initial value: U(-1/sqrt(in), 1/sqrt(in)) (Kaiming-uniform with a=sqrt(5), as nn.Linear and PEFT
    use), drawn on the CPU from a generator seeded by (seed, module name): identical under every layout."""
    digest = hashlib.sha256(f"{seed}:lora:{name}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    bound = 1 / math.sqrt(in_features)
    return torch.empty(rank, in_features).uniform_(-bound, bound, generator=gen)


def apply_lora(
    model: nn.Module, rank: int, alpha: float, targets: str | Iterable[str], dropout: float = 0.0, seed: int = 0
) -> list[str]:
    """Give every target linear an adapter and freeze everything else; returns the adapted module names."""
    if rank < 1:
        raise PlaitError(f"LoRA rank must be at least 1, got {rank}")
    linears = target_linears(model, parse_targets(targets))
    if not linears:
        raise PlaitError(f"the model has no linear layers named {targets}")
    for name, linear in linears.items():
        if isinstance(linear, LoRALinear):
            raise PlaitError(f"{name} already has a LoRA adapter")
        LoRALinear.adapt(linear, rank, alpha, dropout, lora_a_init(name, rank, linear.in_features, seed))
    for name, param in model.named_parameters():
        param.requires_grad_(is_lora_param(name))
    return sorted(linears)


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    return {canonical_name(n): m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight: a plain Transformer again (exportable anywhere)."""
    for module in lora_modules(model).values():
        module.merge()
    for param in model.parameters():
        param.requires_grad_(True)
    return model
