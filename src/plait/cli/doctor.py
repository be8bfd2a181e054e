"""`plait doctor [--nproc N] [CONFIG] [--parallel.*=...]`: every health check of plait.features.health at several sizes,
printed as an nccl-tests-style table per mesh axis (a command: it launches workers and parses arguments)."""

from __future__ import annotations

import os
import sys

from plait.cli.args import config_argv, config_parser, parse_config_args
from plait.cli.run import run_worker
from plait.core.errors import ConfigError, PlaitError
from plait.features.health import (
    DEFAULT_SIZES,
    OPS,
    TIMING_WINDOW_S,
    HealthReport,
    MiB,
    format_size,
    run_checks,
)
from plait.parallel.dims import Meshes, ParallelDims

DOCTOR_DESCRIPTION = """\
Check the machine before a run: each rank's device computes a seeded fp32 matmul, compared with an fp64
reference and a checksum (and timed: a rank over guard.straggler_ratio x its peers' median is slow); then
all-reduce, all-gather, reduce-scatter and send/recv run on every mesh axis of the [parallel] layout,
checked against known values and timed over a size sweep, reported like nccl-tests (algbw = size / time;
busbw = algbw x 2(n-1)/n for all-reduce, (n-1)/n for all-gather and reduce-scatter, 1 for send/recv).
Exits 1 naming the rank when a rank is wrong or slow. Under torchrun:
`torchrun --nproc-per-node N -m plait doctor [...]`."""


def parse_sizes(text: str) -> tuple[int, ...]:
    """'64K,1M,4M' -> bytes."""
    units = {"": 1, "B": 1, "K": 1024, "KB": 1024, "KIB": 1024, "M": MiB, "MB": MiB, "MIB": MiB, "G": 1 << 30}
    out = []
    for item in text.split(","):
        item = item.strip().upper()
        number = item.rstrip("KMGIB")
        try:
            value = int(float(number) * units[item[len(number) :]])
        except (ValueError, KeyError):
            raise ConfigError(f"--sizes entry {item!r} is not a size; use e.g. 64K,1M,16M") from None
        if value < 4:
            raise ConfigError(f"--sizes entry {item!r} is below one fp32 element")
        out.append(value)
    return tuple(out)


def cmd_doctor(argv: list[str]) -> int:
    parser = config_parser("plait doctor", DOCTOR_DESCRIPTION)
    parser.add_argument("--nproc", type=int, metavar="N", help="local workers (default: one per visible GPU, else 1)")
    parser.add_argument(
        "--sizes", metavar="LIST", help="message sizes of the collectives, e.g. 64K,1M (default: 1M,4M,16M,64M)"
    )
    parser.add_argument(
        "--iters", type=int, metavar="N", help="timed iterations per size (default: 20 on a GPU, else 5)"
    )
    a, settings = parse_config_args(parser, argv)
    sizes = parse_sizes(a.sizes) if a.sizes else DEFAULT_SIZES
    if a.iters is not None and a.iters < 1:
        raise ConfigError(f"--iters={a.iters} must be at least 1")
    from plait.config import load_config

    cfg = load_config(a.config, settings)
    if "WORLD_SIZE" not in os.environ:  # not yet inside a launched worker
        from plait.cli.launch import default_nproc

        nproc = default_nproc() if a.nproc is None else a.nproc
        if nproc < 1:
            raise ConfigError(f"--nproc={nproc} must be at least 1")
        ParallelDims.from_config(cfg.parallel, nproc)  # refuse an impossible layout before starting workers
        if nproc > 1:
            own = [f"--{k}={v}" for k, v in (("sizes", a.sizes), ("iters", a.iters)) if v is not None]
            return _launch(nproc, [*config_argv(a.config, settings), *own])
    return _doctor(cfg, sizes, a.iters)


def _doctor(cfg, sizes: tuple[int, ...], iters: int | None) -> int:
    from plait.parallel.env import init_distributed, shutdown

    if any(k.startswith("PLAIT_FAULT_") and v.strip() for k, v in os.environ.items()):  # a test's injected faults
        from plait.features.faults import install_health_faults

        install_health_faults()

    env = init_distributed(cfg.run.device, cfg.parallel.timeout_s)
    try:
        dims = ParallelDims.from_config(cfg.parallel, env.world_size)
        meshes = Meshes(dims.build_mesh(env.device.type), dims) if env.world_size > 1 else None
        iters = iters or (20 if env.device.type == "cuda" else 5)
        report = run_checks(
            env.device, env.rank, meshes, sizes=sizes, iters=iters, slow_ratio=cfg.guard.straggler_ratio or 2.0
        )
        if env.is_main:
            print_report(report, dims, iters)
        return 1 if report.problems() else 0
    finally:
        shutdown()


def print_report(report: HealthReport, dims: ParallelDims, iters: int) -> None:
    """The report as nccl-tests prints its own: the devices' table, one table per mesh axis, then the verdict."""
    from rich.console import Console

    console = Console(width=None if sys.stdout.isatty() else 120, highlight=False)
    console.print(_devices_table(report))
    layout = dims.describe()
    if not report.collectives:
        console.print(f"collectives: none to check ({layout}: no mesh axis has more than one rank)")
    else:
        console.print(f"collectives of layout {layout}; busbw = algbw x 2(n-1)/n (all-reduce), (n-1)/n (gathers)")
    for axis in dict.fromkeys(r.axis for r in report.collectives):
        rows = [r for r in report.collectives if r.axis == axis]
        console.print(_axis_table(axis, rows, dims.world_size, iters))
    _print_verdict(console, report)


DEVICE_COLUMNS = (
    "rank", "host", "device", "time (ms)", "slowed", "TFLOP/s", "max rel err", "checksum err", "bits", "status",
)  # fmt: skip


def _devices_table(report: HealthReport):
    """One row per rank: its matmul's time and accuracy, its result's bits, and whether it is wrong, slow or
    sharing its device."""
    from rich.table import Table

    wrong, slow, differ, contended = report.wrong(), report.slow(), set(report.disagree()), report.contended()
    c0 = report.compute[0]
    title = f"devices: {c0.size}x{c0.size} fp32 matmul (median over {TIMING_WINDOW_S:g} s) vs an fp64 reference"
    table = Table(title=title, title_justify="left")
    for name in DEVICE_COLUMNS:
        table.add_column(name, justify="left" if name in ("host", "device", "status", "bits") else "right")
    for c in report.compute:
        status = "WRONG" if c.rank in wrong else f"SLOW {slow[c.rank]:.1f}x" if c.rank in slow else "ok"
        if c.rank in contended:
            status = ("" if status == "ok" else status + ", ") + f"SHARED {contended[c.rank]:.1f}x"
        bits = c.fingerprint + (" (differs)" if c.rank in differ else "")
        table.add_row(
            str(c.rank), c.host, c.device, f"{1e3 * c.seconds:.2f}", f"{c.contention:.2f}x", f"{c.tflops:.3f}",
            f"{c.matmul_err:.1e}", f"{c.checksum_err:.1e}", bits, status,
        )  # fmt: skip
    return table


def _axis_table(axis: str, rows: list, world_size: int, iters: int):
    """One mesh axis's collectives at each size (nccl-tests' columns), with each op's peak busbw below."""
    from rich.table import Table

    n = rows[0].degree
    groups = world_size // n
    title = f"axis {axis}: {groups} group(s) of {n} ranks at once, fp32, {iters} iterations, slowest rank's time"
    table = Table(title=title, title_justify="left")
    for name in ("op", "size", "count", "time (us)", "algbw (GB/s)", "busbw (GB/s)", "check"):
        table.add_column(name, justify="left" if name in ("op", "check") else "right")
    for r in rows:
        check = "ok" if not r.wrong_ranks else "WRONG on rank " + ",".join(map(str, r.wrong_ranks))
        table.add_row(
            r.op, format_size(r.nbytes), f"{r.nbytes // 4:,}", f"{1e6 * r.seconds:,.1f}",
            f"{r.algbw:.3f}", f"{r.busbw:.3f}", check,
        )  # fmt: skip
    peak = {op: max(r.busbw for r in rows if r.op == op) for op in OPS}
    table.caption = "peak busbw (GB/s): " + ", ".join(f"{op} {bw:.2f}" for op, bw in peak.items())
    table.caption_justify = "left"
    return table


def _print_verdict(console, report: HealthReport) -> None:
    """FAILED with each problem, or all healthy; and a note on ranks whose bits differ from their peers'."""
    problems = report.problems()
    if problems:
        console.print("[bold red]doctor: FAILED[/]")
        for line in problems:
            console.print(f"  {line}")
    else:
        console.print(f"doctor: all {len(report.compute)} rank(s) healthy [{report.seconds:.1f} s]")
    differ = set(report.disagree())
    if differ:
        console.print(f"note: rank(s) {sorted(differ)} produced matmul bits unlike their same-model peers")


def worker(argv: list[str]) -> None:
    """Each process of `plait doctor --nproc N`: the same command, inside the group."""
    run_worker("doctor", cmd_doctor, argv)


def _launch(nproc: int, argv: list[str]) -> int:
    """`plait doctor argv` in nproc local workers (torch's elastic agent, as `plait train --nproc`)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from plait.cli.launch import elastic_run

    try:
        elastic_run(worker, argv, nproc, name="plait-doctor")
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        if failure.exitcode == 1:  # a check failed: rank 0 has printed which
            return 1
        raise PlaitError(f"doctor worker rank {rank} failed (exit code {failure.exitcode}); see above") from None
    return 0
