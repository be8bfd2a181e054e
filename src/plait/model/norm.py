"""RMS normalisation: the module and the autograd Function behind it, which keeps for backward only the input
as it came and one fp32 per row (plait.planner.cost.activations counts what it keeps)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return RMSNormFunction.apply(x, self.weight, self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class RMSNormFunction(torch.autograd.Function):
    """x / rms(x) * weight with the statistics in fp32, keeping for backward only its input as it came (bf16
    in a bf16 model) and the inverse RMS (one fp32 per row): backward recomputes the fp32 normalised value
    instead of autograd keeping an fp32 copy of the input and the normalised value as well (per element
    e + 4 + e bytes -> e; Megatron's fused norms keep the same)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # (..., 1)
        ctx.save_for_backward(x, weight, rstd)
        return (xf * rstd).type_as(x) * weight

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        normed = x.float() * rstd
        grad_weight = None
        if ctx.needs_input_grad[1]:
            dims = tuple(range(grad.dim() - 1))
            grad_weight = (grad * normed.type_as(x)).sum(dims).to(weight.dtype)
        g = (grad * weight).float()  # d loss / d normed
        grad_x = rstd * (g - normed * (g * normed).mean(-1, keepdim=True))
        return grad_x.to(x.dtype), grad_weight, None
