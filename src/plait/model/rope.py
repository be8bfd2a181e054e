"""Rotary position embeddings in the "rotate half" layout (Hugging Face's Llama), with Llama 3's frequency
scaling: the tables, and their application to queries and keys (self-attention, RETRO's cross-attention)."""

from __future__ import annotations

import math

import torch

from plait.model.args import ModelArgs


def rope_tables(args: ModelArgs, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (max_seq_len, head_dim), with Llama 3 frequency scaling if enabled."""
    half = args.head_dim // 2
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, half, device=device, dtype=torch.float64) / half))
    if args.rope_scaling_factor:
        # Llama 3.1: keep high frequencies, divide low ones by the factor, blend smoothly in between.
        low_wavelen = args.rope_original_max_seq_len / args.rope_low_freq_factor
        high_wavelen = args.rope_original_max_seq_len / args.rope_high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (args.rope_original_max_seq_len / wavelen - args.rope_low_freq_factor) / (
            args.rope_high_freq_factor - args.rope_low_freq_factor
        )
        blended = (1 - smooth) * inv_freq / args.rope_scaling_factor + smooth * inv_freq
        inv_freq = torch.where(
            wavelen > low_wavelen,
            inv_freq / args.rope_scaling_factor,
            torch.where(wavelen < high_wavelen, inv_freq, blended),
        )
    t = torch.arange(args.max_seq_len, device=device, dtype=torch.float64)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)  # (max_seq_len, head_dim)
    return emb.cos().float(), emb.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, T, H, head_dim) by position; cos/sin are (T, head_dim), or (B, T, head_dim) where each row
    has positions of its own (document masking: they restart with each document)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    cos, sin = (cos[:, :, None, :], sin[:, :, None, :]) if cos.dim() == 3 else (cos[None, :, None], sin[None, :, None])
    return (x.float() * cos + rotated.float() * sin).type_as(x)
