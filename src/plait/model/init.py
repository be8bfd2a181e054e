"""Deterministic initial weights: each parameter's value depends only on (seed, its name), drawn on the CPU in
blocks of rows each from a generator of its own, so any range of rows can be produced alone (a rank draws only
its shard: plait.parallel.materialize) and the values are the same on every device and layout.
`Transformer.init_weights` says which parameter gets which distribution."""

from __future__ import annotations

import hashlib
import math
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

INIT_BLOCK_ELEMENTS = 1 << 20
"""Rows are drawn in blocks of about this many values: small enough that a rank drawing only its shard
draws little beyond it, large enough that the per-block generator set-up costs nothing."""


def init_rows(shape: tuple[int, ...], std: float, seed: int, start: int, stop: int) -> torch.Tensor:
    """Rows start:stop of a parameter's initial value. Block b covers rows [b*R, (b+1)*R) with R fixed by the
    global shape, and is drawn from its own generator, so the result is the same whichever rows are asked.
    The blocks are drawn on torch's intra-op thread count of threads at once (each its own generator, so the
    values do not depend on the order): a CPU generator draws on one core, and one block after another was most
    of a 1B model's build (docs/measurements.md, "model build: weights drawn on every thread")."""
    row = math.prod(shape[1:])
    per_block = max(1, INIT_BLOCK_ELEMENTS // max(1, row))
    out = torch.empty((stop - start, *shape[1:]), dtype=torch.float32)

    def draw(b: int) -> None:
        lo, hi = b * per_block, min((b + 1) * per_block, shape[0])
        a, z = max(lo, start), min(hi, stop)
        if (a, z) == (lo, hi):  # the whole block: drawn in place
            _trunc_normal_(out[a - start : z - start], std, _name_seed(seed, f"block{b}"))
        else:
            block = _trunc_normal_(torch.empty((hi - lo, *shape[1:])), std, _name_seed(seed, f"block{b}"))
            out[a - start : z - start] = block[a - lo : z - lo]

    blocks = range(start // per_block, -(-stop // per_block))
    workers = min(len(blocks), torch.get_num_threads())
    if workers > 1:
        with ThreadPoolExecutor(workers, thread_name_prefix="plait-init") as pool:
            list(pool.map(draw, blocks))
    else:
        for b in blocks:
            draw(b)
    return out


def _ones_rows(shape: tuple[int, ...], start: int, stop: int) -> torch.Tensor:
    return torch.ones((stop - start, *shape[1:]))


def _zeros_rows(shape: tuple[int, ...], start: int, stop: int) -> torch.Tensor:
    return torch.zeros((stop - start, *shape[1:]))


def canonical_name(name: str) -> str:
    """A parameter's name without the prefixes wrappers add (activation checkpointing, torch.compile)."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def _name_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1


def _trunc_normal_(out: torch.Tensor, std: float, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return nn.init.trunc_normal_(out, std=std, a=-3 * std, b=3 * std, generator=gen)
