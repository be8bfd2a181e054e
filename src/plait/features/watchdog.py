"""The hang watchdog (guard.hang_timeout_s): a daemon thread per rank that notices when the training thread
makes no progress, names the rank, its phase (from its Python stack) and the last collective it entered (from
torch.distributed's flight recorder), names the rank that stalled the group (from the heartbeats every rank's
watchdog writes into the job's store), dumps all Python stacks and exits non-zero, so that an elastic agent
restarts the group from the newest checkpoint. plait.features.guards.Guard starts and feeds it.
"""

from __future__ import annotations

import contextlib
import faulthandler
import math
import os
import signal
import socket
import sys
import threading
import time
from typing import TextIO, cast

import torch

from plait.core import torch_private
from plait.parallel.env import heartbeat_store

# The flight recorder (a ring buffer per process of the collectives it entered, for gloo and NCCL; it is
# what the hang report reads) is sized when the first collective runs: importing this module (plait.api does,
# through plait.features.guards, and so does any program that gives the Trainer a Guards callback, before the
# Trainer joins its group) is early enough. 2000 entries as torchtitan uses; ~µs each.
os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")

HANG_EXIT_CODE = 124  # as `timeout` uses: any non-zero status makes the elastic agent restart the group

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
    ("plait/features/health", None, "health check"),  # health.py and health_collectives.py
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
