"""Guards while training: bad steps, loss spikes, hangs and stragglers (config section ``guard``).

One `Guard` per run sits beside the loop: ``before_step`` and ``after_step`` around each step, and
``should_step`` inside `train_step`, between the global gradient norm and the optimizer, where it decides
whether the update is applied:

- a non-finite loss or gradient norm: skip the update, roll back to the newest checkpoint, or stop
  (guard.nonfinite_policy); N failed steps in a row end the run with an error;
- a loss spike (above mean + k std of a window of recent losses): a warning and a metric, optionally a skip;
- a hang: a watchdog thread per rank notices no progress for guard.hang_timeout_s, reports the rank, its
  phase and the last collective it entered, dumps all Python stacks and exits non-zero (an elastic agent
  then restarts the group from the newest checkpoint);
- stragglers: every log interval each rank's own time per step is all-gathered and a rank over
  guard.straggler_ratio x its peers' median is named.

Every decision is made from values that are identical on all ranks (the loss and the gradient norm are
global, all-reduced in train_step), so all ranks skip, roll back or stop together.
Cost: one host sync per step (the loss and norm read in should_step); on CPU it is free, on a GPU it
keeps the host from queueing the next step's kernels before this step's backward has finished.
Fault injection for tests lives in plait.features.faults.
"""

from __future__ import annotations

import contextlib
import faulthandler
import math
import os
import signal
import socket
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO, cast

import torch

from plait.core import torch_private
from plait.core.errors import PlaitError
from plait.core.storage import Location
from plait.engine.callbacks import Callback, RunState
from plait.engine.checkpoint import TrainState
from plait.features.health import all_gather_single
from plait.parallel.env import heartbeat_store

# The flight recorder (a ring buffer per process of the collectives it entered, for gloo and NCCL; it is
# what the hang report reads) is sized when the first collective runs: importing this module, which
# plait.engine.trainer does before it joins a group, is early enough. 2000 entries as torchtitan uses; ~µs each.
os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")

HANG_EXIT_CODE = 124  # as `timeout` uses: any non-zero status makes the elastic agent restart the group


# ------------------------------------------------------------------------------------------ loss spikes


class SpikeDetector:
    """Flags a loss above mean + num_std x std of the last `window` accepted losses (once the window is full)."""

    def __init__(self, window: int, num_std: float):
        self.losses: deque[tuple[int, float]] = deque(maxlen=window)
        self.num_std = num_std

    def score(self, loss: float) -> float | None:
        """How many standard deviations above the window's mean `loss` lies, if that makes it a spike."""
        if len(self.losses) < (self.losses.maxlen or 0):
            return None
        values = [v for _, v in self.losses]
        mean = statistics.fmean(values)
        std = max(statistics.pstdev(values, mean), 1e-4 * abs(mean), 1e-12)
        z = (loss - mean) / std
        return z if z > self.num_std else None

    def add(self, step: int, loss: float) -> None:
        self.losses.append((step, loss))

    def truncate(self, step: int) -> None:
        """Forget losses after `step` (a rollback replays them)."""
        while self.losses and self.losses[-1][0] > step:
            self.losses.pop()


# ------------------------------------------------------------------------------------------ stragglers


@dataclass
class Straggler:
    rank: int  # the rank with the largest ratio (named only when ratio > the threshold)
    ratio: float  # its own time per step / its peers' median
    own_s: list[float]  # every rank's own time per step


def find_straggler(local_s: list[float], sync_s: list[float]) -> Straggler:
    """Which rank makes the others wait, from per-rank mean step times split in two windows:

    local_s: between steps (data loading, host work, logging): no collective, so a slow rank's delay
    stays its own; sync_s: inside train_step, where every rank waits for the slowest at each collective, so
    a fast rank's sync time includes the slow rank's delay. The rank that waited least has the smallest
    sync_s; each rank's own time is its local time plus that minimum.
    Limitation: slowness *inside* the step (a slow GPU) is shared out by the collectives and not seen here.
    """
    base = min(sync_s)
    own = [x + base for x in local_s]
    ratios = []
    for r, mine in enumerate(own):
        peers = statistics.median(o for i, o in enumerate(own) if i != r)
        ratios.append(mine / max(peers, 1e-9))
    worst = max(range(len(own)), key=ratios.__getitem__)
    return Straggler(worst, ratios[worst], own)


# ------------------------------------------------------------------------------------------ hang watchdog

# (path fragment, function names or None for any, phase): the innermost frame that matches names the phase.
_PHASES = [
    ("torch/optim/", None, "optimizer"),
    ("plait/parallel/norm.py", {"clip_grad_norm"}, "gradient norm"),
    ("plait/engine/trainer.py", {"_accumulate"}, "forward/backward"),
    ("plait/parallel/pipeline.py", {"pipeline_forward_backward"}, "forward/backward"),
    ("plait/engine/validation.py", {"evaluate"}, "eval"),
    ("plait/engine/checkpoint/", {"save", "load", "load_state"}, "checkpoint"),
    ("plait/data/loader.py", {"__next__"}, "data"),
    ("plait/data/samples.py", {"__next__"}, "data"),  # your own dataset (Trainer(data=...))
    ("plait/features/health.py", None, "health check"),
    # should_step reads the loss: on a GPU the host waits there for the step's kernels and collectives
    (
        "plait/features/guards.py",
        {"should_step"},
        "waiting for the step's device work (forward/backward, gradient norm)",
    ),
    ("plait/features/guards.py", {"_report_stragglers"}, "straggler all-gather"),
    ("plait/features/guards.py", {"after_step"}, "guard"),
    ("plait/engine/trainer.py", {"train_step"}, "train step"),
    ("plait/engine/trainer.py", {"_loop"}, "between steps"),
]


def describe_stack(frame) -> tuple[str, str]:
    """(phase, where): what the training thread is doing, from its Python stack; `where` is the innermost
    torch.distributed frame (the collective it waits in) or else the innermost frame."""
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    phase = "unknown"
    for f in frames:  # innermost first
        path = f.f_code.co_filename.replace(os.sep, "/")
        hit = next(
            (p for frag, names, p in _PHASES if frag in path and (names is None or f.f_code.co_name in names)), None
        )
        if hit:
            phase = hit
            break
    # (the elastic agent's wrapper at the bottom of a launched worker's stack is no collective)
    dist_frames = [f for f in frames if _in_collectives(f.f_code.co_filename.replace(os.sep, "/"))]
    f = dist_frames[0] if dist_frames else (frames[0] if frames else None)
    if f is None:
        return phase, "?"
    path = f.f_code.co_filename.replace(os.sep, "/")
    marker = next((m for m in ("torch/", "plait/") if m in path), None)
    short = path[path.rfind(marker) :] if marker else path
    return phase, f"{short}:{f.f_lineno} in {f.f_code.co_name}"


def _in_collectives(path: str) -> bool:
    return "torch/distributed/" in path and not any(x in path for x in ("/elastic/", "/launcher/", "/run.py"))


def last_collective(thread_id: int) -> str | None:
    """The newest collective that thread entered, from torch.distributed's flight recorder, e.g.
    'gloo:all_gather on group 3 (mesh_dp_shard), #57, sizes [[4096]], state scheduled'; None if none is
    recorded. (Other threads, such as an asynchronous checkpoint's, run collectives of their own; if no
    entry carries the thread's id, the newest of any thread is given, and marked so.)"""
    try:
        entries = torch_private.flight_recorder_entries()
    except Exception:  # an older torch, or no recorder: the stack still tells
        return None
    mine = [e for e in entries if str(e.get("thread_id")) == str(thread_id)]
    if not entries:
        return None
    e = (mine or entries)[-1]
    name, desc = (list(e.get("process_group") or ("?", "?")) + ["?"])[:2]
    return (
        f"{e.get('profiling_name')} on group {name} ({desc}), #{e.get('collective_seq_id')}, "
        f"sizes {e.get('input_sizes')}, state {e.get('state')}" + ("" if mine else " (thread unknown)")
    )


SUSPENDED_S = 10.0
"""A watchdog poll (at most 1 s) late by this much means this thread was not scheduled: the process was stopped."""
SUSPENDED_CPU_SHARE = 0.5
"""...if the process used less than this share of a CPU meanwhile: a stall that holds the GIL keeps a CPU
busy all along, a stopped process uses none (the poll's count includes the moment after SIGCONT before this
thread runs: 0.6 s of 15 s measured, with the training thread busy)."""


class Watchdog:
    """A daemon thread that ends this process when the training thread makes no progress for timeout_s:
    it prints which rank, which step, the phase and the last collective, then every thread's Python stack
    (faulthandler), then exits with HANG_EXIT_CODE."""

    def __init__(self, rank: int, timeout_s: float, world_size: int = 1):
        self.rank, self.timeout_s, self.step, self.world_size = rank, timeout_s, 0, world_size
        self._last = time.monotonic()
        self._target = threading.get_ident()  # the training thread: the one that builds the guard
        self._stop = threading.Event()
        # connected by the watchdog thread, not the training thread (it may take a while)
        self._store: torch.distributed.Store | None = None
        self._store_tried, self._beat_failed = -math.inf, False
        self._thread = threading.Thread(target=self._watch, name="plait-watchdog", daemon=True)
        self._thread.start()

    def beat(self, step: int) -> None:
        self.step, self._last = step, time.monotonic()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        self.poll = min(1.0, max(0.05, self.timeout_s / 10))
        self._beat_out()  # at once: a rank that stalls in its first poll interval is still named (with its pid)
        woke, cpu = time.monotonic(), time.process_time()
        while not self._stop.wait(self.poll):
            self._forgive_suspension(time.monotonic() - woke, time.process_time() - cpu)
            woke, cpu = time.monotonic(), time.process_time()
            self._beat_out()
            idle = time.monotonic() - self._last
            if idle >= self.timeout_s:
                self._fire(idle)

    def _forgive_suspension(self, slept: float, cpu: float) -> None:
        """A poll that overslept by SUSPENDED_S or more while the whole process used almost no CPU: the process
        (or the machine) was stopped (SIGSTOP, a paused VM, a suspended laptop), not the training. That time is
        not the training thread's: it moves its last beat forward instead of counting as a hang. A training
        thread that holds the GIL for as long uses the CPU meanwhile, and still counts."""
        overslept = slept - self.poll
        if overslept >= SUSPENDED_S and cpu < SUSPENDED_CPU_SHARE * overslept:
            self._last += overslept

    def _beat_out(self) -> None:
        """This rank's heartbeat in the job's store: wall time, step, pid, host. Written by this thread, so a
        rank whose training thread waits still beats, and a stopped or dead process goes silent."""
        try:
            if self._store is None and self.world_size > 1 and time.monotonic() - self._store_tried > 10:
                self._store_tried = time.monotonic()  # unreachable: try again now and then
                self._store = heartbeat_store()
            if self._store is None:
                return
            where = describe_stack(sys._current_frames().get(self._target))[1]
            beat = f"{time.time():.3f} {self.step} {os.getpid()} {socket.gethostname()} {where}"
            self._store.set(str(self.rank), beat)
        except Exception as e:  # the store unreachable: said once, the watchdog itself still works
            if not self._beat_failed:
                self._beat_failed = True
                print(
                    f"plait: hang watchdog: rank {self.rank} cannot write its heartbeat ({type(e).__name__}: {e}); "
                    f"if it stalls, the others cannot name it",
                    file=sys.stderr if _has_fileno(sys.stderr) else sys.__stderr__,
                    flush=True,
                )

    def culprits(self) -> tuple[str, list[tuple[int, int, str]], list[int]]:
        """(a sentence naming the ranks that stalled the group, [(rank, pid, host) of the silent ones], [other
        ranks that are alive but stalled the group]): ranks whose heartbeat stopped (stopped, swapped out,
        dead); else ranks behind the others' step; else ranks that are not inside a collective while the
        others wait in one."""
        if self._store is None and self.world_size > 1:
            with contextlib.suppress(Exception):
                self._store = heartbeat_store()
        if self._store is None:
            unreachable = "no heartbeats to compare (the job's store could not be reached)"
            return (unreachable if self.world_size > 1 else ""), [], []
        silent_after = max(5.0, 5 * self.poll)
        beats = self._read_beats()
        if not any(b[0] > silent_after for b in beats.values()):
            # A rank stopped just now still has a fresh heartbeat: look once more after the threshold (a live
            # rank beats every poll meanwhile, a stopped one only ages).
            self._beating_sleep(silent_after)
            beats = self._read_beats()
        silent = [(r, b) for r, b in sorted(beats.items()) if b[0] > silent_after and r != self.rank]
        missing = [r for r in range(self.world_size) if r not in beats]
        if silent or missing:
            parts = [f"rank {r} ({b[3]}, pid {b[2]}) has sent no heartbeat for {b[0]:.1f} s" for r, b in silent]
            parts += [f"rank {r} never sent one" for r in missing]
            return (
                "the stalled rank: " + "; ".join(parts) + " (stopped, swapped out or dead: the others wait for it)",
                [(r, b[2], b[3]) for r, b in silent],
                [],
            )
        newest = max(b[1] for b in beats.values()) if beats else 0
        behind = [r for r, b in sorted(beats.items()) if b[1] < newest]
        if behind:
            names = ", ".join(f"rank {r} at step {beats[r][1]}" for r in behind)
            return f"ranks behind the others (step {newest}): {names}", [], [r for r in behind if r != self.rank]
        outside = [r for r, b in sorted(beats.items()) if "distributed" not in b[4]]
        if outside and len(outside) < len(beats):  # the others wait inside a collective for these
            names = ", ".join(f"rank {r} at {beats[r][4]}" for r in outside)
            return (
                f"the stalled rank, not in a collective while the others wait in one: {names}",
                [],
                [r for r in outside if r != self.rank],
            )
        return "every rank is alive, at the same step and in the same place (a collective or I/O is stuck)", [], []

    def _read_beats(self) -> dict[int, tuple[float, int, int, str, str]]:
        """rank -> (age in seconds, step, pid, host, where) of every heartbeat in the store."""
        now, beats = time.time(), {}
        assert self._store is not None  # noqa: S101  # culprits connected it before any read
        for r in range(self.world_size):
            with contextlib.suppress(Exception):
                t, step, pid, host, where = self._store.multi_get([str(r)])[0].decode().split(" ", 4)
                beats[r] = (now - float(t), int(step), int(pid), host, where)
        return beats

    def _fire(self, idle: float) -> None:
        phase, where = describe_stack(sys._current_frames().get(self._target))
        collective = last_collective(self._target) or "none recorded"
        culprit, silent, stalled = self.culprits()
        # sys.__stderr__ is None only without a console (pythonw): never for a training process
        out = cast("TextIO", sys.stderr if _has_fileno(sys.stderr) else sys.__stderr__)
        print(
            f"plait: hang watchdog: rank {self.rank} ({socket.gethostname()}, pid {os.getpid()}) made no progress "
            f"for {idle:.1f} s (guard.hang_timeout_s={self.timeout_s:g}) in step {self.step}, phase {phase}, "
            f"at {where}; last collective entered: {collective}. "
            + (f"{culprit[0].upper()}{culprit[1:]}. " if culprit else "")
            + f"Python stacks follow; exiting with code {HANG_EXIT_CODE} so an elastic agent can restart the group.",
            file=out,
            flush=True,
        )
        for rank, pid, host in silent:  # it cannot answer the agent's SIGTERM: end it now, on this machine
            if host == socket.gethostname() and pid != os.getpid():
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
                    print(f"plait: hang watchdog: killed stalled rank {rank} (pid {pid})", file=out, flush=True)
        faulthandler.dump_traceback(file=out, all_threads=True)
        out.flush()
        if stalled:  # this rank only waits for them: let their own watchdogs report their stacks first
            self._await_exit(stalled, deadline=time.monotonic() + self.timeout_s + 10)
        os._exit(HANG_EXIT_CODE)

    def _await_exit(self, ranks: list[int], deadline: float) -> None:
        """Wait until the heartbeats of `ranks` stop (their watchdogs exited, and the elastic agent will stop
        this process too) or the deadline passes."""
        silent_after = 3 * self.poll + 1.0
        while time.monotonic() < deadline:
            beats = self._read_beats()
            if all(r not in beats or beats[r][0] > silent_after for r in ranks):
                return
            self._beating_sleep(self.poll)

    def _beating_sleep(self, seconds: float) -> None:
        """Sleep on this (the watchdog's) thread, still beating: a rank busy reporting is not silent."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            self._beat_out()
            time.sleep(min(self.poll, left))


def _has_fileno(stream) -> bool:
    try:
        stream.fileno()
        return True
    except Exception:
        return False


# ------------------------------------------------------------------------------------------ the guard


class Guard:
    """Bad-step policy, spike detection, hang watchdog and straggler report of one run (see the module
    docstring). `t`, `checkpointer`, `loader` and `metrics` may be None in tests that need no rollback."""

    def __init__(self, cfg, env, t=None, *, checkpointer=None, loader=None, metrics=None):
        self.cfg, self.g = cfg, cfg.guard
        self.rank, self.world_size, self.device, self.is_main = env.rank, env.world_size, env.device, env.is_main
        self.t, self.checkpointer, self.loader, self.metrics = t, checkpointer, loader, metrics
        self.spikes = SpikeDetector(self.g.spike_window, self.g.spike_num_std)
        self.watchdog = Watchdog(env.rank, self.g.hang_timeout_s, env.world_size) if self.g.hang_timeout_s > 0 else None
        self.num_skipped = self.num_rollbacks = self.num_spikes = 0
        self.step = 0
        self._failures = 0  # failed steps in a row
        self._failed_at = 0  # the newest failed step: a success from there on resets the count
        self._verdict: str | None = None  # why this step's update is withheld
        self._values = (math.nan, math.nan)  # this step's loss and gradient norm
        self._spike: float | None = None
        # straggler clocks: time between steps (local) and inside them (sync), summed over a log interval
        self._mark = time.perf_counter()
        self._local_s = self._sync_s = 0.0
        self._num_timed = 0
        self._first_interval = True

    def before_step(self, step: int) -> None:
        self.step, self._verdict, self._spike = step, None, None
        if self.watchdog:
            self.watchdog.beat(step)
        now = time.perf_counter()
        self._local_s += now - self._mark
        self._mark = now

    def should_step(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        """Called by train_step between the global gradient norm and the optimizer: apply the update?"""
        values = torch.stack([loss.detach().float().reshape(()), grad_norm.detach().float().reshape(())])
        self._values = loss_v, norm_v = tuple(values.tolist())  # the one host sync of a step
        if not (math.isfinite(loss_v) and math.isfinite(norm_v)):
            if self.g.nonfinite_policy == "stop":
                raise PlaitError(
                    f"loss is {loss_v} and gradient norm {norm_v} at step {self.step}; lower optim.lr "
                    f"(now {self.cfg.optim.lr}), or set guard.nonfinite_policy=skip or rollback"
                )
            return self._fail("non-finite")
        self._spike = self.spikes.score(loss_v)
        if self._spike is not None:
            self.num_spikes += 1
            if self.g.spike_skip_enabled:
                return self._fail("spike")
        return True

    def _fail(self, reason: str) -> bool:
        self._verdict = reason
        self._failures += 1
        self._failed_at = max(self._failed_at, self.step)
        if self._failures >= self.g.max_consecutive_failures:
            loss_v, norm_v = self._values
            raise PlaitError(
                f"{self._failures} failed steps in a row (the latest: step {self.step}, {reason} loss {loss_v} "
                f"gradient norm {norm_v}; guard.max_consecutive_failures={self.g.max_consecutive_failures}): "
                f"giving up. Lower optim.lr (now {self.cfg.optim.lr}), check the data, or resume from an earlier "
                f"checkpoint"
            )
        return False

    @property
    def verdict(self) -> str | None:
        """Why this step's update is withheld ("non-finite", "spike"), or None."""
        return self._verdict

    def after_step(self, step: int, state: TrainState, roll_back: Callable[[], Location | None] | None = None) -> bool:
        """Account for the step just run; True when the run was rolled back with roll_back (the trainer's
        run.roll_back: state then holds the checkpoint's step, and the loop goes on from there)."""
        now = time.perf_counter()
        self._sync_s += now - self._mark
        self._num_timed += 1
        if self.watchdog:
            self.watchdog.beat(step)
        loss_v, norm_v = self._values
        rolled_back = False
        if self._verdict is None:
            self.spikes.add(step, loss_v)
            if step >= self._failed_at:
                self._failures = 0
            if self._spike is not None:
                window = self.g.spike_window
                message = f"loss {loss_v:.4f} is a spike, {self._spike:.1f} std above the last {window} steps' mean"
                self._warn(step, message, {"loss_spike": 1, "spike_std": self._spike})
        elif self._verdict == "non-finite" and self.g.nonfinite_policy == "rollback":
            rolled_back = self._rollback(step, state, roll_back)
        else:
            self._skip(step)
        if not rolled_back:
            self._report_stragglers(step)
        self._mark = time.perf_counter()
        return rolled_back

    def _skip(self, step: int, why: str = "") -> None:
        self.num_skipped += 1
        loss_v, norm_v = self._values
        detail = f"loss {loss_v:.4f} spike ({self._spike:.1f} std)" if self._verdict == "spike" else f"loss {loss_v}"
        self._warn(
            step,
            f"{detail}, gradient norm {norm_v}: update skipped{why} ({self.num_skipped} so far)",
            {
                "skipped": 1,
                "reason": self._verdict,
                "loss": loss_v,
                "grad_norm": norm_v,
                "num_skipped": self.num_skipped,
            },
        )

    def _rollback(self, step: int, state: TrainState, roll_back) -> bool:
        path = roll_back() if roll_back is not None else None
        if path is None:
            self._skip(step, " (no checkpoint to roll back to yet)")
            return False
        self.spikes.truncate(state.step)
        self.num_rollbacks += 1
        loss_v, norm_v = self._values
        self._warn(
            step,
            f"loss {loss_v}, gradient norm {norm_v}: rolled back to {path.name} (step {state.step}); "
            f"{self.num_rollbacks} rollback(s) so far",
            {"rollback_to": state.step, "loss": loss_v, "grad_norm": norm_v, "num_rollbacks": self.num_rollbacks},
        )
        return True

    def _report_stragglers(self, step: int) -> None:
        """Every log interval: one all-gather of (local, sync) mean step times over the world; the main rank
        writes guard/straggler_* metrics and names a rank over guard.straggler_ratio x its peers' median."""
        total = self.cfg.train.steps
        if self.world_size == 1 or not self.g.straggler_ratio or self.metrics is None:
            return
        if not self.metrics.should_log(step, total):
            return
        n = max(1, self._num_timed)
        mine = torch.tensor([self._local_s / n, self._sync_s / n], dtype=torch.float64, device=self.device)
        out = torch.empty(self.world_size * 2, dtype=torch.float64, device=self.device)
        all_gather_single(out, mine)
        first, self._first_interval = self._first_interval, False
        self._local_s = self._sync_s = 0.0
        self._num_timed = 0
        if first:  # the first step builds lazily and warms caches, unevenly across ranks
            return
        local_s, sync_s = out.view(-1, 2).T.tolist()
        s = find_straggler(local_s, sync_s)
        named = s.ratio > self.g.straggler_ratio
        self.metrics.log(
            step,
            {
                "straggler_rank": s.rank if named else -1,
                "straggler_ratio": s.ratio,
                "slowest_rank": s.rank,
                "rank_step_s_max": max(s.own_s),
                "rank_step_s_median": statistics.median(s.own_s),
            },
            prefix="guard",
        )
        if named and self.is_main:
            peers = statistics.median(o for i, o in enumerate(s.own_s) if i != s.rank)
            self._print(
                step,
                f"straggler: rank {s.rank} takes {s.ratio:.1f}x its peers' time per step "
                f"({s.own_s[s.rank]:.3f} s vs {peers:.3f} s median, measured outside collectives)",
            )

    def _warn(self, step: int, message: str, values: dict) -> None:
        if self.metrics is not None:
            self.metrics.log(step, values, prefix="guard")
        if self.is_main:
            self._print(step, message)

    def _print(self, step: int, message: str) -> None:
        from plait.engine.metrics import warn

        warn(f"guard: step {step}: {message}")

    def close(self) -> None:
        """Stop the watchdog and summarise what the guard did."""
        if self.watchdog:
            self.watchdog.stop()
        if self.is_main and (self.num_skipped or self.num_rollbacks or self.num_spikes):
            from plait.engine.metrics import info

            info(
                f"guard: {self.num_skipped} step(s) skipped, {self.num_rollbacks} rollback(s), "
                f"{self.num_spikes} loss spike(s)"
            )


class Guards(Callback):
    """The run's Guard (bad steps, spikes, hang watchdog, stragglers) attached to the trainer."""

    def __init__(self):
        self.guard: Guard | None = None

    def on_start(self, run) -> None:
        self.guard = Guard(
            run.cfg, run.env, run.t, checkpointer=run.checkpointer, loader=run.loader, metrics=run.metrics
        )

    def before_step(self, run, step: int) -> None:
        assert self.guard is not None  # noqa: S101  # on_start built it
        self.guard.before_step(step)

    def should_step(self, run: RunState, loss, grad_norm) -> None:
        assert self.guard is not None  # noqa: S101  # on_start built it
        if not self.guard.should_step(loss, grad_norm):
            run.withhold_step(f"guard: {self.guard.verdict}")

    def after_step(self, run: RunState, step: int, result) -> None:
        assert self.guard is not None  # noqa: S101  # on_start built it
        self.guard.after_step(step, run.state, roll_back=run.roll_back)

    def close(self, run) -> None:
        if self.guard is not None:
            self.guard.close()
