"""A run's directory at start: resume it (the newest checkpoint that loads, same model, same data and seed),
start fresh (earlier metrics set aside), or move it aside on run.overwrite. Nothing is deleted."""

from __future__ import annotations

import time
from pathlib import Path

from plait.checkpoint import (
    CheckpointManager,
    checkpoint_dir,
    list_checkpoints,
    newest_first,
    read_meta,
    scan_checkpoints,
    step_of,
)
from plait.config import Config, to_dict
from plait.errors import ConfigError, PlaitError
from plait.metrics import info, warn
from plait.stop import Stopped
from plait.storage import Location, is_remote


def prepare_run_dir(cfg: Config, is_main: bool = True) -> list[Location]:
    """Refuse to mix runs: a run directory with checkpoints is resumed only by the same model shape.

    Returns the checkpoints to resume from, newest first (empty for a fresh start): the first is the newest
    that looks loadable; damaged newer ones are reported and left on disk. With run.overwrite the old
    outputs are moved aside to <run>.old-<time>, never deleted.
    """
    run_dir = cfg.run_dir
    complete, damaged = scan_checkpoints(checkpoint_dir(cfg))
    if cfg.run.overwrite and (complete or damaged):
        if cfg.checkpoint.dir:
            raise ConfigError(
                f"run.overwrite=true moves {run_dir} aside, but the checkpoints in checkpoint.dir="
                f"{cfg.checkpoint.dir} would stay and be resumed; delete them or choose another checkpoint.dir"
            )
        if is_main:
            backup = run_dir.with_name(f"{run_dir.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
            run_dir.rename(backup)
            info(f"run.overwrite: previous outputs moved to {backup}")
        return []
    candidates, passed_over = newest_first(complete)
    damaged += passed_over
    newest = step_of(candidates[0]) if candidates else -1
    for path, why in sorted(damaged, key=lambda d: step_of(d[0])):
        if is_main and step_of(path) > newest:
            warn(
                f"checkpoint {path} is damaged ({why}); left as it is, "
                + (f"resuming from {candidates[0]}" if candidates else "no complete checkpoint to resume from")
            )
    if not candidates and damaged:
        raise ConfigError(
            f"{run_dir} holds only damaged checkpoints ({'; '.join(f'{p.name}: {why}' for p, why in damaged[:3])}); "
            f"they are left as they are: repair or move them, or pass --run.overwrite=true to move the run aside"
        )
    if not candidates:
        if is_main:
            _set_aside_old_metrics(run_dir)
        return []
    meta = read_meta(candidates[0])
    changed = _changed_settings(meta.get("config", {}), to_dict(cfg))
    if meta.get("weights_only"):  # `plait ckpt import`: weights only, no data consumed, nothing else to keep
        changed = [c for c in changed if c.startswith("model.")]
    model = [c for c in changed if c.startswith("model.")]
    if model:
        raise ConfigError(
            f"{run_dir} holds a checkpoint of a different model ({'; '.join(model[:4])}); "
            f"choose another run.name, or pass --run.overwrite=true to move the old run aside"
        )
    unsafe = [c for c in changed if c.startswith(RESUME_UNSAFE)]
    if unsafe:
        raise ConfigError(
            f"resuming {run_dir} with other data or seed would make the run wrong ({'; '.join(unsafe[:4])}); "
            f"keep them as the checkpoint has them, choose another run.name, or pass --run.overwrite=true"
        )
    safe = [c for c in changed if not c.startswith(RESUME_QUIET)]
    if safe and is_main:
        warn(f"resuming {candidates[0].name} with changed settings: {'; '.join(safe)}")
    return candidates


RESUME_UNSAFE = ("data.source", "data.seq_len", "data.shuffle", "run.seed", "finetune.")
"""Settings a resumed run must keep: with another corpus, sequence length, order or adapter set, the restored
data position and optimizer state would belong to a different run. (model.* is refused on its own.)"""
RESUME_QUIET = ("run.overwrite", "data.cache_dir", "data.prefetch", "log.", "parallel.", "compile.cache_dir")
"""Changes that do not touch the numbers (or, for parallel.*, are what resharding is for): not reported."""


def _changed_settings(saved: dict, current: dict) -> list[str]:
    """'section.key: checkpoint A -> now B' for each setting that differs (keys the checkpoint lacks: skipped)."""
    out = []
    for section, values in current.items():
        before = saved.get(section)
        if not isinstance(values, dict) or not isinstance(before, dict):
            continue
        for key, value in values.items():
            if key in before and before[key] != value:
                note = " (the LR schedule now spans the new total)" if f"{section}.{key}" == "train.steps" else ""
                out.append(f"{section}.{key}: checkpoint {before[key]!r} -> now {value!r}{note}")
    return out


def _set_aside_old_metrics(run_dir: Path) -> None:
    """A fresh start in a directory that has metrics (a run that saved no checkpoint): they are moved to
    <run>/previous-<time>/, so the new run's metrics, TensorBoard files and plot start clean."""
    old = [run_dir / n for n in ("metrics.jsonl", "tb", "loss.png") if (run_dir / n).exists()]
    if not old:
        return
    aside = run_dir / f"previous-{time.strftime('%Y%m%d-%H%M%S')}"
    aside.mkdir(parents=True, exist_ok=True)
    for path in old:
        path.rename(aside / path.name)
    info(f"fresh start: the earlier metrics of {run_dir} (no checkpoint) moved to {aside}")


def resume(checkpointer: CheckpointManager, candidates: list[Location], t, loader, state, is_main: bool):
    """Load the newest checkpoint that loads; one that fails (on every rank alike) is reported, kept, and the
    previous one tried. Every tensor, the data position and the counters come from the one that loads."""
    for i, path in enumerate(candidates):
        try:
            checkpointer.load(path, t, loader=loader, state=state)
            return path
        except PlaitError as e:
            if i + 1 == len(candidates):
                raise
            if is_main:
                warn(f"{e}; left as it is, trying the previous checkpoint {candidates[i + 1]}")
    return None


def raise_stopped(cfg: Config, why: str, step: int, is_main: bool) -> None:
    """The end of a run stopped on request: exit EXIT_STOPPED if this step's checkpoint is there, else an
    error that says so (resuming would then redo the steps since the newest checkpoint). The main rank
    says it; the others exit the same way, silently."""
    if not is_main:
        raise Stopped("")
    newest = list_checkpoints(checkpoint_dir(cfg))
    if newest and step_of(newest[-1]) == step:
        raise Stopped(
            f"stopped by {why} at step {step}/{cfg.train.steps}; checkpoint {newest[-1]} written. Run the same "
            f"command to resume from it"
        )
    raise PlaitError(
        f"stopped by {why} at step {step}, but its checkpoint could not be written (see the warning above); the "
        f"newest complete checkpoint is {newest[-1] if newest else 'none'}"
    )


def final_checkpoint_lost(cfg: Config, why: str, step: int) -> PlaitError:
    """The error of a run that trained to the end but could not save its last checkpoint: a restart would redo
    work, so it is not a success. It names the newest complete checkpoint and what to fix."""
    try:
        newest = list_checkpoints(checkpoint_dir(cfg))
        where = str(newest[-1]) if newest else "none"
    except PlaitError:
        where = f"unknown ({checkpoint_dir(cfg)} cannot be listed now)"
    fix = "Fix the storage (is the server up?)" if is_remote(checkpoint_dir(cfg)) else "Free space"
    return PlaitError(
        f"{why}. Training reached step {step}; the newest complete checkpoint is {where}. {fix} and rerun the "
        f"same command to resume from it"
    )
