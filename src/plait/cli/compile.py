"""`plait compile`: fill a job's compile cache ahead of the job (plait.engine.precompile).

    plait compile [CONFIG.toml] [--section.key=value ...] --world-size N [--rank R | --ranks stages]

Exit 0 when the graphs were compiled and published into compile.cache_dir, 2 for a bad setting; a rank that
fails (--ranks stages) is an error naming it.
"""

from __future__ import annotations

import json

from plait.core.errors import ConfigError

DESCRIPTION = """\
Compile a job ahead of time: rank R of the N-rank job runs here on a fake process group of N ranks (the
model at its real shape, this rank's shards), one training step on synthetic tokens and, where the job
evaluates, one validation forward; every graph is signed and published into compile.cache_dir (a directory,
or an s3:// prefix the job's nodes share). The job's ranks then load them instead of compiling. Data-parallel
ranks share rank 0's graphs; --ranks stages compiles the first rank of each pipeline stage."""


def _ranks(text: str) -> str:
    if text != "stages":
        raise ConfigError(f"--ranks={text!r}: the one choice is 'stages' (or give one rank: --rank R)")
    return text


def build_parser():
    from plait.cli.args import config_parser

    parser = config_parser("plait compile", DESCRIPTION)
    parser.add_argument("--world-size", type=int, default=1, metavar="N", help="ranks of the job (default 1)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--rank", type=int, metavar="R", help="the rank to compile (0 when not given)")
    which.add_argument("--ranks", type=_ranks, metavar="stages", help="the first rank of each pipeline stage")
    parser.add_argument("--json", metavar="PATH", help="also write what was compiled as JSON to PATH")
    return parser


def cmd_compile(argv: list[str]) -> int:
    from plait.cli.args import config_argv, parse_config_args
    from plait.config import load_config
    from plait.engine.precompile import precompile, stage_ranks

    a, settings = parse_config_args(build_parser(), argv)
    if a.world_size < 1:
        raise ConfigError(f"--world-size={a.world_size} must be at least 1, e.g. --world-size 64")
    cfg = load_config(a.config, settings)
    if not cfg.compile.enabled:
        raise ConfigError("plait compile compiles a job that compiles: set compile.enabled=true")
    if a.ranks:  # each rank in a process of its own: a process group, and compiled state, per process
        own = [*config_argv(a.config, settings), "--world-size", str(a.world_size)]
        results = [_in_subprocess(own, rank) for rank in stage_ranks(cfg, a.world_size)]
    else:
        results = [precompile(cfg, a.world_size, a.rank or 0)]
    for r in results:
        fresh = "nothing new: every graph was in the cache" if r.misses == 0 and r.loaded else f"{r.misses} compiled"
        print(
            f"rank {r.rank} of {r.world_size}: {r.graphs} graphs ({fresh}; {r.loaded} artifacts were cached), "
            f"{r.artifacts} artifacts signed into {r.store} in {r.seconds:.1f} s"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump([vars(r) for r in results], f, indent=1)
    return 0


def _in_subprocess(argv: list[str], rank: int):
    from plait.core.subcommand import rank_in_subprocess
    from plait.engine.precompile import Precompiled

    return Precompiled(**rank_in_subprocess("compile", argv, rank))
