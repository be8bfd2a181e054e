"""The dense SwiGLU feed-forward of a Llama block (also a mixture of experts' shared experts)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.gate(x))

    def gate(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP up to its down projection: silu(w1 x) * w3 x."""
        return F.silu(self.w1(x)) * self.w3(x)
