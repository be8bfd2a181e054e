"""A run's directory at start: resume it (the newest checkpoint that loads, same model, same data and seed),
start fresh (earlier metrics set aside), or move it aside on run.overwrite. Decided before anything is written
(inspect_run_dir), done once every check has passed (RunDirPlan.apply). Nothing is deleted."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from plait.config import Config, to_dict
from plait.core.errors import ConfigError, PlaitError
from plait.core.stop import Stopped
from plait.core.storage import Location, is_remote
from plait.engine.checkpoint import (
    CheckpointManager,
    checkpoint_dir,
    list_checkpoints,
    newest_first,
    read_meta,
    scan_checkpoints,
    step_of,
)
from plait.engine.metrics import info, warn


@dataclass
class RunDirPlan:
    """What starting a run will do to its directory, decided before anything is written (inspect_run_dir)
    and done once every check has passed (apply)."""

    run_dir: Path
    candidates: list[Location] = field(default_factory=list)  # checkpoints to resume from, newest first
    move_aside: bool = False  # run.overwrite: the old run goes to <run>.old-<time>
    fresh: bool = False  # no checkpoint: earlier metrics (a run that saved none) are set aside

    def apply(self, is_main: bool) -> None:
        """Move what the plan says (main rank only; the caller makes the other ranks wait for it)."""
        if not is_main:
            return
        if self.move_aside and self.run_dir.exists():
            backup = self.run_dir.with_name(f"{self.run_dir.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
            self.run_dir.rename(backup)
            info(f"run.overwrite: previous outputs moved to {backup}")
        elif self.fresh:
            _set_aside_old_metrics(self.run_dir)


def inspect_run_dir(cfg: Config, is_main: bool = True) -> RunDirPlan:
    """Refuse to mix runs: a run directory with checkpoints is resumed only by the same model shape. Reads
    only: the moves it decides (run.overwrite, a fresh start's old metrics) are the plan's `apply`.

    The plan's candidates are the checkpoints to resume from, newest first (empty for a fresh start): the first
    is the newest that looks loadable; damaged newer ones are reported and left on disk. With run.overwrite the
    old outputs will be moved aside to <run>.old-<time>, never deleted.
    """
    run_dir = cfg.run_dir
    complete, damaged = scan_checkpoints(checkpoint_dir(cfg))
    if cfg.run.overwrite and (complete or damaged):
        if cfg.checkpoint.dir:
            raise ConfigError(
                f"run.overwrite=true moves {run_dir} aside, but the checkpoints in checkpoint.dir="
                f"{cfg.checkpoint.dir} would stay and be resumed; delete them or choose another checkpoint.dir"
            )
        return RunDirPlan(run_dir, move_aside=True)
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
        return RunDirPlan(run_dir, fresh=True)
    meta = read_meta(candidates[0])
    _refuse_another_runs(cfg, candidates[0], meta)
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
    return RunDirPlan(run_dir, candidates)


def _refuse_another_runs(cfg: Config, newest: Location, meta: dict) -> None:
    """A checkpoint.dir shared by two run names: the second would silently continue the first's checkpoints.
    Refused, naming that run, unless checkpoint.adopt=true says to continue it."""
    saved = meta.get("config", {}).get("run", {}) if isinstance(meta.get("config"), dict) else {}
    owner = saved.get("name") if isinstance(saved, dict) else None
    if not cfg.checkpoint.dir or meta.get("weights_only") or not owner or owner == cfg.run.name:
        return
    if cfg.checkpoint.adopt:
        info(f"checkpoint.adopt=true: continuing run {owner!r}'s checkpoints ({newest.name}) as run {cfg.run.name!r}")
        return
    raise ConfigError(
        f"checkpoint.dir={cfg.checkpoint.dir} holds the checkpoints of another run, {owner!r} (newest: "
        f"{newest.name}); choose another checkpoint.dir, use --run.name={owner} to resume it, or pass "
        f"--checkpoint.adopt=true to continue it as run {cfg.run.name!r}"
    )


RESUME_UNSAFE = ("data.source:", "data.seq_len", "data.shuffle", "run.seed", "finetune.")
"""Settings a resumed run must keep: with another corpus, sequence length, order or adapter set, the restored
data position and optimizer state would belong to a different run. (model.* is refused on its own.) A
mixture's weights (data.sources) may change: the position is per source (plait.data.mixture), reported."""
RESUME_QUIET = (
    "run.overwrite", "run.break_lock", "checkpoint.adopt", "data.cache_dir", "data.prefetch", "log.", "parallel.",
    "compile.cache_dir",
)  # fmt: skip
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
            checkpointer.mark_damaged(path, str(e))  # never deleted, not even by a new save of its step
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
    then = "to resume from it"
    try:
        newest = list_checkpoints(checkpoint_dir(cfg))
        where = str(newest[-1]) if newest else "none"
        then = then if newest else "(with none, it starts again from step 0)"
    except PlaitError:
        where = f"unknown ({checkpoint_dir(cfg)} cannot be listed now)"
    fix = "Fix the storage (is the server up?)" if is_remote(checkpoint_dir(cfg)) else "Free space"
    return PlaitError(
        f"{why}. Training reached step {step}; the newest complete checkpoint is {where}. {fix} and rerun the "
        f"same command {then}"
    )
