"""One rank of `plait compile --ranks stages` in a process of its own (a process group and compiled state are
per process): `python -m plait.engine.precompile_rank REQUEST OUT`, started through plait.core.subcommand. The
request names the config ("config": a TOML path or null, "settings": its 'section.key=value' overrides, with
compile.enabled=true among them), "world_size" and "rank"; the result is the rank's Precompiled as JSON.

Also here: the run lock a compile takes where the cache lies inside the run directory (the command takes it,
and hands it to these processes, which check that it is held by that token)."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Iterator
from pathlib import Path

from plait.config import Config


def in_run_dir(cfg: Config) -> bool:
    """Whether compile.cache_dir lies inside the run directory (the default), whose run lock then covers it."""
    from plait.engine.compile_cache import cache_location

    where = cache_location(cfg)
    if not isinstance(where, Path):
        return False
    return where.resolve().is_relative_to(Path(cfg.run_dir).resolve())


@contextlib.contextmanager
def compile_lock(cfg: Config) -> Iterator:
    """The run's lock while the cache inside its directory is written (None where the cache is elsewhere);
    a second holder is refused (RunLocked, exit 2) naming the holder."""
    if not in_run_dir(cfg):
        yield None
        return
    from plait.engine.runlock import RunLock

    with RunLock.for_run(cfg).acquire(break_lock=cfg.run.break_lock).held() as lock:
        yield lock


def compile_one_rank(request: dict) -> dict:
    """Load the config as the command did and compile one rank under the lock the command handed over."""
    from plait.config import load_config
    from plait.engine.compile_cache import check_cache_access
    from plait.engine.precompile import precompile

    cfg = load_config(request["config"], request["settings"])
    check_cache_access(cfg)
    with compile_lock(cfg):
        return dataclasses.asdict(precompile(cfg, request["world_size"], request["rank"]))


def main() -> int:
    from plait.core.subcommand import serve_rank

    return serve_rank("compile", compile_one_rank)


if __name__ == "__main__":
    sys.exit(main())
