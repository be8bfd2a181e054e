"""The optimizer (AdamW, or Muon with AdamW for the rest) and its learning-rate schedules (warm-up, then cosine,
warmup-stable-decay or constant)."""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from plait.config import OptimConfig
from plait.engine.bf16_adamw import BF16StateAdamW
from plait.engine.muon import Muon, split_parameters


def build_optimizer(model: nn.Module, cfg: OptimConfig, device: torch.device) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (not on norms or the embedding table); with
    ``optim.state_dtype = "bf16"``, its moments in bfloat16 (plait.engine.bf16_adamw); with ``optim.name =
    "muon"``, Muon for the blocks' matrices and this AdamW for the rest (plait.engine.muon).

    The fused kernel is used on CUDA and on the CPU (torch 2.13, this repo's models, one thread: 4x faster
    than foreach for the 0.7M debug model, 8x for tiny, 11x for 56M small; bench numbers in
    docs/performance.md), the foreach implementation elsewhere.
    """
    muon, named = split_parameters(model) if cfg.name == "muon" else ([], _trainable(model))
    decay = [p for name, p in named if p.ndim >= 2 and "tok_embeddings" not in name]
    no_decay = [p for name, p in named if not (p.ndim >= 2 and "tok_embeddings" not in name)]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    fused = device.type in ("cuda", "cpu")
    adamw: dict[str, Any] = {"betas": (cfg.beta1, cfg.beta2), "eps": cfg.eps, "fused": fused, "foreach": not fused}
    if cfg.name == "muon":
        ns_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(cfg.muon_ns_dtype)
        return Muon(
            [p for _, p in muon],
            groups,
            lr=cfg.lr,
            weight_decay=cfg.weight_decay,
            momentum=cfg.muon_momentum,
            ns_steps=cfg.muon_ns_steps,
            ns_dtype=ns_dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32),
            adamw=adamw,
        )
    if cfg.state_dtype == "bf16":
        return BF16StateAdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    return torch.optim.AdamW(groups, lr=cfg.lr, **adamw)


def _trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def lr_factor(step: int, *, cfg: OptimConfig, total_steps: int) -> float:
    """Multiplier of the peak LR for the update that follows `step` completed updates."""
    warmup = cfg.warmup_steps
    if step < warmup:
        return (step + 1) / (warmup + 1)
    floor = cfg.min_lr_ratio
    if cfg.schedule == "constant":
        return 1.0
    if cfg.schedule == "wsd":
        decay_steps = max(1, round(cfg.decay_fraction * total_steps))
        decay_start = total_steps - decay_steps
        if step < decay_start:
            return 1.0
        progress = min(1.0, (step - decay_start) / decay_steps)
        return 1.0 - (1.0 - floor) * progress
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def schedule_problem(cfg: OptimConfig, total_steps: int) -> str | None:
    """A schedule that never reaches its peak: warm-up as long as the run (a short fine-tune on the defaults)."""
    if cfg.warmup_steps >= total_steps:
        top = lr_factor(total_steps - 1, cfg=cfg, total_steps=total_steps) * cfg.lr
        return (
            f"optim.warmup_steps={cfg.warmup_steps} is not below train.steps={total_steps}: the learning rate only "
            f"warms up (to {top:.2e} at the last step, below optim.lr={cfg.lr:g}) and never decays; set "
            f"optim.warmup_steps below train.steps (e.g. {min(total_steps - 1, max(1, total_steps // 10))})"
        )
    return None


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int) -> LambdaLR:
    return LambdaLR(optimizer, partial(lr_factor, cfg=cfg, total_steps=total_steps))
