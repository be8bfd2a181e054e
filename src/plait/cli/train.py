"""`plait train [CONFIG] [--section.key=value ...] [--nproc N] [--max-restarts R] [--replicas R] [--layout auto]`."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from plait.cli.args import config_argv, config_parser, load_args, parse_config_args
from plait.cli.run import run_worker
from plait.core.errors import ConfigError

TRAIN_DESCRIPTION = """\
Train a model. With no arguments: the 'tiny' model on the bundled Shakespeare corpus, on CUDA if present,
else the CPU. A run directory that already holds checkpoints is resumed from the newest one.
The parallel layout is set by the [parallel] settings, or chosen by the planner with --layout auto. Under
torchrun: `torchrun --nproc-per-node N -m plait train [CONFIG] [settings]`."""


def cmd_train(argv: list[str]) -> int:
    parser = config_parser("plait train", TRAIN_DESCRIPTION)
    parser.add_argument("--nproc", type=int, metavar="N", help="local workers (default: one per visible GPU, else 1)")
    parser.add_argument(
        "--max-restarts", type=int, default=0, metavar="R", help="restarts of the group after a lost worker"
    )
    parser.add_argument(
        "--replicas", type=int, metavar="R", help="fault-tolerant: R replica groups of --nproc each (torchft)"
    )
    parser.add_argument(
        "--layout", metavar="auto", help="'auto': the planner chooses the [parallel] degrees for the processes"
    )
    a, settings = parse_config_args(parser, argv)
    args = config_argv(a.config, settings)
    if a.max_restarts < 0:
        raise ConfigError(f"--max-restarts={a.max_restarts} must be 0 or more (how often a failed group is restarted)")
    if "WORLD_SIZE" not in os.environ:  # not yet inside a launched worker
        check_paths(load_args(args))  # a bad setting or path is refused now, before torch is even imported
        from plait.cli.launch import _validate_before_launch, default_nproc, launch_local

        nproc = default_nproc() if a.nproc is None else a.nproc
        if nproc < 1:
            raise ConfigError(f"--nproc={nproc} must be at least 1")
        if a.layout == "auto":
            from plait.planner.auto import auto_layout_overrides

            overrides, why = auto_layout_overrides(load_args(args), nproc)
            print("\n".join(["plait train --layout auto:", *why, "using: " + " ".join(overrides)]), file=sys.stderr)
            args += [f"--{o}" for o in overrides]
        elif a.layout is not None:
            raise ConfigError(f"--layout={a.layout!r}: only 'auto' is accepted (or set the [parallel] options)")
        if a.replicas is not None:
            from plait.cli.replicas import launch_replicas

            return launch_replicas(args, a.replicas, nproc, a.max_restarts)
        cfg = _validate_before_launch(args, nproc)
        if nproc > 1 or a.max_restarts:
            from plait.planner.preflight import check_memory

            note = check_memory(cfg, nproc, nproc)  # once, here; the workers do not repeat it
            if note:
                print(note, file=sys.stderr)
            from plait.engine.runlock import RunLock

            # The launcher holds the run directory's lock across the group's restarts; its workers run under it.
            with RunLock.for_run(cfg).acquire(break_lock=cfg.run.break_lock).held() as lock:
                return launch_local(nproc, args, a.max_restarts, worker, env=lock.handed_env())
    cfg = load_args(args)
    from plait.api import train

    train(cfg)
    return 0


def check_paths(cfg) -> None:
    """The paths a run reads and writes, checked before the heavy imports and any set-up: each prepared data
    directory (data.source, data.sources; not the bundled corpus or s3://, read later) and run.out_dir."""
    from plait.cli.args import check_output_dir
    from plait.config.validate import data_sources

    local = [] if cfg.data.sources else [("data.source", cfg.data.source)]
    local += [("data.sources", path) for _, path, _ in data_sources(cfg.data.sources)] if cfg.data.sources else []
    for setting, path in local:
        if path == "shakespeare" or "://" in path:
            continue
        where = Path(path).expanduser()
        if not where.exists():
            raise ConfigError(
                f"{setting}: {path!r} does not exist; give 'shakespeare' or a directory made by `plait data prepare "
                f"INPUTS --out DIR`"
            )
        if not (where / "manifest.json").is_file():
            raise ConfigError(
                f"{setting}: {path!r} is not a prepared directory (it has no manifest.json); prepare it first: "
                f"`plait data prepare {path} --out data/NAME`, then train on data/NAME"
            )
    check_output_dir("run.out_dir", cfg.run.out_dir)


def worker(argv: list[str]) -> None:
    """Each process of `plait train --nproc N`: the same command, inside the group."""
    run_worker("train", cmd_train, argv)
