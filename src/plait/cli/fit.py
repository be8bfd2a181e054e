"""`plait fit`: run one rank of an N-rank job on this machine's device, measured beside the planner.

    plait fit [CONFIG.toml] [--section.key=value ...] --world-size N [--rank R | --ranks extremes]
              [--steps S] [--json PATH]

Exit 0 when every rank measured fits the device, 1 when one does not (out of memory, or over the memory
available), 2 for a bad setting. See plait.planner.fit.
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

from plait.core.errors import ConfigError

DESCRIPTION = """\
Run rank R of an N-rank job in this one process, on this machine's device (a GPU, or the CPU): a fake process
group of N ranks (collectives shaped as the real job's, moving no data), the model at its real shape with only
this rank's shards, the config's optimizer, precision, activation checkpointing, offload and compile, a few
training steps on synthetic tokens. Prints the measured peak memory beside the planner's prediction for that
rank, part by part, and the step time beside the planner's compute time; exit 0 if it fits the device, 1 if
not. --ranks extremes runs the ranks that differ (first and last pipeline stage, the last shard of each axis)."""


def _ranks(text: str) -> str:
    if text != "extremes":
        raise ConfigError(f"--ranks={text!r}: the one choice is 'extremes' (or give one rank: --rank R)")
    return text


def build_parser():
    from plait.cli.args import config_parser

    parser = config_parser("plait fit", DESCRIPTION)
    parser.add_argument("--world-size", type=int, required=True, metavar="N", help="ranks of the job (e.g. 64)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--rank", type=int, metavar="R", help="the rank to run (0 when not given)")
    which.add_argument("--ranks", type=_ranks, metavar="extremes", help="run the ranks that differ, one at a time")
    parser.add_argument("--steps", type=int, default=3, metavar="S", help="training steps")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    parser.add_argument("--quiet", action="store_true", help="print nothing (with --json)")
    parser.add_argument(
        "--dry-run", action="store_true", help="check the layout and print the planner's prediction; run nothing"
    )
    return parser


def cmd_fit(argv: list[str]) -> int:
    from plait.cli.args import check_output_file, parse_config_args
    from plait.config import load_config

    a, settings = parse_config_args(build_parser(), argv)
    if a.world_size < 1:
        raise ConfigError(f"--world-size={a.world_size} must be at least 1, e.g. --world-size 64")
    if a.steps < 1:
        raise ConfigError(
            f"--steps={a.steps} must be at least 1 (the first step also allocates the optimizer's states)"
        )
    if a.rank is not None and not 0 <= a.rank < a.world_size:
        raise ConfigError(f"--rank={a.rank} is not a rank of a {a.world_size}-rank job; give 0 to {a.world_size - 1}")
    check_output_file("--json", a.json, "fit.json")
    cfg = load_config(a.config, settings)  # all checked before torch is imported (plait.planner.fit imports it)
    from plait.core.progress import phase
    from plait.planner.fit import extreme_ranks, fit_rank, in_subprocess

    if a.dry_run:
        from plait.planner.fit import predict_rank

        ranks = extreme_ranks(cfg, a.world_size) if a.ranks else [a.rank or 0]
        for rank in ranks:
            print(predicted_report(rank, a.world_size, predict_rank(cfg, a.world_size, rank)))
        return 0
    if a.ranks:
        ranks = extreme_ranks(cfg, a.world_size)
        own = {"config": a.config, "settings": settings, "world_size": a.world_size, "steps": a.steps}
        for rank in ranks:  # validate everything before the first rank runs
            if not 0 <= rank < a.world_size:
                raise ConfigError(f"rank {rank} outside 0..{a.world_size - 1}")
        results = []
        for i, rank in enumerate(ranks):
            with phase(f"rank {rank} of {a.world_size} ({i + 1} of {len(ranks)} ranks, each in a process of its own)",
                       stream=io.StringIO() if a.quiet else None):  # fmt: skip
                results.append(in_subprocess(own, rank))
    else:
        results = [fit_rank(cfg, a.world_size, a.rank or 0, a.steps, quiet=a.quiet)]
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps([r.to_json() for r in results], indent=1) + "\n")
    if not a.quiet:
        for r in results:
            print(report(r))
    return 0 if all(r.fits for r in results) else 1


def _unit(values) -> tuple[float, str]:
    """One unit for a table: GiB where its largest value is at least 1 GiB, else MiB."""
    largest = max((v for v in values if v), default=0)
    return (2**30, "GiB") if largest >= 2**30 else (2**20, "MiB")


def _gib(x: float | None, unit: tuple[float, str] | None = None) -> str:
    if x is None:
        return "-"
    size, name = unit or _unit([x])
    return f"{x / size:,.2f} {name}"


def _error(measured: float | None, predicted: float | None) -> str:
    if not measured or predicted is None:
        return ""
    return f"{(predicted - measured) / measured:+.1%}"


def predicted_report(rank: int, world_size: int, p: dict) -> str:
    rows = [(k, p[k]) for k in ("states", "buffers", "activations", "transient", "peak", "total", "host")]
    parts = ", ".join(f"{name} {_gib(value)}" for name, value in rows if value)
    return f"rank {rank} of {world_size}, planner (not run: --dry-run): {parts}"


def report(r) -> str:
    """The table for one rank: measured beside predicted, the step beside the planner's compute time, the verdict."""
    from plait.planner.cost import host_resident

    where = ", ".join(f"{axis} {i} of {n}" for axis, (i, n) in r.coordinates.items()) or "every axis of degree 1"
    m, p = r.measured, r.predicted
    lines = [f"rank {r.rank} of {r.world_size} ({where}) on {r.device}, {_gib(r.capacity)}"]
    if m:
        cuda = m.get("reserved") is not None
        rows = [
            ("model states (params, grads, optimizer)", m.get("states"), p["states"] if p["host"] == 0 else p["host"]),
            ("activations (one micro-batch)", m.get("activations"), p["activations"]),
            ("gathered params, grad and comm buffers", None, p["buffers"]),
            ("transient (recompute, head, ring, experts)", None, p["transient"]),
            ("peak of the steps, " + ("allocated" if cuda else "live tensors"), m["peak"], p["peak"]),
            ("peak of the build (initialisation)", m.get("build_peak"), None),
        ]
        if cuda:
            rows.append(("peak reserved (with slack and reserve)", m["reserved"], p["total"]))
        unit = _unit([v for _, got, want in rows for v in (got, want)])
        lines.append(f"  {'':44s} {'measured':>14s} {'planner':>14s} {'error':>8s}")
        for name, got, want in rows:
            lines.append(f"  {name:44s} {_gib(got, unit):>14s} {_gib(want, unit):>14s} {_error(got, want):>8s}")
        host, host_p = m["host_rss"], host_resident(p["host"])
        lines.append(
            f"  {'host resident (the whole process)':44s} {_gib(host):>14s} {_gib(host_p) if host_p else '':>14s}"
            f" {_error(host, host_p) if host_p else '':>8s}"
        )
    if r.step_s is not None:
        lines.append(f"  step {r.step_s:.3f} s (no communication: the fake group moves nothing); planner's compute + "
                     f"optimizer on this device {r.compute_s:.3f} s")  # fmt: skip
    verdict = "fits" if r.fits else "does NOT fit"
    lines.append(f"  {verdict}" + (f": {r.note}" if r.note else ""))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(cmd_fit(sys.argv[1:]))
