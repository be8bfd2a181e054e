"""Newton-Schulz orthogonalisation of sharded matrices, each matrix once, by one rank of its shard group.

Muon (plait.engine.muon) needs every matrix whole, and plait keeps them split: FSDP2 by rows, tensor parallelism
by rows or columns, both at once, experts over the expert-parallel ranks. The simple design gathers every
matrix on every rank and orthogonalises it there N times over. Here the matrices of one kind (global shape,
mesh and placements) are taken N at a time, N being the size of the ranks that split them: stacked, their
shards form one tensor split along its matrix dimensions, which DTensor redistributes to a split along the
stack, so that each rank of the group holds one whole matrix (an all-to-all). Each rank orthogonalises its own,
and the reverse redistribution sends the shards back. The next round's exchange is issued before this round's
iteration, so the two overlap.

Bytes per matrix of S bytes, summed over a group of N ranks: AdamW moves none; every-rank-gathers-everything
moves (N - 1) S; this moves 2 (N - 1) / N S (there and back), N/2 times less, and computes each matrix once
instead of N times. (Under gloo, DTensor replaces the all-to-all by an all-gather and a local chunk: the CPU
moves the simple design's bytes, the GPU these.)

A matrix no rank splits (one process, pure data parallelism, replicas, whole experts on their expert-parallel
rank) is orthogonalised where it lives, expert stacks batched, with no communication. A stack of experts split
inside its matrices, which plait's layouts never produce, is gathered whole on every rank (correct, not fast).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from plait.core import torch_private


def newton_schulz(
    g: torch.Tensor, *, steps: int, coefficients: tuple[float, float, float], eps: float, dtype: torch.dtype
) -> torch.Tensor:
    """The quintic Newton-Schulz iteration of torch.optim.Muon (its coefficients and step count), batched over
    leading dimensions (a stack of experts), in `dtype` (bf16 on a GPU as torch's; fp32 for exact parity on a
    CPU). Returns about U V^T of G = U S V^T, in g's dtype.

    steps=0 is Muon's control, not Muon (optim.muon_ns_steps=0): G itself, scaled to the Frobenius norm
    of an orthogonal matrix of its shape (sqrt(min(A, B))), so that the update has Muon's size and G's direction
    and a difference between the two is the orthogonalisation's, not the step's size."""
    if g.numel() == 0:
        return g.clone()
    a, b, c = coefficients
    x = g.to(dtype)
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)  # spectral norm at most 1
    if steps == 0:
        x = x * math.sqrt(min(x.shape[-2:]))
    mm, add = (torch.mm, torch.addmm) if x.ndim == 2 else (torch.bmm, torch.baddbmm)
    flat = x.reshape(-1, *x.shape[-2:]) if x.ndim > 3 else x
    for _ in range(steps):
        gram = mm(flat, flat.mT)
        poly = add(gram, gram, gram, beta=b, alpha=c)
        flat = add(flat, poly, flat, beta=a)
    x = flat.reshape(x.shape)
    if tall:
        x = x.mT
    return x.to(g.dtype)


Orthogonalise = Callable[[torch.Tensor], torch.Tensor]


def split_mesh_dims(t: torch.Tensor) -> list[int]:
    """The mesh dimensions that split a DTensor inside its matrices (its last two dimensions)."""
    if not isinstance(t, DTensor):
        return []
    found = []
    for i, p in enumerate(t.placements):
        dim = torch_private.sharded_dim(p)
        if dim is not None and (dim if dim >= 0 else dim + t.ndim) >= t.ndim - 2:
            found.append(i)
    return found


@dataclass
class _Kind:
    """Matrices of one global shape, mesh and placements: orthogonalised N at a time."""

    mesh: object
    placements: tuple
    shape: tuple[int, ...]
    split: list[int]
    members: list[int] = field(default_factory=list)

    @property
    def group_size(self) -> int:
        return math.prod(self.mesh.size(d) for d in self.split)  # type: ignore[attr-defined]

    def my_index(self) -> int:
        """This rank's position in the stack after the exchange (row-major over the split mesh dimensions)."""
        coord = self.mesh.get_coordinate()  # type: ignore[attr-defined]
        index = 0
        for d in self.split:
            index = index * self.mesh.size(d) + coord[d]  # type: ignore[attr-defined]
        return index


def orthogonalise_all(
    matrices: list[torch.Tensor], local_of: Callable[[int], torch.Tensor], ns: Orthogonalise
) -> Iterator[tuple[int, torch.Tensor]]:
    """(index, this rank's shard of the orthogonalised update) of each matrix, yielded as each is ready.
    matrices: the parameters (DTensor or plain: their global shape and placements); local_of(i): this rank's
    local momentum update of matrix i, asked for only when it is needed. So the caller applies each update
    before the next is made, and a rank holds a few whole matrices at a time, not a copy of all of them
    (plait.planner.cost.muon.TRANSIENT_MATRICES)."""
    kinds: dict[tuple, _Kind] = {}
    for i, u in enumerate(matrices):
        split = split_mesh_dims(u)
        if not split:
            yield i, ns(local_of(i))  # whole where it lives (batched over a stack of experts)
        elif u.ndim != 2:
            yield i, _gathered_everywhere(u, local_of(i), ns)
        else:
            assert isinstance(u, DTensor)
            key = (id(u.device_mesh), tuple(u.placements), tuple(u.shape))
            kind = kinds.setdefault(key, _Kind(u.device_mesh, tuple(u.placements), tuple(u.shape), split))
            kind.members.append(i)
    rounds = [(kind, kind.members[s : s + kind.group_size]) for kind in kinds.values() for s in _starts(kind)]
    yield from _exchange_rounds(rounds, local_of, ns)


def _starts(kind: _Kind) -> range:
    return range(0, len(kind.members), kind.group_size)


def _exchange_rounds(
    rounds: list, local_of: Callable[[int], torch.Tensor], ns: Orthogonalise
) -> Iterator[tuple[int, torch.Tensor]]:
    """Each round: stack, exchange (issued one round ahead), orthogonalise this rank's matrix, send it back;
    a round's shards are yielded once the next round's are on their way back."""
    pending = _gather_round(rounds[0], local_of) if rounds else None
    sent: tuple[list[int], DTensor] | None = None
    for r, (kind, members) in enumerate(rounds):
        whole = pending
        pending = _gather_round(rounds[r + 1], local_of) if r + 1 < len(rounds) else None
        assert whole is not None
        mine = whole.to_local()
        if kind.my_index() < len(members):
            mine = ns(mine)  # else a zero matrix that only fills the round
        if sent is not None:
            yield from _returned(*sent)
        sent = (members, _scatter_round(kind, mine))
    if sent is not None:
        yield from _returned(*sent)


def _returned(members: list[int], back: DTensor) -> Iterator[tuple[int, torch.Tensor]]:
    shards = back.to_local()  # waits for the round's return
    for j, i in enumerate(members):
        yield i, shards[j]


def _stacked_placements(kind: _Kind) -> tuple[list, list]:
    """(the stack's placements as the matrices lie, the stack split one matrix per rank of the split group)."""
    lying = [torch_private.shifted_placement(p, 1) for p in kind.placements]
    whole = [Shard(0) if d in kind.split else p for d, p in enumerate(kind.placements)]
    assert all(isinstance(p, Shard | Replicate) for p in whole), kind.placements
    return lying, whole


def _gather_round(round_: tuple[_Kind, list[int]], local_of: Callable[[int], torch.Tensor]) -> DTensor:
    kind, members = round_
    n = kind.group_size
    parts = [local_of(i) for i in members]
    parts += [torch.zeros_like(parts[0])] * (n - len(parts))
    lying, whole = _stacked_placements(kind)
    shape = torch.Size((n, *kind.shape))
    stack = DTensor.from_local(
        torch.stack(parts),
        kind.mesh,  # type: ignore[arg-type]
        lying,
        run_check=False,
        shape=shape,
        stride=_stride(shape),
    )
    return stack.redistribute(kind.mesh, whole, async_op=True)  # type: ignore[arg-type]


def _scatter_round(kind: _Kind, mine: torch.Tensor) -> DTensor:
    lying, whole = _stacked_placements(kind)
    shape = torch.Size((kind.group_size, *kind.shape))
    done = DTensor.from_local(mine, kind.mesh, whole, run_check=False, shape=shape, stride=_stride(shape))  # type: ignore[arg-type]
    return done.redistribute(kind.mesh, lying, async_op=True)  # type: ignore[arg-type]


def _stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))


def _gathered_everywhere(u: torch.Tensor, local: torch.Tensor, ns: Orthogonalise) -> torch.Tensor:
    """A stack split inside its matrices: gathered whole on every rank, this rank's box of the result kept."""
    assert isinstance(u, DTensor)
    spec = DTensor.from_local(local, u.device_mesh, u.placements, run_check=False, shape=u.shape, stride=u.stride())
    whole = ns(spec.full_tensor())
    shape, offset = torch_private.local_box(u)
    return whole[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
