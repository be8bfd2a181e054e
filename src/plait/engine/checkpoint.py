"""Checkpoints with torch.distributed.checkpoint (DCP): sharded, layout-independent, asynchronous, atomic.

A checkpoint is a directory ``<checkpoints>/step_<N>/`` (local, or ``s3://bucket/prefix/step_<N>/``) holding
- DCP files with every tensor: the model (fully qualified names) and the optimizer state per parameter
  name, so it loads under another layout or world size, and each rank's CPU/CUDA RNG state;
- ``plait.json`` with everything that is not a tensor (step, token count, data-loader position, LR schedule,
  optimizer hyper-parameters, the resolved config, a hash of DCP's metadata file) — plain JSON;
- ``tokenizer.json``, so ``plait generate`` needs nothing but the checkpoint.

Life of a save (``CheckpointManager.maybe_save``): the loop is blocked while the state is copied to CPU
memory ("staged", ``dcp.async_save``); every rank then writes its shards from a background thread, and
DCP's coordinator writes ``.metadata`` once all ranks' writes have succeeded. Only then does the main rank
publish: it writes ``plait.json`` last and, on a local disk, renames ``step_<N>.tmp`` to ``step_<N>``.
``list_checkpoints`` accepts only directories with ``plait.json``, so a crash at any moment leaves nothing it
would load. A save that fails (an unreachable bucket, a full disk) is retried, then reported, and training
goes on; the next save tries again. A finished save is published at the next ``maybe_save``, and
``close()`` waits for the last one.

Loading never unpickles (see ``plait.core.storage``). A checkpoint whose files are missing or truncated, whose
metadata is damaged, or whose tensors do not fit the model (missing, unexpected, other shapes, not tensors)
raises PlaitError listing what does not match, on every rank, before any tensor is changed. Corrupt bytes
inside a record are caught by its CRC32 while it is read: PlaitError again, but tensors read before it may
already hold checkpoint values, so a failed load must end the run (as it does: nothing catches it).
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from plait.config import CheckpointConfig, Config
from plait.core import storage, torch_private
from plait.core.errors import ConfigError, PlaitError
from plait.core.storage import DCP_METADATA, Location, RemotePath
from plait.engine.callbacks import Callback

_STEP_DIR = re.compile(r"^step_(\d+)$")
_ANY_STEP_DIR = re.compile(r"^step_(\d+)(\.tmp)?$")
META = storage.META_FILE
FORMAT = "plait-checkpoint-v1"

# A run that fails with a save in flight waits this long for it before giving up on it (see close()).
ABANDON_AFTER_S = 30.0
# A due save waits for the one in flight while that one is on time: no failed write, and not yet longer than
# twice the last good save or this (whichever is longer); then it is deferred. The loop's longest wait for
# storage is this, or twice a good save's time (bench/s3_outage.py).
ON_TIME_MIN_S = 0.5
# The final save and a stop's save (and the save in flight before them) are waited for at most this long:
# a preempted worker has 110 s (plait.cli.launch.STOP_GRACE_S) for its last step and checkpoint.
FINAL_WAIT_S = 90.0

# DCP warns on every save/load without a process group that it "assumes" one process: that is intended.
_NO_DIST_WARNING = "torch.distributed is disabled, unavailable or uninitialized"
warnings.filterwarnings("ignore", message=_NO_DIST_WARNING)


@dataclass
class TrainState:
    """Counters of a run: restored exactly on resume."""

    step: int = 0
    tokens: int = 0


# ------------------------------------------------------------------------------------------------ finding


def checkpoint_dir(cfg: Config) -> Location:
    """Where this run's checkpoints go: checkpoint.dir (a directory or s3://bucket/prefix), by default
    <run.out_dir>/<run.name>/checkpoints."""
    if cfg.run.out_dir.startswith("s3://"):
        raise ConfigError(
            f"run.out_dir={cfg.run.out_dir!r}: metrics and TensorBoard files need a local directory; put only "
            f"the checkpoints on S3 with checkpoint.dir=s3://bucket/prefix"
        )
    if not cfg.checkpoint.dir:
        return cfg.run_dir / "checkpoints"
    return storage.location(cfg.checkpoint.dir, cfg.checkpoint.s3_endpoint)


def list_checkpoints(ckpt_dir: Location | str) -> list[Location]:
    """Published checkpoints (with plait.json and DCP metadata), oldest first."""
    return scan_checkpoints(ckpt_dir)[0]


def scan_checkpoints(ckpt_dir: Location | str) -> tuple[list[Location], list[tuple[Location, str]]]:
    """(complete checkpoints, damaged ones with what is wrong), each oldest first.

    Complete: a step directory with plait.json and DCP's .metadata. Damaged: a published step directory
    (plait.json, or locally any ``step_<N>`` without ``.tmp``, which only a publish creates) that lacks one
    of them. Damaged checkpoints are never loaded, counted for retention, or deleted by plait. A remote
    step directory without plait.json is a save that never finished, not a damaged checkpoint."""
    root = ckpt_dir if isinstance(ckpt_dir, Path | RemotePath) else storage.location(ckpt_dir)
    return _classify(root, _tree(root))


def _tree(root: Location) -> dict[str, set[str]]:
    try:
        return storage.list_tree(root)
    except PlaitError:
        raise
    except Exception as e:
        fix = (
            "; check that the server is up, checkpoint.s3_endpoint (or AWS_ENDPOINT_URL) and the AWS credentials"
            if isinstance(root, RemotePath)
            else ""
        )
        raise PlaitError(f"cannot list checkpoints in {root}: {_one_line(e)}{fix}") from None


def _classify(root: Location, tree: dict[str, set[str]]) -> tuple[list[Location], list[tuple[Location, str]]]:
    complete, damaged = [], []
    for name, files in tree.items():
        if not (m := _STEP_DIR.match(name)):
            continue
        if META in files and DCP_METADATA in files:
            complete.append((int(m.group(1)), name, ""))
        elif META in files or not storage.is_remote(root):
            lost = [f for f in (META, DCP_METADATA) if f not in files]
            damaged.append((int(m.group(1)), name, f"{' and '.join(lost)} missing"))
    return [root / n for _, n, _ in sorted(complete)], [(root / n, why) for _, n, why in sorted(damaged)]


def checkpoint_problems(path: Location) -> str:
    """Why a checkpoint with both files present still cannot be loaded ("" if it looks loadable): plait.json
    unreadable or without a step and config, .metadata not the one plait.json names, shard files missing or
    short. Reads plait.json and .metadata only, not the tensors (their CRC32s are checked while loading)."""
    try:
        meta = read_meta(path)
        state = meta.get("train_state", {})
        step = state.get("step", 0) if isinstance(state, dict) else None
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            return f"{META} has no valid step ({step!r})"
        if not meta.get("weights_only") and not isinstance(meta.get("config"), dict):
            return f"{META} has no config"
    except PlaitError as e:
        return str(e)
    problems, md = _check(path, meta, {})
    objects = sorted(
        k for k, v in (md.state_dict_metadata if md else {}).items() if not isinstance(v, TensorStorageMetadata)
    )
    if objects:  # plait writes tensors only: these were put there by something else
        problems.append(f"not tensors (pickled objects, which plait never loads): {_some(objects)}")
    return "; ".join(problems)


def read_config(path: Location | str):
    """The resolved Config a checkpoint was written with; PlaitError naming the problem if plait.json has none
    or one plait cannot read."""
    from plait.config import from_dict

    meta = read_meta(path)
    if not isinstance(meta.get("config"), dict):
        raise PlaitError(f"checkpoint {path} is damaged: its {META} has no config (the model's shape is unknown)")
    try:
        return from_dict(meta["config"])
    except PlaitError as e:
        raise PlaitError(f"checkpoint {path} is damaged: the config in its {META} is not valid ({e})") from None


def read_meta(path: Location | str) -> dict[str, Any]:
    path = path if isinstance(path, Path | RemotePath) else storage.location(path)
    try:
        meta = json.loads(storage.read_bytes(path / META))
    except PlaitError:
        raise
    except Exception as e:
        raise PlaitError(f"checkpoint {path} has no readable {META}: {_one_line(e)}") from None
    if not isinstance(meta, dict):
        raise PlaitError(f"checkpoint {path} is damaged: its {META} is not a JSON object")
    return meta


def resolve_checkpoint(ref: str | os.PathLike | Location, endpoint: str = "") -> Location:
    """A checkpoint (a local directory or an s3:// prefix holding plait.json), or the newest complete
    checkpoint of a run directory or of a checkpoints directory. The S3 endpoint comes from ``endpoint``, else
    $AWS_ENDPOINT_URL."""
    loc = ref if isinstance(ref, Path | RemotePath) else storage.location(ref, endpoint)
    try:
        if storage.exists(loc / META):
            return loc
        found = storage.exists(loc)
    except PlaitError:
        raise
    except Exception as e:
        raise PlaitError(f"cannot read {loc}: {_one_line(e)}") from None
    if not found:
        raise PlaitError(f"{loc} does not exist: give a checkpoint directory or a run directory")
    ckpts, broken = scan_checkpoints(loc / "checkpoints")
    if not ckpts and not broken:
        ckpts, broken = scan_checkpoints(loc)
    if not ckpts and not broken:
        raise PlaitError(f"{loc} holds no complete checkpoint (looked for step_*/{META})")
    usable, damaged = newest_first(ckpts)
    newest = step_of(usable[0]) if usable else -1
    damaged = sorted([*damaged, *(d for d in broken if step_of(d[0]) > newest)], key=lambda d: step_of(d[0]))
    problems = "; ".join(f"{p.name}: {why}" for p, why in damaged)
    if not usable:
        raise PlaitError(f"{loc} holds only damaged checkpoints: {problems}")
    if damaged:
        _warn(f"the newer checkpoints are damaged and skipped ({problems}); using {usable[0]}")
    return usable[0]


def newest_first(ckpts: list[Location]) -> tuple[list[Location], list[tuple[Location, str]]]:
    """Complete checkpoints (oldest first, as `list_checkpoints` gives them) newest first from the newest that
    is not damaged (`checkpoint_problems`), and the newer ones passed over, each with what is wrong with it."""
    usable, damaged = list(reversed(ckpts)), []
    while usable and (why := checkpoint_problems(usable[0])):
        damaged.append((usable.pop(0), why))
    return usable, damaged


def local_file(loc: Location) -> Path | None:
    """A local path to a small file of a checkpoint (its tokenizer): the file itself, or for S3 a copy in a
    temporary directory that lives as long as the process. None where the file does not exist."""
    if isinstance(loc, Path):
        return loc if loc.is_file() else None
    if not storage.exists(loc):
        return None
    directory = Path(tempfile.mkdtemp(prefix="plait-s3-"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    target = directory / loc.name
    target.write_bytes(storage.read_bytes(loc))
    return target


def step_of(path: Location) -> int:
    m = _ANY_STEP_DIR.match(path.name)
    return int(m.group(1)) if m else -1


# ------------------------------------------------------------------------------------------------- saving


@dataclass
class _Outcome:
    step: int
    ok: bool
    error: str = ""
    blocked_s: float = 0.0
    write_s: float = 0.0
    num_bytes: int = 0


class CheckpointManager:
    """Saves (asynchronously, on its own cadence) and restores model, optimizer, LR schedule, data position,
    RNG and counters of a run.

    Communication plan: an asynchronous save runs DCP's collectives (gather the save plans, scatter the
    final plan, gather the write results; a handful of small messages per save) on a gloo group of its own
    from a background thread, so they never interleave with the training step's collectives. A second gloo
    group carries the main thread's decisions: whether a time-based save is due (rank 0's clock decides, one
    broadcast per step when checkpoint.every_minutes is set) and whether every rank found a checkpoint
    loadable (one all-gather per load).
    """

    def __init__(
        self,
        ckpt_dir: Location,
        cfg: CheckpointConfig,
        *,
        total_steps: int = 0,
        is_writer: bool = True,
        config: dict | None = None,
        tokenizer_path: Path | None = None,
    ):
        self.dir = ckpt_dir
        self.cfg = cfg
        self.total_steps = total_steps
        self.is_writer = is_writer
        self.config = config or {}
        self.tokenizer_path = tokenizer_path
        self.failed_saves = 0
        self.deferred_saves = 0
        self._deferred = 0  # a step whose save waits for the one in flight to end (0: none)
        self._in_flight_step = 0  # the step of the save in flight
        self._deadline = 0.0  # until when a final or stop save (and the one before it) is waited for
        self._abandoned: Future | None = None  # a save given up on past the deadline (its thread may still run)
        self._abandoned_why = ""
        self._failed_attempts_at_start = 0  # storage.FAILED_ATTEMPTS when the save in flight began
        self._started_at = 0.0  # when the save in flight began
        self._last_write_s = 0.0  # how long the last good save took from staged to published
        self._distributed = dist.is_initialized() and dist.get_world_size() > 1
        self._rank = dist.get_rank() if dist.is_initialized() else 0
        self._control = dist.new_group(backend="gloo") if self._distributed else None
        self._save_group = dist.new_group(backend="gloo") if self._distributed and cfg.async_enabled else None
        self._stager = None  # torch_private.reusable_stager, made at the first asynchronous save
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self._last_save_time = time.monotonic()
        self._last_size = 0  # bytes of the last complete save: the free space the next one needs
        self._estimate = 0  # bytes a save takes, estimated from the tensors before the first one
        self.final_lost = ""  # why the run's final checkpoint could not be written, if it could not
        # Called on every rank when a save begins, with (step, trainable): entries for that checkpoint's
        # plait.json (the lineage's weights hash, from the weights as they are saved; it may use collectives).
        self.describe: Callable[[int, Any], dict[str, Any]] | None = None
        self.stopped_at = 0  # the step at which a stop request ended the run (0: not stopped)
        self._verified: dict[str, str] = {}  # checkpoint name -> its problems ("" for none), for retention
        if self.is_writer and not storage.is_remote(self.dir):
            storage.makedirs(self.dir)
            for stale in Path(self.dir).glob("step_*.tmp"):  # saves an earlier process never finished
                storage.remove_tree(stale)

    # ---------------------------------------------------------------------------------------- cadence

    def should_save(self, step: int, stop_requested: bool = False) -> tuple[bool, bool, bool]:
        """(save due, stop now, a save still in flight), the same on every rank. A save is due every
        checkpoint.every_steps, every checkpoint.every_minutes (rank 0's clock decides for all ranks), at the
        last step if checkpoint.save_final, and when any rank was asked to stop (a signal). In flight: the
        previous save has not ended on some rank. One small all-reduce over the control group per step when
        distributed (none in one process)."""
        every = self.cfg.every_steps
        due = (every > 0 and step % every == 0) or (step == self.total_steps and self.cfg.save_final)
        late = self.cfg.every_minutes > 0 and time.monotonic() - self._last_save_time >= 60 * self.cfg.every_minutes
        busy = self._pending is not None and not self._pending.done()
        if self._control is not None:
            flags = torch.tensor([int(late and self._rank == 0), int(stop_requested), int(busy)])
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._control)
            late, stop_requested, busy = bool(flags[0]), bool(flags[1]), bool(flags[2])
        return due or late or stop_requested, stop_requested, busy

    def maybe_save(self, step: int, t, *, loader, state: TrainState, stop_requested: bool = False) -> dict[str, float]:
        """Publish a save that has finished; start one if due. Returns metrics of a save that ended in this
        call (else nothing): saved_step or failed_step, blocked_s (how long the save held up the loop),
        write_s (from staged to published), size_mb, and failed_saves (saves lost so far in this run); or
        deferred_step when a due save had to wait for the previous one.

        The loop never waits for slow or failing storage: a save due while the previous one is still being
        written waits for it only while that one is on time (no failed write, not yet twice as long as the last
        good save, or ON_TIME_MIN_S); after that it is deferred, not waited for, to the first step at which the
        previous one has ended (a backlog of one: later save points meanwhile are folded into it). The final
        save and a stop's save wait, at most FINAL_WAIT_S and saying so. When a stop was requested on any rank
        (`plait.core.stop`), this step's save is waited for (published before returning) and `stopped` is set: the
        loop ends here on every rank."""
        report = self._collect(wait=False)
        due, stop, busy = self.should_save(step, stop_requested)
        must = stop or (step == self.total_steps and self.cfg.save_final)
        if must:
            self._deadline = time.monotonic() + self._final_wait_s()
            report.update(self._wait_for_storage(f"the save of step {self._in_flight_step}", before=step))
            if not self._any_rank(self._abandoned is not None):  # its staging buffers are free: save this step
                self._deferred = 0
                report.update(self.save(step, t, loader=loader, state=state))
            elif not self.final_lost:
                self.final_lost = f"the checkpoint of step {step} was not attempted: {self._abandoned_why}"
        elif due and busy and self._still_in_flight_after_its_usual_time():
            report.update(self._defer(step))
        elif due or (self._deferred and not busy):
            self._deferred = 0
            report.update(self.save(step, t, loader=loader, state=state))
        if stop:
            report.update(self.wait())
            self.stopped_at = step
        return report

    def _still_in_flight_after_its_usual_time(self) -> bool:
        """Wait for the save in flight while it is on time (no failed write, and no longer yet than
        max(ON_TIME_MIN_S, 2 x the last good save's time)); then whether it is still in flight on any rank."""
        limit = max(ON_TIME_MIN_S, 2 * self._last_write_s)
        while self._pending is not None and not self._pending.done():
            left = limit - (time.monotonic() - self._started_at)
            if left <= 0 or storage.FAILED_ATTEMPTS[0] > self._failed_attempts_at_start:
                break
            with contextlib.suppress(TimeoutError):
                self._pending.result(timeout=min(left, 0.05))
        return self._any_rank(self._pending is not None and not self._pending.done())

    def _defer(self, step: int) -> dict[str, float]:
        """A save due while the previous one is still being written: taken at the first step after that one
        ends; said once per deferral (a further save point meanwhile is folded into it)."""
        first = not self._deferred
        self._deferred = step
        self.deferred_saves += 1
        if first and self.is_writer:
            _warn(
                f"checkpoint of step {step} deferred: the save of step {self._in_flight_step} is still being written "
                f"to {self.dir} ({self._storage_state()}); training goes on, and the next step after that save "
                f"ends is saved"
            )
        return {"deferred_step": step, "deferred_saves": self.deferred_saves}

    def _storage_state(self) -> str:
        """Why the save in flight has not ended, from this rank's view: 'storage failing' only where writes
        have failed (and are being retried), else 'slow', with its time so far against the last good save's."""
        failures = storage.FAILED_ATTEMPTS[0] - self._failed_attempts_at_start
        if failures:
            return f"storage failing: {failures} failed attempt{'s' if failures > 1 else ''} so far, retrying"
        if self._pending is None or self._pending.done():
            return "another rank's write has not ended yet"
        elapsed = time.monotonic() - self._started_at
        last = f", the last save took {self._last_write_s:.1f} s" if self._last_write_s else ""
        return f"slow: {elapsed:.1f} s so far{last}"

    def _wait_for_storage(self, what: str, *, before: int | None = None) -> dict[str, float]:
        """Wait for the save in flight until self._deadline, saying so when it is not over within a second.
        Past the deadline it is abandoned (the process still ends only once its retries do) and the run's
        final checkpoint is reported lost."""
        if self._pending is None:
            return {}
        try:
            self._pending.result(timeout=1.0)
        except TimeoutError:
            left = max(0.0, self._deadline - time.monotonic())
            if self.is_writer:
                after = f" before the checkpoint of step {before}" if before is not None else ""
                _warn(f"waiting up to {left:.0f} s for {what} to {self.dir}{after} ({self._storage_state()})")
            try:
                self._pending.result(timeout=left)
            except TimeoutError:
                self.failed_saves += 1
                waited = time.monotonic() - self._started_at
                self._abandoned_why = f"{what} was still not written after {waited:.0f} s ({self._storage_state()})"
                self.final_lost = self.final_lost or self._abandoned_why
                self._abandoned, self._pending = self._pending, None  # its thread still holds the staging buffers
                return {"failed_step": self._in_flight_step, "failed_saves": self.failed_saves}
        return self._collect(wait=True)

    def _final_wait_s(self) -> float:
        """How long a final or stop save (and the one in flight before it) is waited for: FINAL_WAIT_S, longer
        where a good save took long (a large model on slow storage is not abandoned for being large)."""
        return FINAL_WAIT_S + 2 * self._last_write_s

    def _any_rank(self, flag: bool) -> bool:
        if self._control is None:
            return flag
        box = torch.tensor([int(flag)])
        dist.all_reduce(box, op=dist.ReduceOp.MAX, group=self._control)
        return bool(box.item())

    def latest(self) -> Location | None:
        """The newest published checkpoint, the same on every rank. (Rank 0 publishes from a background
        thread, so ranks listing the directory on their own could see different newest checkpoints.)"""
        found = list_checkpoints(self.dir) if self.is_writer or self._control is None else []
        if self._control is None:
            return found[-1] if found else None
        box = [found[-1].name if found else None]
        dist.broadcast_object_list(box, src=0, group=self._control)
        return self.dir / box[0] if box[0] else None

    def wait(self) -> dict[str, float]:
        """Wait for the save in flight (if any) to be published or to fail, at most FINAL_WAIT_S; its report."""
        if self._pending is not None and self._deadline <= time.monotonic():
            self._deadline = time.monotonic() + self._final_wait_s()
        return self._wait_for_storage(f"the checkpoint of step {self._in_flight_step}")

    def close(self) -> dict[str, float]:
        """Wait for the save in flight and publish it; release threads, buffers and groups. Returns on
        every rank only once the last checkpoint is visible.

        Called while an exception propagates (the run failed), it waits at most ABANDON_AFTER_S for the save
        in flight (a lost peer would make it wait for the collective timeout) and not for the other ranks."""
        failing = sys.exc_info()[0] is not None
        if failing and self._pending is not None:
            try:
                self._pending.result(timeout=ABANDON_AFTER_S)
            except TimeoutError:
                _warn(f"run failed with a checkpoint save in flight; abandoned after {ABANDON_AFTER_S} s")
                self._pending = None
                return {}
        report = self.wait()
        if self._control is not None and not failing:
            dist.barrier(group=self._control)
        if self._executor is not None:
            self._executor.shutdown(wait=self._abandoned is None)
            self._executor = None
        if self._stager is not None and self._abandoned is None:  # an abandoned save still reads its buffers
            self._stager.close()
        self._stager = None
        for group in (self._save_group, self._control):
            if group is not None:
                dist.destroy_process_group(group)
        self._save_group = self._control = None
        return report

    # ------------------------------------------------------------------------------------------- save

    def save(self, step: int, t, *, loader, state: TrainState) -> dict[str, float]:
        """Start saving this step (asynchronously if checkpoint.async_enabled; see the module docstring).
        Returns the report of a save that ended meanwhile: the previous one, or this one if synchronous."""
        start = time.perf_counter()
        report = self._collect(wait=True)  # one save in flight at a time: its staging buffers are reused
        self._in_flight_step = step
        described = self.describe(step, t) if self.describe else {}  # every rank, before anything can differ
        self._last_save_time = time.monotonic()
        self._failed_attempts_at_start, self._started_at = storage.FAILED_ATTEMPTS[0], time.monotonic()
        model_sd, optim_sd, groups = _state_dicts(t)
        short = self._short_of_space(model_sd, optim_sd)
        if short:  # refused before writing a byte: a save that cannot fit would only fill the disk
            self._pending = Future()
            self._pending.set_result(_Outcome(step, False, short))
            report.update(self._collect(wait=True))
            return report
        tensors = {"model": model_sd, "optim": optim_sd, "rng": {f"rank_{self._rank}": _rng_state()}}
        meta = {
            "format": FORMAT,
            "train_state": asdict(state),
            "loader": loader.state_dict(),
            "scheduler": t.schedulers[0].state_dict(),
            "param_groups": groups,
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "config": self.config,
            **described,
        }
        meta = json.loads(json.dumps(meta, default=_jsonable))  # a snapshot: the loop moves on meanwhile
        target = self._staging_path(step)
        writer = storage.dcp_writer(target)
        common = dict(storage_writer=writer, no_dist=not self._distributed)
        if self.cfg.async_enabled:
            if self._stager is None:
                # CPU buffers kept between saves; pinned where there is a GPU to copy from.
                pinned = torch.cuda.is_available()
                self._stager = torch_private.reusable_stager(pinned)
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="plait-checkpoint")
            written = dcp.async_save(tensors, process_group=self._save_group, async_stager=self._stager, **common)
            staged = time.perf_counter()
            self._pending = self._executor.submit(self._finish, step, written, meta, target, start, staged, writer)
        else:
            written = Future()
            try:
                written.set_result(dcp.save(tensors, **common))
            except BaseException as e:  # DCP's CheckpointException is a BaseException
                if isinstance(e, KeyboardInterrupt | SystemExit):
                    raise
                written.set_exception(e)
            self._pending = Future()
            self._pending.set_result(self._finish(step, written, meta, target, start, start, writer))
            report.update(self._collect(wait=True))
        return report

    def _short_of_space(self, model_sd: dict, optim_sd: dict) -> str:
        """Why the next save cannot fit on the checkpoint disk (the main rank measures, all ranks agree), or
        "". Only on a local disk. Its size is the last save's; before the first save of this process, the
        tensors' bytes (each tensor once, at its full size, over all ranks: one all-gather of their sizes)."""
        if storage.is_remote(self.dir):
            return ""
        if not self._estimate:  # the same on every rank: the first save of this process
            self._estimate = _estimated_bytes(model_sd, optim_sd, self._control)
        need = self._last_size or self._estimate
        why = ""
        if self.is_writer:
            free = _free_bytes(Path(self.dir))
            if free is not None and free < need:
                takes = "takes" if self._last_size else "will take about"
                why = (
                    f"not enough free space on the checkpoint disk ({_mb(free)} free on {self.dir}, a checkpoint "
                    f"{takes} {_mb(need)}); free space or lower checkpoint.keep_last"
                )
        if self._control is not None:
            box = [why]
            dist.broadcast_object_list(box, src=0, group=self._control)
            why = box[0]
        return why

    def _staging_path(self, step: int) -> Location:
        name = f"step_{step:08d}"
        return self.dir / name if storage.is_remote(self.dir) else self.dir / f"{name}.tmp"

    def _finish(
        self, step: int, written: Future, meta: dict, target: Location, start: float, staged: float, writer
    ) -> _Outcome:
        """Wait for every rank's shards (DCP's coordinator gathers all write results before it writes
        .metadata, and a failure anywhere fails the future on every rank), then publish on the main rank."""
        try:
            md: Metadata = written.result()
            if self.is_writer:
                storage.retry(lambda: self._publish(step, meta, target), "publish")
        except BaseException as e:
            if isinstance(e, KeyboardInterrupt | SystemExit):
                raise
            return _Outcome(step, False, self._failed_save(e, target), blocked_s=staged - start)
        # (torch 2.11's asynchronous save returns the metadata without its storage data: the writer counted them)
        num_bytes = sum(getattr(info, "length", 0) for info in (md.storage_data or {}).values()) or writer.plait_bytes
        self._last_size = num_bytes
        # Synchronous: the loop waited for all of it. Asynchronous: only for the staging.
        end = time.perf_counter()
        blocked = end - start if staged == start else staged - start
        outcome = _Outcome(step, True, blocked_s=blocked, write_s=end - staged, num_bytes=num_bytes)
        if self.is_writer:
            try:
                storage.retry(self._retain, "retention")
            except Exception as e:  # an old checkpoint that could not be deleted is not worth stopping for
                _warn(f"checkpoint retention in {self.dir} failed: {_one_line(e)}")
        return outcome

    def _failed_save(self, error: BaseException, target: Location) -> str:
        """After a failed save (every rank's writes have ended: DCP fails the save on all ranks together),
        the main rank removes what it left behind; returns the reason in plain words."""
        reason = _short(error)
        # torch's writer reports a full disk as "unexpected pos A vs B": look at the disk before cleaning up
        free = None if storage.is_remote(self.dir) else _free_bytes(Path(self.dir))
        if free is not None and (_is_no_space(error) or free < 1 << 20):
            reason = f"the checkpoint disk is full ({_mb(free)} left on {self.dir}; torch said: {reason})"
        if self.is_writer:
            try:
                storage.remove_tree(target)
            except Exception as e:
                reason += f"; its partial files in {target} could not be removed ({_one_line(e)})"
        return reason

    def _publish(self, step: int, meta: dict, target: Location) -> None:
        _maybe_crash_before_publish(step)
        if self.tokenizer_path is not None:
            storage.copy_in(self.tokenizer_path, target / "tokenizer.json")
        meta = {**meta, "dcp_metadata_sha256": hashlib.sha256(storage.read_bytes(target / DCP_METADATA)).hexdigest()}
        text = json.dumps(meta, indent=1).encode()
        final = self.dir / f"step_{step:08d}"
        if storage.is_remote(self.dir):
            storage.write_bytes(target / META, text)  # written last: this is the publish
            return
        storage.write_bytes(target / META, text)
        if final.exists():  # an older save of the same step (a rerun): replace it only now ...
            damage = self._verified.get(final.name) or checkpoint_problems(final)
            if (final / DCP_METADATA).exists() and not damage:
                storage.remove_tree(final)
            else:  # ... unless it is damaged (also if only its tensors failed to load): the user's to inspect
                aside = final.with_name(f"{final.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}")
                storage.rename(final, aside)
                self._verified.pop(final.name, None)
                _warn(
                    f"damaged checkpoint {final} ({damage or 'its metadata is missing'}) moved to {aside} to make "
                    f"room for the new save of its step"
                )
        storage.rename(target, final)

    def _collect(self, *, wait: bool) -> dict[str, float]:
        """The outcome of the save in flight, if it has finished (or once it has, with wait)."""
        if self._pending is None or not (wait or self._pending.done()):
            return {}
        outcome: _Outcome = self._pending.result()
        self._pending = None
        if outcome.ok:
            self._last_write_s = outcome.write_s
            return {
                "saved_step": outcome.step,
                "blocked_s": outcome.blocked_s,
                "write_s": outcome.write_s,
                "size_mb": outcome.num_bytes / 2**20,
                "failed_saves": self.failed_saves,
            }
        self.failed_saves += 1
        if outcome.step == self.total_steps and self.cfg.save_final:  # the run's error says it, once
            self.final_lost = f"the final checkpoint (step {outcome.step}) could not be written: {outcome.error}"
        elif self.is_writer:
            _warn(
                f"checkpoint of step {outcome.step} was not saved to {self.dir}: {outcome.error}; "
                f"training continues and the next save tries again"
            )
        return {"failed_step": outcome.step, "blocked_s": outcome.blocked_s, "failed_saves": self.failed_saves}

    def _retain(self) -> None:
        """Keep the newest checkpoint.keep_last complete checkpoints and every checkpoint.keep_every-th
        step; remove the other complete ones and what failed or interrupted saves left behind (no save is in
        flight now). Damaged checkpoints are neither counted nor removed: they are the user's to inspect."""
        tree = storage.list_tree(self.dir)
        complete, damaged = _classify(self.dir, tree)
        for c in complete:  # published checkpoints never change: each is verified once
            if c.name not in self._verified:
                self._verified[c.name] = checkpoint_problems(c)
                if self._verified[c.name]:
                    _warn(f"checkpoint {c} is damaged ({self._verified[c.name]}): kept, but not counted or loaded")
        damaged += [(c, self._verified[c.name]) for c in complete if self._verified[c.name]]
        complete = [c for c in complete if not self._verified[c.name]]
        steps = [step_of(c) for c in complete]
        keep = set(steps[-max(1, self.cfg.keep_last) :]) | kept_forever(steps, self.cfg.keep_every)
        for c in complete:
            if step_of(c) not in keep:
                storage.remove_tree(c)
        known = {c.name for c in complete} | {d.name for d, _ in damaged}
        for name in tree:
            if name in known or not _ANY_STEP_DIR.match(name):
                continue
            # a partial save: step_<N>.tmp on a local disk, an unpublished step_<N> prefix on S3
            if name.endswith(".tmp") or (steps and step_of(self.dir / name) < steps[-1]):
                storage.remove_tree(self.dir / name)

    # ------------------------------------------------------------------------------------------- load

    def mark_damaged(self, path: Location, why: str) -> None:
        """A checkpoint that failed to load (a CRC32 mismatch, a truncated record): from now on neither counted,
        loaded nor deleted by retention, and set aside, not replaced, by a new save of its step."""
        self._verified[path.name] = why or "it failed to load"

    def load(self, path: Location, t, *, loader, state: TrainState) -> None:
        """Restore into this rank's (possibly differently sharded) model parts and optimizers. Every rank
        checks the tensors it needs (present, tensors, same shapes; files present and long enough) and all
        agree before anything is read; see the module docstring for corrupt bytes."""
        meta = read_meta(path)
        if meta.get("weights_only"):  # `plait ckpt import`: fine-tune these weights from step 0
            for part in t.parts:
                load_model_weights(part, path, group=self._control)
            return
        model_sd, optim_sd, _ = _state_dicts(t)  # also creates empty Adam state to load into
        wanted = {"model": model_sd, "optim": optim_sd}
        everyone = _union({f"model.{k}" for k in model_sd}, self._control)  # all pipeline stages' tensors
        problems, md = _check(path, meta, wanted, expect_model=everyone)
        if problems and (other := _model_settings_differ(meta.get("config"), self.config)):
            problems.insert(0, f"it is of another model ({other})")
        # RNG state of this rank, where the saving run had this rank (and this kind of device)
        saved = md.state_dict_metadata if md is not None else {}
        rng = {k: v for k, v in _rng_state().items() if f"rng.rank_{self._rank}.{k}" in saved}
        if rng:
            wanted["rng"] = {f"rank_{self._rank}": rng}
        _agree(problems, path, self._control)
        _agree(_read(wanted, path), path, self._control)
        for part, opt in zip(t.parts, t.optimizers, strict=True):
            set_model_state_dict(
                part, {k: v for k, v in model_sd.items() if k in _names(part)}, options=StateDictOptions(strict=True)
            )
            current = get_optimizer_state_dict(part, opt)
            state_part = {k: v for k, v in optim_sd.items() if k in current["state"]}
            set_optimizer_state_dict(part, opt, {"state": state_part, "param_groups": current["param_groups"]})
        for sched, opt in zip(t.schedulers, t.optimizers, strict=True):
            sched.load_state_dict(meta["scheduler"])
            # The next update must use the LR the schedule had reached, not the fresh optimizer's.
            for group, lr in zip(opt.param_groups, sched.get_last_lr(), strict=True):
                group["lr"] = lr
        loader.load_state_dict(meta["loader"])
        state.step, state.tokens = meta["train_state"]["step"], meta["train_state"]["tokens"]
        if rng:
            _set_rng_state(rng)


def _state_dicts(t) -> tuple[dict, dict, list]:
    """Model and optimizer tensors of all this rank's parts, keyed by fully qualified parameter name
    (identical under every layout, which is what makes checkpoints load anywhere)."""
    model_sd: dict = {}
    optim_sd: dict = {}
    groups: list = []
    for part, opt in zip(t.parts, t.optimizers, strict=True):
        model_sd.update(get_model_state_dict(part))
        osd = get_optimizer_state_dict(part, opt)
        optim_sd.update(osd["state"])
        groups.extend(osd["param_groups"])
    return model_sd, optim_sd, groups


def kept_forever(steps: list[int], every: int) -> set[int]:
    """checkpoint.keep_every: the first checkpoint at or after each multiple of `every` (the multiple itself
    unless its save was deferred), from the steps saved (ascending). Once saved, it stays the first."""
    if every <= 0:
        return set()
    first: dict[int, int] = {}
    for s in steps:
        if s >= every:
            first.setdefault(s // every, s)
    return set(first.values())


def _estimated_bytes(model_sd: dict, optim_sd: dict, group) -> int:
    """Bytes a checkpoint of these state dicts takes: every tensor once, at its global size (a DTensor's whole
    shape; replicas written once, as DCP does), summed over all ranks' tensors (pipeline stages hold different
    ones), plus 1% and 1 MiB for metadata and record checksums."""
    sizes = {}
    for name, value in _flatten({"model": model_sd, "optim": optim_sd}).items():
        if isinstance(value, torch.Tensor):
            sizes[name] = math.prod(value.shape) * value.element_size()
    if group is not None:
        everyone: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, sizes, group=group)
        for rank_sizes in everyone:
            sizes.update(rank_sizes)
    total = sum(sizes.values())
    return total + total // 100 + (1 << 20)


def _model_settings_differ(saved, current: dict) -> str:
    """'model.dim 64 in the checkpoint, 128 here; ...' for the model settings that differ (at most 3)."""
    before = saved.get("model") if isinstance(saved, dict) else None
    now = current.get("model") if isinstance(current, dict) else None
    if not isinstance(before, dict) or not isinstance(now, dict):
        return ""
    diff = [f"model.{k}: {before[k]!r} in the checkpoint, {v!r} here" for k, v in now.items() if before.get(k, v) != v]
    return "; ".join(diff[:3]) + (f" and {len(diff) - 3} more" if len(diff) > 3 else "")


def _names(part: nn.Module) -> set[str]:
    return set(get_model_state_dict(part))


def _union(names: set[str], group) -> set[str]:
    """The union of every rank's names (pipeline stages hold different parts of the model)."""
    if group is None:
        return names
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, sorted(names), group=group)
    return {n for rank_names in everyone for n in rank_names}


def _rng_state() -> dict[str, torch.Tensor]:
    out = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def _set_rng_state(rng: dict[str, torch.Tensor]) -> None:
    if "cpu" in rng:
        torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])


def _maybe_crash_before_publish(step: int) -> None:
    """Fault injection for tests: PLAIT_FAULT_SAVE_CRASH=STEP ends the process (as a lost machine would)
    after STEP's shards and DCP metadata are written and before the checkpoint is published."""
    if os.environ.get("PLAIT_FAULT_SAVE_CRASH") == str(step):
        print(f"plait: fault injection: crashing before publishing step {step}", file=sys.stderr, flush=True)
        os._exit(137)


# ------------------------------------------------------------------------------------------------ loading


def load_model_weights(model: nn.Module, path: Location | str, *, group=None) -> None:
    """Load only the model from a checkpoint (generation, evaluation, export, a pipeline stage)."""
    path = path if isinstance(path, Path | RemotePath) else storage.location(path)
    sd = get_model_state_dict(model)
    problems, _ = _check(path, read_meta(path), {"model": sd})
    _agree(problems, path, group)
    _agree(_read({"model": sd}, path), path, group)
    set_model_state_dict(model, sd, options=StateDictOptions(strict=True))


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """DCP's key for each leaf: nested names joined with dots."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def _check(
    path: Location, meta: dict, wanted: dict, expect_model: set[str] | None = None
) -> tuple[list[str], Metadata | None]:
    """Everything that would make loading `wanted` from `path` fail or load wrong, as readable lines."""
    try:
        raw = storage.read_bytes(path / DCP_METADATA)
    except Exception as e:
        return [f"{DCP_METADATA} cannot be read ({_one_line(e)})"], None
    expected_hash = meta.get("dcp_metadata_sha256")
    if expected_hash and hashlib.sha256(raw).hexdigest() != expected_hash:
        return [f"{DCP_METADATA} does not match the hash in {META} (damaged, or files of different saves)"], None
    try:
        md = storage.parse_metadata(raw)
    except PlaitError as e:
        return [str(e)], None
    saved = md.state_dict_metadata
    problems: list[str] = []
    missing, not_tensor, shapes = [], [], []
    for key, value in _flatten(wanted).items():
        entry = saved.get(key)
        if entry is None:
            missing.append(key)
        elif not isinstance(entry, TensorStorageMetadata):
            not_tensor.append(key)
        elif tuple(entry.size) != tuple(value.shape):
            shapes.append(f"{key} {tuple(entry.size)} in the checkpoint, {tuple(value.shape)} in the model")
    if expect_model is not None:
        unexpected = sorted(k for k in saved if k.startswith("model.") and k not in expect_model)
        if unexpected:
            problems.append(f"{len(unexpected)} tensors not in this model: {_some(unexpected, 2)}")
    if missing:
        kinds = {"model": "of the model", "optim": "of the optimizer state"}
        parts = []
        for kind in sorted({k.split(".", 1)[0] for k in missing}):
            names = sorted(k for k in missing if k.split(".", 1)[0] == kind)
            parts.append(f"{len(names)} {kinds.get(kind, kind)} ({_some(names, 1)})")
        problems.append("tensors missing from the checkpoint: " + ", ".join(parts))
    if shapes:  # one example: the settings that differ (said first, where known) are the cause
        problems.append(f"{len(shapes)} shape{'s differ' if len(shapes) > 1 else ' differs'}, e.g. {shapes[0]}")
    if not_tensor:
        problems.append(f"not tensors (pickled objects, which plait never loads): {_some(sorted(not_tensor))}")
    problems.extend(_check_files(path, md))
    return problems, md


def _check_files(path: Location, md: Metadata) -> list[str]:
    """Every shard file DCP's metadata points into exists and is long enough."""
    need: dict[str, int] = {}
    for info in (md.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        if rel is not None:
            need[rel] = max(need.get(rel, 0), info.offset + info.length)
    try:
        sizes = storage.file_sizes(path)
    except Exception as e:
        return [f"its files cannot be listed ({_one_line(e)})"]
    missing = sorted(f for f in need if f not in sizes)
    short = sorted(f"{f} has {sizes[f]} of {n} bytes" for f, n in need.items() if f in sizes and sizes[f] < n)
    out = []
    if missing:
        out.append(f"{len(missing)} shard files missing: {_some(missing)}")
    if short:
        out.append(f"{len(short)} shard files truncated: {_some(short)}")
    return out


def _agree(problems: list[str], path: Location, group) -> None:
    """Raise on every rank if any rank found a problem (ranks check different tensors: pipeline stages)."""
    if group is not None:
        everyone: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, problems, group=group)
        merged: list[str] = []
        for rank_problems in everyone:
            merged.extend(p for p in rank_problems if p not in merged)
        problems = merged
    if problems:
        raise PlaitError(f"checkpoint {path} cannot be loaded: " + "; ".join(problems))


class _TensorsOnly(DefaultLoadPlanner):
    """DCP's planner, except that a non-tensor record is refused instead of unpickled."""

    def load_bytes(self, read_item, value) -> None:
        raise PlaitError(f"{read_item.dest_index.fqn} is a pickled object; plait loads tensors only")


def _read(state: dict, path: Location) -> list[str]:
    """Fill `state` in place from the checkpoint; the problems met (a checksum, a file that vanished).

    Every process reads on its own (DCP without collectives: its load plan needs nothing from other ranks,
    and DTensors pick out their own shards from the global metadata), so one rank can load alone (the main
    rank reading a published checkpoint back) and callers agree on the outcome afterwards."""
    try:
        with warnings.catch_warnings():  # pytest resets the module-level filter per test
            warnings.filterwarnings("ignore", message=_NO_DIST_WARNING)
            dcp.load(state, storage_reader=storage.dcp_reader(path), planner=_TensorsOnly(), no_dist=True)
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        if isinstance(e, KeyboardInterrupt | SystemExit):
            raise
        return [f"reading failed: {_short(e)}"]
    return []


# -------------------------------------------------------------------------------------------------- small


def _mb(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:,.1f} MiB"


def _free_bytes(path: Path) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _is_no_space(e: BaseException) -> bool:
    import errno

    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


def _some(items: list[str], n: int = 4) -> str:
    return ", ".join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1] if text else ''}".rstrip(": ")


_ERROR_LINE = re.compile(r"^\s*(?:[\w.]+\.)?(\w*(?:Error|Exception|Interrupt)): (.+)$")


def _short(e: BaseException) -> str:
    """The innermost error line of an exception (DCP's carry whole per-rank tracebacks in their text)."""
    lines = [m for line in str(e).splitlines() if (m := _ERROR_LINE.match(line))]
    if not lines:
        return _one_line(e)
    name, text = lines[-1].groups()
    return f"{name}: {text.strip()}"


def _warn(message: str) -> None:
    from plait.engine.metrics import warn

    warn(message)


def _jsonable(obj):
    if isinstance(obj, torch.Tensor):
        return obj.item()
    if isinstance(obj, tuple):
        return list(obj)
    raise TypeError(f"cannot store {type(obj).__name__} in checkpoint metadata")


class Checkpointing(Callback):
    """run.checkpointer attached to the trainer: after each counted step, a save when one is due (or when a
    stop was requested: then the loop ends at this step), and every callback's after_checkpoint."""

    def after_step(self, run, step: int, result) -> bool:
        stop = run.stop.requested
        saved = run.checkpointer.maybe_save(step, run.t, loader=run.loader, state=run.state, stop_requested=stop)
        run.callbacks.after_checkpoint(run, step, saved)
        return False
