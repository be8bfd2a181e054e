"""AdamW whose two moments are stored in bfloat16 with stochastic rounding (``optim.state_dtype = "bf16"``).

fp32 AdamW keeps 16 bytes a parameter (weight, gradient, two moments); this one keeps 12. That is what lets
llama3-8b train with CPU offload on a 128 GiB host (96 GB of states instead of 128). The update itself is
torch's AdamW (fused on CUDA and the CPU), run on fp32 copies of the moments, a chunk of a tensor at a time
so that the copies stay small; the moments are then written back rounded *stochastically* to bfloat16.
Plain round-to-nearest would stall them: a second moment moves by (1 - beta2)(g^2 - v) a step, and where
that is under half of bfloat16's spacing (0.4% of v; at beta2 = 0.999 always) it rounds back to the old
value and stops following the gradients. Stochastic rounding keeps each stored moment unbiased (its
expected value is the fp32 one; tests/parallel/test_bf16_adamw.py).

The rounding noise is deterministic: one buffer of uniform 16-bit integers, drawn once from a fixed seed,
read at an offset hashed from (step, parameter, chunk). A resumed run rounds as the uninterrupted one did,
bitwise; a run under another layout (other shard boundaries) rounds differently, within the tolerance
written in tests/parallel/test_bf16_adamw.py.
"""

from __future__ import annotations

import torch
from torch.optim.adamw import adamw

from plait.core.torch_private import local_tensor

CHUNK = 1 << 22
"""Elements updated at a time: the fp32 copies of the moments take 2 x 16 MiB, whatever the tensor's size
(llama3-8b's embedding has 525 M elements: whole, its fp32 moments would take 4.2 GB more host memory)."""

_SPREAD = 1 << 16
"""Offsets into the noise buffer: an element's noise over steps is a window of this many uniform draws."""


def _mix(*values: int) -> int:
    """A 64-bit hash of small integers (splitmix64's finaliser over their running sum)."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h + v * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
        h = (h * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 27
    return h


def noise_buffer(device: torch.device, size: int = CHUNK) -> torch.Tensor:
    """`size` + _SPREAD uniform integers in [0, 2^16), the same on every device and in every run."""
    g = torch.Generator().manual_seed(0x5EED)
    return torch.randint(0, 1 << 16, (size + _SPREAD,), dtype=torch.int32, generator=g).to(device)


def round_to_bf16_(out: torch.Tensor, x: torch.Tensor, noise: torch.Tensor) -> None:
    """Write fp32 `x` into bf16 `out`, rounded up or down at random in proportion to the distance: `noise`
    (int32, uniform in [0, 2^16)) is added to the 16 bits bfloat16 drops, which are then cut. Done on the
    sign-magnitude bit pattern, so it rounds the magnitude of negative numbers alike. `x` is overwritten."""
    bits = x.view(torch.int32)
    bits.add_(noise).bitwise_and_(-65536)  # 0xFFFF0000: the bits a bfloat16 keeps
    out.copy_(bits.view(torch.float32))  # exact: the dropped bits are zero


def _flat(t: torch.Tensor) -> torch.Tensor:
    """The local shard as one flat view (never a copy: the update writes through it)."""
    local = local_tensor(t)
    if not local.is_contiguous():
        raise ValueError(f"optim.state_dtype=bf16 needs contiguous local shards; got strides {local.stride()}")
    return local.view(-1)


class BF16StateAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, no amsgrad) with bfloat16 moments; parameters and gradients stay as
    they are (fp32 master weights). Its state dict has AdamW's keys, so checkpoints save and load as usual."""

    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float, weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self._noise: dict[torch.device, torch.Tensor] = {}

    def _largest_chunk(self) -> int:
        return min(CHUNK, max(local_tensor(p).numel() for group in self.param_groups for p in group["params"]))

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "BF16StateAdamW takes no closure"
        index = 0
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.bfloat16)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.bfloat16)
                w, g, m, v = (_flat(t) for t in (p, p.grad, state["exp_avg"], state["exp_avg_sq"]))
                step = int(state["step"].item())
                noise = self._noise.get(w.device)
                if noise is None:  # as long as the largest chunk: 16 MiB at most, far less for a small model
                    noise = self._noise[w.device] = noise_buffer(w.device, self._largest_chunk())
                fused = w.device.type in ("cuda", "cpu")
                for c, start in enumerate(range(0, w.numel(), CHUNK)):
                    end = min(start + CHUNK, w.numel())
                    m32, v32 = m[start:end].float(), v[start:end].float()
                    adamw(
                        [w[start:end]], [g[start:end]], [m32], [v32], [],
                        [torch.full((), float(step), device=w.device if fused else "cpu")],  # a fill, no copy
                        foreach=False, fused=fused, amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
                        weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
                    )  # fmt: skip
                    for moment, fp32, which in ((m, m32, 0), (v, v32, 1)):
                        at = _mix(step, index, c, which) % _SPREAD
                        round_to_bf16_(moment[start:end], fp32, noise[at : at + end - start])
                state["step"] += 1
        return None
