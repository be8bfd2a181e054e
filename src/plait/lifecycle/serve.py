"""Shared-stem execution: many LoRA adapters of one base served in one batch.

Each row of a batch names its adapter (or none). Every target linear runs the shared base weight once for the
whole batch, then adds each row's own low-rank delta with two batched matmuls over per-row gathered adapter
matrices::

    y = x W^T                                  # (B, T, out): one pass through the base weights
      + scale[ids] * bmm(bmm(x, A[ids]^T), B[ids]^T)   # (B, T, r) -> (B, T, out): per-row adapters

Adapters of different ranks are zero-padded to the largest rank (the extra products are exact zeros), and an
adapter that does not touch a layer gets an all-zero slot there, as does a row without adapter.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from plait.core.errors import PlaitError
from plait.lifecycle.lora import base_weights_hash, check_base, read_adapter, target_linears

if TYPE_CHECKING:
    from plait.model.llama import Transformer


class MultiLoRALinear(nn.Linear):
    """An nn.Linear (changed in place, like ``LoRALinear``) holding K stacked adapters; ``row_adapter``
    (B,) picks one per row, K meaning none (the zero slot)."""

    stack_a: torch.Tensor  # (K + 1, r, in)
    stack_b: torch.Tensor  # (K + 1, out, r)
    stack_scale: torch.Tensor  # (K + 1,)
    row_adapter: torch.Tensor | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)  # (B, T, out): the shared stem
        ids = self.row_adapter
        if ids is None:
            return out
        a = self.stack_a[ids].to(x.dtype)  # (B, r, in)
        b = self.stack_b[ids].to(x.dtype)  # (B, out, r)
        delta = torch.bmm(torch.bmm(x, a.transpose(1, 2)), b.transpose(1, 2))  # (B, T, r) -> (B, T, out)
        return out + delta * self.stack_scale[ids].to(x.dtype)[:, None, None]


class SharedStem:
    """A base model plus named adapters, run together. Each adapter's recorded base is checked first."""

    def __init__(self, model: nn.Module, adapters: dict[str, str | Path]):
        if not adapters:
            raise PlaitError("give at least one adapter")
        self.model = model.eval()
        self.names = list(adapters)
        base_hash = base_weights_hash(model)
        loaded = []
        for path in adapters.values():
            meta, tensors = read_adapter(path)
            check_base(meta, base_hash, str(path))
            loaded.append((float(meta["alpha"]) / int(meta["rank"]), tensors))
        rank = max(t.shape[0] for _, tensors in loaded for k, t in tensors.items() if k.endswith(".lora_a"))
        modules = {n.rsplit(".", 1)[0] for _, tensors in loaded for n in tensors}
        linears = target_linears(model, {m.rsplit(".", 1)[-1] for m in modules})
        unknown = modules - set(linears)
        if unknown:
            raise PlaitError(f"adapters name layers this model lacks: {sorted(unknown)[:3]}")
        self.modules: list[MultiLoRALinear] = []
        num = len(loaded)
        for mname in sorted(modules):
            lin = linears[mname]
            device = lin.weight.device
            stack_a = torch.zeros(num + 1, rank, lin.in_features, device=device)
            stack_b = torch.zeros(num + 1, lin.out_features, rank, device=device)
            scale = torch.zeros(num + 1, device=device)
            for k, (scaling, tensors) in enumerate(loaded):
                if f"{mname}.lora_a" in tensors:
                    a, b = tensors[f"{mname}.lora_a"], tensors[f"{mname}.lora_b"]
                    stack_a[k, : a.shape[0]] = a
                    stack_b[k, :, : b.shape[1]] = b
                    scale[k] = scaling
            lin.__class__ = MultiLoRALinear
            multi = cast(MultiLoRALinear, lin)  # the same module, now of the class just set
            multi.stack_a, multi.stack_b, multi.stack_scale, multi.row_adapter = stack_a, stack_b, scale, None
            self.modules.append(multi)

    def ids(self, adapters: Sequence[str | None]) -> torch.Tensor:
        unknown = [a for a in adapters if a is not None and a not in self.names]
        if unknown:
            raise PlaitError(f"unknown adapter {unknown[0]!r}; loaded: {', '.join(self.names)}")
        device = self.modules[0].weight.device
        none = len(self.names)
        return torch.tensor([self.names.index(a) if a is not None else none for a in adapters], device=device)

    @contextlib.contextmanager
    def rows(self, adapters: Sequence[str | None]) -> Iterator[None]:
        """Within this block, batch row i uses adapters[i] (None: the base alone)."""
        ids = self.ids(adapters)
        for m in self.modules:
            m.row_adapter = ids
        try:
            yield
        finally:
            for m in self.modules:
                m.row_adapter = None

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor, adapters: Sequence[str | None]) -> torch.Tensor:
        if tokens.shape[0] != len(adapters):
            raise PlaitError(f"{tokens.shape[0]} rows but {len(adapters)} adapter choices")
        with self.rows(adapters):
            return self.model(tokens)

    @torch.no_grad()
    def generate(
        self,
        requests: Sequence[tuple[list[int], str | None]],
        *,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        eos_id: int | None = None,
        seed: int = 0,
    ) -> list[list[int]]:
        """Continue each (prompt ids, adapter) request. Requests whose prompts have the same length share one
        batch (the KV cache has one position per row), whatever their adapters."""
        from plait.engine.generate import generate

        out: list[list[int] | None] = [None] * len(requests)
        groups: dict[int, list[int]] = {}
        for i, (ids, _) in enumerate(requests):
            groups.setdefault(len(ids), []).append(i)
        for members in groups.values():
            with self.rows([requests[i][1] for i in members]):
                results = generate(
                    cast("Transformer", self.model),  # a plait model, its target linears made MultiLoRALinear
                    [requests[i][0] for i in members],
                    max_new_tokens=max_new_tokens,
                    temperature=temperature,
                    top_k=top_k,
                    top_p=top_p,
                    eos_id=eos_id,
                    seed=seed,
                )
            for i, r in zip(members, results, strict=True):
                out[i] = r
        return [r for r in out if r is not None]
