"""Muon (orthogonalised momentum) for the blocks' matrices and AdamW for the rest, as one optimizer that runs in
every layout (`optim.name = "muon"`).

torch.optim.Muon is the reference: its Newton-Schulz coefficients, step count and epsilon are read from its
signature, its update rule (Nesterov momentum, decoupled weight decay, Moonlight's `match_rms_adamw` scale, so
AdamW's learning rate and weight decay carry over) is the one applied, and tests/parallel/test_muon.py holds the two
equal on one process. What it lacks, and this module adds: matrices split over ranks (FSDP2, tensor
parallelism, both; plait.parallel.orthogonal gives each whole matrix to one rank of its shard group), stacks of
experts (3-D, orthogonalised per expert, batched, where they live), fp32 iterations on a CPU (torch's are bf16
always), and AdamW for the parameters Muon is not for, with the same states and kernels as `optim.name = adamw`.

Which parameters take which is one rule, `takes_muon`; the run prints the split at start-up (`describe`).
"""

from __future__ import annotations

import inspect
import math
from collections import Counter
from functools import partial

import torch
from torch import nn

from plait.core import torch_private
from plait.parallel.orthogonal import newton_schulz, orthogonalise_all

_TORCH_MUON = {k: v.default for k, v in inspect.signature(torch.optim.Muon).parameters.items()}
NS_COEFFICIENTS: tuple[float, float, float] = _TORCH_MUON["ns_coefficients"]
NS_EPS: float = _TORCH_MUON["eps"]
RMS_MATCH = 0.2
"""Moonlight's scale: an orthogonalised update times 0.2 sqrt(max(A, B)) has AdamW's typical RMS (0.2-0.4),
so AdamW's learning rate and weight decay carry over (torch.optim.Muon's adjust_lr_fn='match_rms_adamw')."""


def takes_muon(name: str, param: torch.Tensor) -> bool:
    """The one rule: Muon updates a weight matrix inside a repeated block (its name has a numbered part, as
    `layers.3.attention.wq.weight`), 2-D, LoRA adapters' matrices among them (`...wq.lora_A`: measured on a LoRA
    fine-tune, Muon reached AdamW's final loss in 1.33x fewer steps, docs/optimizers.md), and each expert's
    matrices (a 3-D stack); AdamW takes everything else: the embedding table, the output head, norms, biases,
    routers and gates (`router`)."""
    if param.ndim not in (2, 3) or "router" in name:
        return False
    in_block = any(part.isdigit() for part in name.split("."))
    return in_block and (param.ndim == 2 or "experts" in name)


def split_parameters(model: nn.Module) -> tuple[list[tuple[str, nn.Parameter]], list[tuple[str, nn.Parameter]]]:
    """(Muon's, AdamW's) trainable parameters by name, in the model's order."""
    muon: list[tuple[str, nn.Parameter]] = []
    adamw: list[tuple[str, nn.Parameter]] = []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (muon if takes_muon(name, param) else adamw).append((name, param))
    return muon, adamw


def describe(parts: list[nn.Module]) -> str:
    """The split at start-up, over the model parts given (a pipeline rank's stages): counts, sizes and shapes
    of Muon's matrices (global shapes), AdamW's count and size."""
    muon, adamw = [], []
    for part in parts:
        m, a = split_parameters(part)
        muon += m
        adamw += a
    shapes = Counter("x".join(map(str, p.shape)) for _, p in muon)
    listed = ", ".join(f"{s} x{n}" if n > 1 else s for s, n in shapes.most_common())
    size = sum(p.numel() for _, p in muon)
    rest = sum(p.numel() for _, p in adamw)
    return (
        f"optimizer: Muon for {len(muon)} matrices ({size / 1e6:.2f}M parameters: {listed}); AdamW for "
        f"{len(adamw)} others ({rest / 1e6:.2f}M: embeddings, head, norms, biases, routers)"
    )


class Muon(torch.optim.Optimizer):
    """Muon for the `muon` group, torch's AdamW for the others (the same group dicts, the same state), so one
    optimizer is checkpointed, resharded and scheduled as AdamW alone is. State per Muon parameter: one
    momentum buffer, sharded as its parameter."""

    def __init__(
        self,
        muon_params: list[nn.Parameter],
        adamw_groups: list[dict],
        *,
        lr: float,
        weight_decay: float,
        momentum: float,
        ns_steps: int,
        ns_dtype: torch.dtype,
        adamw: dict,
    ) -> None:
        adamw_groups = [g for g in adamw_groups if g["params"]]
        self._adamw = torch.optim.AdamW(adamw_groups, lr=lr, **adamw) if adamw_groups else None
        groups = [{"params": muon_params, "muon": True}] if muon_params else []
        groups += self._adamw.param_groups if self._adamw is not None else []
        defaults = {"lr": lr, "weight_decay": weight_decay, "muon": False, "momentum": momentum}
        super().__init__(groups, defaults)
        self.ns = partial(newton_schulz, steps=ns_steps, coefficients=NS_COEFFICIENTS, eps=NS_EPS, dtype=ns_dtype)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._adamw is not None:  # the same group dicts and state (load_state_dict replaces both)
            self._adamw.param_groups = [g for g in self.param_groups if not g["muon"]]
            self._adamw.state = self.state
            self._adamw.step()
        for group in self.param_groups:
            if group["muon"]:
                self._muon_step(group)
        return loss

    def _muon_step(self, group: dict) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        momentum, lr, decay = group["momentum"], group["lr"], group["weight_decay"]

        def nesterov(i: int) -> torch.Tensor:
            """Matrix i's momentum update (its buffer stepped), made when the orthogonalisation asks for it."""
            state = self.state[params[i]]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(params[i])
            grad = torch_private.local_tensor(params[i].grad)
            buf = torch_private.local_tensor(state["momentum_buffer"])
            buf.lerp_(grad, 1 - momentum)
            return grad.lerp(buf, momentum)  # Nesterov, as torch.optim.Muon's default

        for i, update in orthogonalise_all(params, nesterov, self.ns):  # each applied before the next is made
            p = params[i]
            local = torch_private.local_tensor(p)
            local.mul_(1 - lr * decay)
            local.add_(update, alpha=-lr * RMS_MATCH * math.sqrt(max(p.shape[-2:])))
