"""The content hash of a set of weights, computable from shards: the same for every layout and world size.

A tensor's digest is a sum over its elements of a mix of (name, global position, value bits), modulo 2^32 in
two independent lanes. A sum does not care how the elements are split: each rank adds up the elements it
holds (a DTensor's local box, counted once across replicas), one all-reduce of a few integers per tensor
adds the ranks up, and the result equals the digest of the full tensor on one process. So a checkpoint's
hash comes from the weights as they are saved, without reading the checkpoint back or gathering the model.

The hash of a set of weights is SHA-256 over (name, dtype, shape, digest) of each tensor in name order. It
identifies weights (lineage, adapters naming their base, "is this the model I exported"); it is not a
defence against someone forging a collision.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Iterable, Mapping, Sequence

import torch

_M32 = 0xFFFFFFFF
# Per lane: (index multiplier, offset, value multiplier), as signed 32-bit constants (odd multipliers).
_LANES = ((-1640531535, 0x3C6EF372, -2048144789), (0x27D4EB2F, 0x165667B1, -1028477387))
_CHUNK = 1 << 22  # elements mixed at a time: bounded scratch memory


def _bits32(t: torch.Tensor) -> torch.Tensor:
    """Each element's bit pattern as int32 (a view where the dtype is 32-bit: no copy)."""
    t = t.detach()
    if t.dtype in (torch.float32, torch.int32):
        return t.contiguous().view(torch.int32)
    if t.dtype in (torch.bfloat16, torch.float16, torch.int16):
        return t.contiguous().view(torch.int16).to(torch.int32)
    if t.dtype in (torch.float64, torch.int64):
        x = t.contiguous().view(torch.int64)
        return ((x ^ (x >> 32)) & _M32).to(torch.int32)
    return t.to(torch.int32)


def _mix(bits: torch.Tensor, index: torch.Tensor, seed: int) -> list[int]:
    """Per lane, the sum over elements of mix(value bits, global index) in wrapping int32 arithmetic."""
    out = []
    for a, b, c in _LANES:
        h = (bits ^ (index * a + (b ^ seed))) * c
        h = h ^ (h >> 15)
        out.append(int(h.sum(dtype=torch.int64).item()) & _M32)
    return out


def partial_digest(
    name: str, t: torch.Tensor, offset: tuple[int, ...] | None = None, full_shape: tuple[int, ...] | None = None
) -> list[int]:
    """[lane0, lane1] of the elements of `t`, a box of the tensor `name` of `full_shape` starting at `offset`
    (the whole tensor by default); partial digests of disjoint boxes add up (mod 2^32) to the whole's.
    Global indices wrap at 2^32 (int32 arithmetic): it identifies weights, it is not a cryptographic hash."""
    shape = tuple(t.shape)
    offset = tuple(offset or (0,) * len(shape))
    full_shape = tuple(full_shape or shape)
    seed = zlib.crc32(name.encode()) & 0x7FFFFFFF
    bits = _bits32(t)
    if len(shape) > 2:  # rows of the trailing dims' flat layout: only a box whole in those dims is allowed
        assert shape[1:] == full_shape[1:], "a box of a >2-D tensor must be whole in its trailing dims"
        bits, shape = bits.reshape(shape[0], -1), (shape[0], bits[0].numel())
        offset, full_shape = (offset[0], 0), (full_shape[0], shape[1])
    if len(shape) == 0:
        bits, shape, offset, full_shape = bits.reshape(1), (1,), (0,), (1,)
    sums = [0, 0]
    dev = bits.device
    if len(shape) == 1:
        for start in range(0, shape[0], _CHUNK):
            chunk = bits[start : start + _CHUNK]
            index = torch.arange(chunk.numel(), dtype=torch.int32, device=dev) + (offset[0] + start) % 2**31
            sums = [(x + y) & _M32 for x, y in zip(sums, _mix(chunk, index, seed), strict=True)]
        return sums
    rows, cols = shape
    cols_index = torch.arange(cols, dtype=torch.int32, device=dev) + offset[1]
    step = max(1, _CHUNK // max(cols, 1))
    for start in range(0, rows, step):
        chunk = bits[start : start + step]
        first = offset[0] + start
        row_base = ((torch.arange(chunk.shape[0], dtype=torch.int64, device=dev) + first) * full_shape[1]) & _M32
        index = row_base.to(torch.int32)[:, None] + cols_index[None, :]  # wraps at 2^32, like the mix
        sums = [(x + y) & _M32 for x, y in zip(sums, _mix(chunk, index, seed), strict=True)]
    return sums


def combine(digests: Mapping[str, list[int]], meta: Mapping[str, tuple[str, tuple[int, ...]]]) -> str:
    """The weights hash from each tensor's digest and (dtype name, shape)."""
    h = hashlib.sha256()
    for name in sorted(digests):
        dtype, shape = meta[name]
        lane0, lane1 = (x & _M32 for x in digests[name])
        h.update(f"{name}\0{dtype}\0{tuple(shape)}\0{lane0:08x}{lane1:08x}\n".encode())
    return h.hexdigest()


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def weights_hash(tensors: Mapping[str, torch.Tensor]) -> str:
    """The hash of whole tensors held in this process."""
    digests = {name: partial_digest(name, t) for name, t in tensors.items()}
    return combine(digests, {name: (_dtype_name(t), tuple(t.shape)) for name, t in tensors.items()})


def sharded_weights_hash(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """The hash of parameters that may be DTensors sharded over the job's ranks, equal to `weights_hash` of
    the full tensors. Each rank digests only the box it holds (once across replicas); one all-reduce of two
    integers per tensor when distributed. Every rank must call it (it returns the same on all)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate

    from plait.core.torch_private import local_box

    distributed = dist.is_initialized() and dist.get_world_size() > 1
    names, meta, parts = [], {}, []
    for name, p in named:
        names.append(name)
        meta[name] = (_dtype_name(p), tuple(p.shape))
        if isinstance(p, DTensor):
            coord: Sequence[int] = p.device_mesh.get_coordinate() or ()
            replica = any(isinstance(pl, Replicate) and c != 0 for pl, c in zip(p.placements, coord, strict=False))
            _, offset = local_box(p)
            local = p.to_local()
            empty = replica or local.numel() == 0
            parts.append([0, 0] if empty else partial_digest(name, local, offset, tuple(p.shape)))
        else:  # a plain tensor is the same on every rank: counted on rank 0 only
            mine = not distributed or dist.get_rank() == 0
            parts.append(partial_digest(name, p) if mine else [0, 0])
    if distributed:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        sums = torch.tensor(parts or [[0, 0]], dtype=torch.int64, device=device)
        dist.all_reduce(sums)
        parts = (sums.cpu() & _M32).tolist()
    return combine(dict(zip(names, parts, strict=True)), meta)
