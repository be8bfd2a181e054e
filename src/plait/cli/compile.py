"""`plait compile`: fill a job's compile cache ahead of the job (plait.engine.precompile).

    plait compile [CONFIG.toml] [--section.key=value ...] --world-size N [--rank R | --ranks stages]

Compiling is what it is for, so it compiles with compile.enabled=true whatever the config says (and says so:
the job loads the graphs only when it compiles too). Where the cache is inside the run directory (by default:
<run>/compile_cache) it takes that run's lock first, as a run does: a run training there, or another `plait
compile`, is named in one line and exit 2, before anything is written. A compile.cache_dir of its own (a
directory or an s3:// prefix a fleet shares) is written signed and atomically by each publisher, and takes no
run's lock.

Exit 0 when the graphs were compiled and published into compile.cache_dir, 2 for a bad setting or a held run
directory; a rank that fails (--ranks stages) is an error naming it.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

from plait.core.errors import ConfigError

DESCRIPTION = """\
Compile a job ahead of time: rank R of the N-rank job runs here on a fake process group of N ranks (the
model at its real shape, this rank's shards), one training step on synthetic tokens and, where the job
evaluates, one validation forward; every graph is signed and published into compile.cache_dir (a directory,
or an s3:// prefix the job's nodes share). The job's ranks then load them instead of compiling. Data-parallel
ranks share rank 0's graphs; --ranks stages compiles the first rank of each pipeline stage. Compiles with
compile.enabled=true whatever the config says; a cache inside the run directory is written under its run lock."""

ENABLED = "compile.enabled=true"


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
    from plait.cli.args import check_output_file, parse_config_args
    from plait.config import load_config

    a, settings = parse_config_args(build_parser(), argv)
    if a.world_size < 1:
        raise ConfigError(f"--world-size={a.world_size} must be at least 1, e.g. --world-size 64")
    if a.rank is not None and not 0 <= a.rank < a.world_size:
        raise ConfigError(f"--rank={a.rank} is not a rank of a {a.world_size}-rank job; give 0 to {a.world_size - 1}")
    check_output_file("--json", a.json, "compile.json")
    cfg = load_config(a.config, settings)
    if not cfg.compile.enabled:
        print(f"plait compile: compiling with {ENABLED} (this config has it off: the job loads these graphs only "
              f"when it runs with {ENABLED} too)", file=sys.stderr)  # fmt: skip
        settings = [*settings, ENABLED]
        cfg = load_config(a.config, settings)  # checked again: some layouts refuse compiling
    from plait.engine.compile_cache import check_cache_access

    check_cache_access(cfg)
    from plait.engine.precompile_rank import compile_lock

    with compile_lock(cfg) as lock:
        results = _compile(cfg, a, {"config": a.config, "settings": settings}, lock)
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


def _compile(cfg, a, own: dict, lock) -> list:
    """Each rank asked for: here, or (--ranks) each in a process of its own (a process group and compiled
    state are per process), under the lock this process holds."""
    from plait.core.progress import phase
    from plait.engine.precompile import precompile, stage_ranks

    if not a.ranks:
        with phase(f"compiling rank {a.rank or 0} of {a.world_size}"):
            return [precompile(cfg, a.world_size, a.rank or 0)]
    own = {**own, "world_size": a.world_size}
    ranks = stage_ranks(cfg, a.world_size)
    results = []
    with _handed(lock):
        for i, rank in enumerate(ranks):
            with phase(f"compiling rank {rank} of {a.world_size} (stage {i + 1} of {len(ranks)})"):
                results.append(_in_subprocess(own, rank))
    return results


@contextlib.contextmanager
def _handed(lock):
    """The ranks' processes run under this process's lock (they check that it is held, by this token)."""
    if lock is None:
        yield
        return
    env = lock.handed_env()
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _in_subprocess(request: dict, rank: int):
    from plait.core.subcommand import rank_in_subprocess
    from plait.engine.precompile import Precompiled

    return Precompiled(**rank_in_subprocess("plait.engine.precompile_rank", request, rank))
