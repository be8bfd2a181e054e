"""Health checks: does every device compute correctly, and does every collective on every mesh axis deliver
the right values, at what bus bandwidth?

`plait doctor [--nproc N] [CONFIG] [--parallel.*=...]` runs everything and prints an nccl-tests-style table
per mesh axis; `plait train` runs the quick part before the first step (run.health_check_enabled): the
arithmetic check and each collective once at a small size, and refuses to start when a rank is wrong.

The collectives' checks are plait.features.health_collectives; this module has the arithmetic check, the
report that judges both, and the check before training. Tests make a rank's arithmetic wrong or slow through
COMPUTE_FAULTS (plait.features.faults fills it).
"""

from __future__ import annotations

import hashlib
import math
import os
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist

from plait.core import torch_private
from plait.core.errors import PlaitError
from plait.core.hardware import device_info
from plait.engine.callbacks import Callback, RunState
from plait.features.health_collectives import (  # noqa: F401 - `plait doctor` and the tests import them from here
    DEFAULT_SIZES,
    OPS,
    CollectiveRow,
    MiB,
    axis_groups,
    bus_factor,
    check_collectives,
    device_sync,
    format_size,
)
from plait.parallel.dims import Meshes

COMPUTE_FAULTS: list[Callable[[str, int, torch.Tensor], None]] = []
"""Test hooks on the matmul check, called with (moment, rank, result): "timed" after each timed matmul, "result"
before the result is compared. plait.features.faults installs them when asked to; nothing else does."""
PREFLIGHT_BYTES = 64 * 1024  # one small size: correctness, not speed, before training
# fp32 matmul vs an fp64 reference, error relative to max |C|: 512 products of N(0, 1) values per element
# were seen 4e-7 off on this CPU (MKL); the error grows ~sqrt(K), so K=2048 on a GPU expects ~1e-6.
# 1e-4 leaves two orders of headroom for other BLAS libraries and still catches a wrong element or a
# flipped bit in the top 13 of the mantissa. The checksum compares fp64 sums of C: seen 2e-9.
MATMUL_RTOL = 1e-4
CHECKSUM_RTOL = 1e-4


# ------------------------------------------------------------------------------------------ arithmetic


@dataclass
class ComputeResult:
    rank: int
    host: str
    device: str
    size: int  # the matmul is (size x size) @ (size x size) in fp32
    seconds: float  # median of the repetitions over a sustained window (see check_compute)
    matmul_err: float  # max |C - C_fp64| / max |C_fp64|
    checksum_err: float  # column sums of C against (column sums of A) @ B, relative
    fingerprint: str  # hash of C's bytes: equal devices should agree bit for bit
    best_seconds: float = 0.0  # the fastest repetition: far below the median when a GPU is shared
    cpu_contention: float | None = None  # CPU ranks on Linux: see run_queue_contention

    @property
    def contention(self) -> float:
        """How much slower than on a device of its own: about 1 alone, ~2 when another process takes turns.
        A CPU rank: the scheduler's own account of its threads (run_queue_contention). Otherwise median / best
        time, a weaker sign: a matmul shorter than a time slice often runs whole between turns."""
        if self.cpu_contention is not None:
            return self.cpu_contention
        return self.seconds / self.best_seconds if self.best_seconds > 0 else 1.0

    @property
    def tflops(self) -> float:
        return 2 * self.size**3 / self.seconds / 1e12

    @property
    def wrong(self) -> str | None:
        if not math.isfinite(self.matmul_err) or self.matmul_err > MATMUL_RTOL:
            return f"matmul differs from the fp64 reference (max rel err {self.matmul_err:.1e} > {MATMUL_RTOL:.0e})"
        if not math.isfinite(self.checksum_err) or self.checksum_err > CHECKSUM_RTOL:
            return f"matmul checksum is off (rel err {self.checksum_err:.1e} > {CHECKSUM_RTOL:.0e})"
        return None


TIMING_WINDOW_S = 0.1  # long enough that a task sharing the core shows (see check_compute)
MAX_REPS = 2000
# contention above this: something shares the rank's device. On a CPU the measure is exact (alone 1.00, beside a
# busy loop on its core 1.96-2.04, 2-core VM); a GPU's median / best swings more (1.2 alone is common).
SHARED_CPU = 1.3
SHARED_GPU = 1.5
BUSY_THREAD = 0.1  # threads that ran less than this share of the window (idle helpers) are not judged


def _schedstat() -> dict[str, tuple[int, int]]:
    """This process's threads: tid -> (ns on a CPU, ns waiting on a run queue), from Linux's schedstat;
    empty where the kernel does not expose it."""
    out: dict[str, tuple[int, int]] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                run, wait = f.read().split()[:2]
            out[tid] = (int(run), int(wait))
        except (OSError, ValueError):
            continue
    return out


def run_queue_contention(before: dict, after: dict, wall_s: float) -> float | None:
    """(time on a CPU + time ready but waiting for one) / time on a CPU, for the busiest-hit thread that ran
    at least BUSY_THREAD of the window: 1.0 on cores of its own, 2.0 beside one busy loop. Sleeping is not
    waiting, so a rank that blocks (a barrier, an injected delay) is not counted as shared (docs/measurements.md,
    "health: run-queue contention")."""
    worst = None
    for tid, (run1, wait1) in after.items():
        run0, wait0 = before.get(tid, (run1, wait1))
        ran = run1 - run0
        if ran > 0 and ran >= BUSY_THREAD * wall_s * 1e9:
            worst = max(worst or 0.0, (ran + wait1 - wait0) / ran)
    return worst


def check_compute(
    device: torch.device,
    rank: int,
    size: int | None = None,
    reps: int = 5,
    turns: tuple[int, int] | None = None,
    min_seconds: float = TIMING_WINDOW_S,
) -> ComputeResult:
    """A seeded fp32 matmul on this device, timed and compared with an fp64 reference and an ABFT checksum
    (the column sums of C must equal the column sums of A times B).

    Timing: at least `reps` matmuls and at least `min_seconds` of them back to back, reported as the median
    (not the best: beside a CPU hog the first matmuls after a barrier run at full speed). Whether another
    process shares a CPU rank's cores is read from the scheduler (run_queue_contention), not guessed from the
    spread of times: a small matmul often fits inside one time slice, so beside a busy loop its median / best
    says little (docs/measurements.md, "health: why not the spread of times").

    turns=(local_rank, local_world_size): processes that share the CPU time their matmul one at a time
    (a barrier over the world between turns), or the timings would measure each other."""
    size = size or (2048 if device.type == "cuda" else 512)
    gen = torch.Generator().manual_seed(20240901)
    a = torch.randn(size, size, generator=gen).to(device)
    b = torch.randn(size, size, generator=gen).to(device)
    with _highest_precision():
        times: list[float] = []
        c: torch.Tensor | None = None
        contention: float | None = None
        for turn in range(turns[1] if turns else 1):
            if turns is None or turn == turns[0]:
                begin, sched = time.perf_counter(), _schedstat()
                end = begin + min_seconds
                while len(times) < reps or (time.perf_counter() < end and len(times) < MAX_REPS):
                    device_sync(device)
                    start = time.perf_counter()
                    c = a @ b
                    for fault in COMPUTE_FAULTS:
                        fault("timed", rank, c)
                    device_sync(device)
                    times.append(time.perf_counter() - start)
                if device.type == "cpu" and sched:
                    contention = run_queue_contention(sched, _schedstat(), time.perf_counter() - begin)
            if turns is not None:
                dist.barrier()
        assert c is not None  # noqa: S101  # this rank's turn ran at least one matmul
        for fault in COMPUTE_FAULTS:
            fault("result", rank, c)
        ref = a.double() @ b.double()
        colsum = a.double().sum(0) @ b.double()
        errs = torch.stack(
            [
                (c.double() - ref).abs().max() / ref.abs().max(),
                (c.double().sum(0) - colsum).abs().max() / (a.double().abs().sum(0) @ b.double().abs()).max(),
            ]
        ).tolist()
    fingerprint = hashlib.sha1(c.cpu().numpy().tobytes()).hexdigest()[:10]
    name = device_info(device).name
    median, best = statistics.median(times), min(times)
    return ComputeResult(
        rank, socket.gethostname(), name, size, median, errs[0], errs[1], fingerprint, best, contention
    )


def _highest_precision():
    """The reference comparison needs true fp32 matmuls, not TF32 (which a run may have switched on); nothing of
    it stays (the compile cache's keys hold the precision settings)."""
    return torch_private.highest_fp32_matmuls()


# ------------------------------------------------------------------------------------------ the report


@dataclass
class HealthReport:
    compute: list[ComputeResult]
    collectives: list[CollectiveRow]
    slow_ratio: float
    seconds: float = 0.0

    def wrong(self) -> dict[int, list[str]]:
        """Ranks whose results are wrong, with the reasons."""
        out: dict[int, list[str]] = {}
        for c in self.compute:
            if c.wrong:
                out.setdefault(c.rank, []).append(c.wrong)
        for row in self.collectives:
            for r in row.wrong_ranks:
                why = f"{row.op} on axis {row.axis} delivered wrong values ({format_size(row.nbytes)})"
                out.setdefault(r, []).append(why)
        return out

    def slow(self) -> dict[int, float]:
        """Ranks whose matmul takes more than slow_ratio x the median of their peers: rank -> ratio."""
        if len(self.compute) < 2 or self.slow_ratio <= 0:
            return {}
        out = {}
        for c in self.compute:
            peers = statistics.median(o.seconds for o in self.compute if o.rank != c.rank)
            ratio = c.seconds / max(peers, 1e-12)
            if ratio > self.slow_ratio:
                out[c.rank] = ratio
        return out

    def disagree(self) -> list[int]:
        """Ranks whose matmul bits differ from the majority of the same device model (a warning only:
        different BLAS builds may legitimately round differently)."""
        out = []
        for c in self.compute:
            peers = [o.fingerprint for o in self.compute if o.device == c.device]
            majority = max(set(peers), key=peers.count)
            if peers.count(majority) > len(peers) / 2 and c.fingerprint != majority:
                out.append(c.rank)
        return out

    def contended(self) -> dict[int, float]:
        """Ranks that share their device with another process: rank -> contention (see ComputeResult)."""
        return {
            c.rank: c.contention
            for c in self.compute
            if c.contention > (SHARED_CPU if c.cpu_contention is not None else SHARED_GPU)
        }

    def problems(self) -> list[str]:
        by_rank = {c.rank: c for c in self.compute}
        lines = [f"rank {r} ({_where(by_rank.get(r))}): {'; '.join(why)}" for r, why in sorted(self.wrong().items())]
        for r, ratio in sorted(self.contended().items()):
            c = by_rank[r]
            if c.cpu_contention is not None:
                seen = f"its threads waited for a core {100 * (1 - 1 / ratio):.0f}% of the matmul window"
            else:
                seen = f"its matmul takes {1e3 * c.best_seconds:.1f} ms at best but {1e3 * c.seconds:.1f} ms typically"
            lines.append(
                f"rank {r} ({_where(c)}) shares its device: {seen} ({ratio:.1f}x slower); another process is using "
                f"its cores or GPU (see top / nvidia-smi)"
            )
        for r, ratio in sorted(self.slow().items()):
            c = by_rank[r]
            lines.append(
                f"rank {r} ({_where(c)}) is slow: {ratio:.1f}x its peers' median time for a {c.size}x{c.size} "
                f"matmul ({1e3 * c.seconds:.1f} ms)"
            )
        return lines


def _where(c: ComputeResult | None) -> str:
    return f"{c.host}, {c.device}" if c else "?"


def run_checks(
    device: torch.device,
    rank: int,
    meshes: Meshes | None,
    *,
    sizes: tuple[int, ...] = (PREFLIGHT_BYTES,),
    iters: int = 0,
    slow_ratio: float = 2.0,
) -> HealthReport:
    """All checks on this rank; with a process group, every rank returns the same report."""
    start = time.perf_counter()
    turns = None
    if device.type == "cpu" and dist.is_initialized() and dist.get_world_size() > 1:  # ranks share the cores
        world = dist.get_world_size()
        turns = (int(os.environ.get("LOCAL_RANK", rank)), int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    mine = check_compute(device, rank, turns=turns)
    compute = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        compute = cast("list[ComputeResult]", [None] * dist.get_world_size())  # all_gather_object fills it
        dist.all_gather_object(compute, mine)
    rows = check_collectives(meshes, device, sizes, iters)
    return HealthReport(compute, rows, slow_ratio, time.perf_counter() - start)


def run_health_check(cfg, env, meshes: Meshes | None) -> HealthReport | None:
    """The check before training (run.health_check_enabled): refuse to start when a rank computes or
    communicates wrongly; warn about a slow rank. Every rank decides alike (the report is gathered)."""
    if not cfg.run.health_check_enabled:
        return None
    from plait.engine.metrics import info, warn

    report = run_checks(env.device, env.rank, meshes, slow_ratio=cfg.guard.straggler_ratio or 2.0)
    wrong = report.wrong()
    if wrong:
        raise PlaitError(
            "health check failed, training not started: "
            + "; ".join(p for p in report.problems() if "is slow" not in p)
            + f". Run `plait doctor --nproc {env.world_size}` with the same [parallel] options for details, "
            "or set run.health_check_enabled=false to train anyway"
        )
    fewer = fit_threads_to_free_cores(report, env.rank, env.device)
    if env.is_main:
        for line in report.problems():
            warn(f"health check: {line}")
        if fewer:
            warn(f"health check: {fewer}")
        axes = ", ".join(dict.fromkeys(f"{r.axis}({r.degree})" for r in report.collectives))
        err = max(x.matmul_err for x in report.compute)
        info(
            f"health check ok: {len(report.compute)} rank(s), matmul vs fp64 {err:.0e}"
            + (f", collectives on {axes}" if axes else "")
            + f" [{report.seconds:.2f} s]"
        )
    return report


def threads_for_free_cores(threads: int, contention: float) -> int:
    """The threads that fit the cores left to this process: its threads over the run-queue contention (2.0:
    half its time waiting for a core), at least 1. Beside a busy process, compute threads that outnumber the
    free cores wait for each other at every parallel region (measured: 2 threads beside one busy loop on two
    cores trained 2.4x slower than 1)."""
    return max(1, min(threads, round(threads / max(contention, 1.0))))


def fit_threads_to_free_cores(report: HealthReport, rank: int, device: torch.device) -> str:
    """On a CPU rank whose cores another process shares: fewer torch threads (threads_for_free_cores), unless
    OMP_NUM_THREADS chose them; returns what was done, to be said ('' for nothing)."""
    mine = next((c for c in report.compute if c.rank == rank), None)
    if device.type != "cpu" or mine is None or mine.cpu_contention is None or mine.cpu_contention <= SHARED_CPU:
        return ""
    threads = torch.get_num_threads()
    fewer = threads_for_free_cores(threads, mine.cpu_contention)
    if fewer >= threads or os.environ.get("OMP_NUM_THREADS"):
        return ""
    torch.set_num_threads(fewer)
    return (
        f"training with {fewer} CPU thread{'s' if fewer > 1 else ''} instead of {threads}: another process uses "
        f"the cores ({mine.cpu_contention:.1f}x run-queue contention); set OMP_NUM_THREADS to choose"
    )


class HealthCheck(Callback):
    """run_health_check before the model is built (run.health_check_enabled). Where it lowered torch's threads
    (fit_threads_to_free_cores: another process held the cores), the run puts them back when it ends, so that the
    next run in the same process (a sweep, a notebook) starts from the threads it was given and measures its own
    moment: before, one busy moment left every later run of the process on fewer threads."""

    def __init__(self) -> None:
        self.threads: int | None = None

    def on_setup(self, run: RunState) -> None:
        self.threads = torch.get_num_threads()
        run_health_check(run.cfg, run.env, run.meshes)

    def close(self, run: RunState) -> None:
        if self.threads is not None and torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
