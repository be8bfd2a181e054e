"""Health checks of the collectives: every op on every mesh axis with more than one rank, checked against known
values and timed like nccl-tests (algbw, busbw), for `plait doctor` and the check before training
(plait.features.health, which gathers these rows into its report)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from plait.core.collectives import all_gather_single, reduce_scatter_single
from plait.parallel.dims import AXES, Meshes

MiB = 1 << 20
DEFAULT_SIZES = (1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB)
OPS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factors: what each rank's links carry relative to the algorithm bandwidth
    (data size / time), so busbw is comparable with the hardware's link speed whatever n is."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    return 1.0  # send/recv: every byte crosses one link once


def format_size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", 1024)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def device_sync(device: torch.device) -> None:
    """Wait for the device's queued work (a timer around asynchronous kernels measures nothing otherwise)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class CollectiveRow:
    axis: str
    degree: int
    op: str
    nbytes: int  # nccl-tests' size: the full buffer (all-gather output, reduce-scatter input)
    seconds: float = math.nan  # per operation, slowest rank; nan when only checked
    wrong_ranks: list[int] = field(default_factory=list)

    @property
    def algbw(self) -> float:
        return self.nbytes / self.seconds / 1e9

    @property
    def busbw(self) -> float:
        return self.algbw * bus_factor(self.op, self.degree)


def _pattern(numel: int, device: torch.device, shift: int | torch.Tensor = 0) -> torch.Tensor:
    """Small integers 1..13 (exact in fp32 even after summing over 10^5 ranks)."""
    return ((torch.arange(numel, device=device) + shift) % 13 + 1).float()


def _prepare(op: str, group, numel: int, device: torch.device):
    """Buffers with known values for `op` over `group`, a function issuing it, and one checking the result
    of its first run (max absolute error, a 0-d tensor: no device sync)."""
    n, r = group.size(), group.rank()
    m = numel // n  # per-rank chunk
    if op == "all_reduce":
        x = _pattern(numel, device) * (r + 1)
        expected = _pattern(numel, device) * (n * (n + 1) / 2)
        return (lambda: dist.all_reduce(x, group=group)), (lambda: (x - expected).abs().max())
    if op == "all_gather":
        x = _pattern(m, device) + 16 * r
        out = torch.empty(n * m, device=device)
        expected = _pattern(m, device).repeat(n) + 16 * torch.arange(n, device=device).repeat_interleave(m)
        return (lambda: all_gather_single(out, x, group=group)), (lambda: (out - expected).abs().max())
    if op == "reduce_scatter":
        idx = torch.arange(n * m, device=device)
        x = ((idx % m + idx // m) % 13 + 1).float() * (r + 1)  # chunk c holds (i + c) % 13 + 1, scaled by r + 1
        out = torch.empty(m, device=device)
        expected = _pattern(m, device, shift=r) * (n * (n + 1) / 2)
        return (lambda: reduce_scatter_single(out, x, group=group)), (lambda: (out - expected).abs().max())
    # send/recv around the axis ring: send to the next rank, receive from the previous one
    nxt, prv = dist.get_global_rank(group, (r + 1) % n), dist.get_global_rank(group, (r - 1) % n)
    x, out = _pattern(numel, device) * (r + 1), torch.empty(numel, device=device)
    expected = _pattern(numel, device) * ((r - 1) % n + 1)

    def run():
        ops = [dist.P2POp(dist.isend, x, nxt, group), dist.P2POp(dist.irecv, out, prv, group)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()

    return run, (lambda: (out - expected).abs().max())


def axis_groups(meshes: Meshes | None) -> list[tuple[str, int, object]]:
    """(axis, degree, this rank's process group) for every mesh axis with more than one rank."""
    if meshes is None:
        return []
    degrees = {"pp": meshes.dims.pp, "dp_replicate": meshes.dims.dp_replicate, "dp_shard": meshes.dims.dp_shard}
    degrees.update(cp=meshes.dims.cp, tp=meshes.dims.tp)
    return [(axis, degrees[axis], meshes.world.get_group(axis)) for axis in AXES if degrees[axis] > 1]


def check_collectives(
    meshes: Meshes | None, device: torch.device, sizes: tuple[int, ...], iters: int
) -> list[CollectiveRow]:
    """Every op on every axis and size: one run checked against known values, then `iters` timed runs.

    Communication plan: all groups of one axis run the op at once (as training does), one axis at a time;
    the results (errors and times per rank) are all-gathered over the world at the end, so every rank
    returns the same rows: the time of the slowest rank, and the ranks that received wrong values.
    """
    rows, errors, times = [], [], []
    for axis, degree, group in axis_groups(meshes):
        for op in OPS:
            for nbytes in sizes:
                numel = max(degree, nbytes // 4 // degree * degree)
                run, check = _prepare(op, group, numel, device)
                run()
                errors.append(check())
                seconds = math.nan
                if iters > 0:
                    dist.all_reduce(torch.zeros(1, device=device), group=group)  # start together
                    device_sync(device)
                    start = time.perf_counter()
                    for _ in range(iters):
                        run()
                    device_sync(device)
                    seconds = (time.perf_counter() - start) / iters
                times.append(seconds)
                rows.append(CollectiveRow(axis, degree, op, numel * 4))
    if not rows:
        return rows
    mine = torch.stack([torch.stack(errors).float(), torch.tensor(times, device=device)], dim=1)  # (rows, 2)
    gathered = torch.empty(dist.get_world_size() * mine.numel(), device=device)
    all_gather_single(gathered, mine.flatten())
    per_rank = gathered.view(-1, *mine.shape).cpu()  # (world, rows, 2)
    for i, row in enumerate(rows):
        err, secs = per_rank[:, i, 0], per_rank[:, i, 1]
        row.wrong_ranks = [r for r, e in enumerate(err.tolist()) if e != 0]
        row.seconds = secs.max().item()
    return rows
