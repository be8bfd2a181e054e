"""The run lock itself (see plait.engine.runlock): taken whole or not at all, judged against a holder found in
place, kept fresh by a heartbeat thread, re-read as a fence before every publish, released at the end."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import uuid
from typing import Any

from plait.core import publish
from plait.core.errors import ConfigError, PlaitError
from plait.core.storage import Location
from plait.engine.runlock.backends import FileLock, backend, is_lease
from plait.engine.runlock.holder import SKEW_S, describe, holder_alive, identity, parse, process_stopped

HEARTBEAT_S = 10.0
"""How often the holder rewrites its heartbeat."""
LEASE_S = 60.0
"""A heartbeat older than this: the holder is gone (a lost node, a SIGKILL elsewhere). Six heartbeats: a holder
held up by a slow shared file system for a while is not taken for dead."""
LATE_S = 3 * HEARTBEAT_S
"""A heartbeat older than this but within the lease: the holder may be gone; the lease is waited out."""
LOCK_ENV = "PLAIT_RUN_LOCK"
"""Set by `plait train --nproc` for its workers: the token of the lock their launcher holds."""
LOCK_FILE = "run.lock"  # in a checkpoint.dir of its own


class RunLocked(ConfigError):
    """The run directory is held by another run (exit 2: nothing was written)."""


def lock_places(cfg) -> list[Location]:
    """The locks a run takes: beside its run directory, and in checkpoint.dir when that is set."""
    from plait.engine.checkpoint import checkpoint_dir

    places: list[Location] = [cfg.run_dir.with_name(cfg.run_dir.name + ".lock")]
    if cfg.checkpoint.dir:
        places.append(checkpoint_dir(cfg) / LOCK_FILE)
    return places


class RunLock:
    """The locks of one run (see the module docstring). `acquire()` takes them all or none; a heartbeat
    thread keeps them fresh until `release()`. If another process takes one over meanwhile (this process was
    held up past its lease), `lost` says so and the trainer stops at its next step; before that, `fenced()`
    (asked by every publish, plait.core.publish.check_fence) re-reads the locks and refuses a publish."""

    def __init__(self, places: list[Location], *, token: str | None = None):
        self.places = places
        self.token = token or uuid.uuid4().hex
        self.lost = ""
        self.handed = False  # held by this process's launcher: neither refreshed nor released here
        self._displaced = ""  # the holder this lock was taken from while it may still be running
        self._fence_locks: list = []  # the locks fenced() re-reads
        self._held: list[list] = []  # [backend, tag of what we wrote]
        self._failing = False  # the last heartbeat failed
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._me = identity(self.token)

    @classmethod
    def for_run(cls, cfg) -> RunLock:
        return cls(lock_places(cfg))

    def acquire(self, *, break_lock: bool = False) -> RunLock:
        """Take every lock, or raise RunLocked (nothing written) naming the holder and the way out."""
        handed = os.environ.get(LOCK_ENV)
        if handed:
            self._check_handed(handed)
            return self
        try:
            for place in self.places:
                lock = backend(place)
                try:
                    self._acquire_one(lock, break_lock)
                except OSError as e:
                    fix = "; check that the server is up and the checkpoint.s3_endpoint" if is_lease(lock) else ""
                    raise PlaitError(f"cannot take the run lock {lock}: {type(e).__name__}: {e}{fix}") from None
        except BaseException:
            self.release()
            raise
        self._fence_locks = [lock for lock, _ in self._held]
        publish.FENCES.append(self)
        self._thread = threading.Thread(target=self._beat, name="plait-run-lock", daemon=True)
        self._thread.start()
        return self

    def _check_handed(self, token: str) -> None:
        """A worker of `plait train --nproc`: its launcher holds the locks; they must be that launcher's."""
        for place in self.places:
            lock = backend(place)
            got = lock.read()
            holder = parse(got[0]) if got else None
            if not holder or holder.get("token") != token:
                raise RunLocked(
                    f"{lock} is not held by this job's launcher (it holds: {describe(holder) if got else 'nothing'}); "
                    f"start the run again"
                )
        self.token, self.handed = token, True
        self._fence_locks = [backend(place) for place in self.places]
        publish.FENCES.append(self)

    def _data(self) -> bytes:
        self._me["heartbeat"] = time.time()
        return json.dumps(self._me, indent=1).encode()

    def _acquire_one(self, lock, break_lock: bool) -> None:
        waiting = False
        while True:
            data = self._data()
            tag = lock.create(data)
            if tag is not None:
                self._held.append([lock, tag])
                return
            got = lock.read()
            if got is None:
                continue  # released meanwhile
            raw, found, file_age = got
            holder = parse(raw)
            verdict, why = self._judge(holder, file_age)
            if verdict == "late" and not break_lock:
                if not waiting:
                    _warn(
                        f"{lock} is held by {describe(holder)}; {why}: waiting up to {LEASE_S:.0f} s for it to expire"
                    )
                    waiting = True
                time.sleep(1.0)
                continue
            if verdict == "held" and not break_lock:
                setting = "run.name" if _what(lock).startswith("run") else "checkpoint.dir"
                raise RunLocked(
                    f"{_what(lock)} is in use by another run: {describe(holder)} ({why}). Wait for it to end or "
                    f"choose another {setting}; if that run is gone, pass --run.break_lock=true (lock: {lock})"
                )
            if verdict != "restart":
                reason = why if verdict != "held" else "run.break_lock=true"
                _warn(f"taking over the lock {lock} from {describe(holder)}: {reason}")
            tag = lock.take_over(data, found)
            if tag is not None:
                self._held.append([lock, tag])
                if verdict in ("held", "expired") and holder:  # it may still run: its unfinished files are not ours
                    self._displaced = self._displaced or describe(holder)
                    lock.mark(str(holder.get("token")), data)  # its word that it lost the lock, kept after ours ends
                return

    def _judge(self, holder: dict | None, file_age: float) -> tuple[str, str]:
        """('stale' | 'restart' | 'expired' | 'late' | 'held', why) for a lock found in place. Stale: its holder
        is gone; expired: no heartbeat within the lease (it may still run: stopped, or cut off)."""
        if holder is None:  # unreadable, or being written this instant: its file's age decides
            if file_age > LEASE_S:
                return "stale", f"an unreadable lock file, unchanged for {file_age:.0f} s"
            return "held", f"an unreadable lock file, changed {file_age:.0f} s ago"
        alive = holder_alive(holder)
        me = self._me
        if me["job"] and holder.get("job") == me["job"] and _int(holder.get("restart")) < me["restart"] and not alive:
            return "restart", "an earlier attempt of this job"  # torchrun restarted the group: no warning
        if alive is False:
            return "stale", "its process has ended"
        stopped = bool(alive) and process_stopped(holder)
        if alive and not stopped:
            return "held", "it is running on this machine"
        where = "its process is stopped (SIGSTOP, Ctrl-Z) on this machine" if stopped else "on another machine"
        beat = holder.get("heartbeat")
        age = time.time() - beat if isinstance(beat, int | float) else file_age
        skew = ""
        if age < -SKEW_S:  # its clock is ahead: its heartbeats cannot be compared with our clock
            skew = (
                f"; its heartbeat is {-age:.0f} s in the future: the clock of host {holder.get('host', '?')} is "
                f"ahead of this machine's by at least {-age:.0f} s, so the lock file's age ({max(0.0, file_age):.0f} "
                f"s) is used instead; fix the clocks (NTP)"
            )
            age = file_age
        if age > LEASE_S:
            return "expired", f"no heartbeat for {age:.0f} s ({where}){skew}"
        if age > LATE_S:
            return "late", f"no heartbeat for {age:.0f} s ({where}){skew}"
        return "held", f"{where}; a lock is taken over {LEASE_S:.0f} s after its last heartbeat{skew}"

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            self.heartbeat()

    def heartbeat(self) -> None:
        """Rewrite each lock's heartbeat if it is still ours. One removed is written again; one taken over by
        another run sets `lost`."""
        for held in self._held:
            lock, tag = held
            if self.lost:
                return
            try:
                got = lock.read()
                if got is None:
                    if lock.marked(self.token):  # taken over and released meanwhile (this process was held up)
                        self.lost = f"the run lock {lock} was taken over by another run (which has ended since)"
                        return
                    new = lock.create(self._data())
                    if new is not None:
                        held[1] = new
                        _warn(f"the run lock {lock} was removed by someone; written again (this run still uses it)")
                    continue
                holder = parse(got[0])
                if holder is None or holder.get("token") != self.token:
                    self.lost = f"the run lock {lock} was taken over by {describe(holder)}"
                    return
                new = lock.replace(self._data(), got[1])
                if new is not None:
                    held[1] = new
            except Exception as e:  # a slow or failing file system: the next beat tries again; the lease is long
                if not self._failing:  # once per spell of failures
                    _warn(
                        f"run lock {lock}: heartbeat failed ({type(e).__name__}: {e}); trying again every "
                        f"{HEARTBEAT_S:.0f} s (after {LEASE_S:.0f} s of this another run could take the lock over)"
                    )
                self._failing = True
                continue
            self._failing = False

    # ---------------------------------------------------------------------------- the fence (plait.core.publish)

    def covers(self, where: object) -> bool:
        """Whether `where` lies in a directory this lock guards (the run directory, checkpoint.dir)."""
        text = str(where).rstrip("/")
        return any(text == root or text.startswith(root + "/") for root in map(_guarded, self.places))

    def fenced(self) -> str:
        """Why this run may no longer publish ("" while every lock is still its own): re-reads each lock (one
        small read; a GET on S3) just before a publish, so that a take-over since the last heartbeat counts."""
        if self.lost:
            return self.lost
        for lock in self._fence_locks:
            got = lock.read()
            if got is None and lock.marked(self.token):  # taken over and released meanwhile
                self.lost = f"the run lock {lock} was taken over by another run (which has ended since)"
                return self.lost
            if got is None:  # removed by hand: the heartbeat writes it again; no other run holds it
                continue
            holder = parse(got[0])
            if holder is None or holder.get("token") != self.token:
                self.lost = f"the run lock {lock} was taken over by {describe(holder)}"
                return self.lost
        return ""

    def displaced(self) -> str:
        return self._displaced

    def release(self) -> None:
        """Remove the locks this process holds (those a launcher handed over stay with it)."""
        with contextlib.suppress(ValueError):
            publish.FENCES.remove(self)
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * HEARTBEAT_S)
        self._thread = None
        for lock in self._fence_locks if self.lost and not self.handed else []:  # its word to this run is read: removed
            with contextlib.suppress(Exception):
                lock.unmark(self.token)
        for lock, _ in reversed(self._held):
            try:
                got = lock.read()
                if got is not None and (parse(got[0]) or {}).get("token") == self.token:
                    lock.remove(got[1])
            except Exception as e:
                _warn(f"run lock {lock} could not be removed ({type(e).__name__}: {e}); the next run takes it over")
        self._held = []

    @contextlib.contextmanager
    def held(self):
        """Held (acquired already) for the block, then released."""
        try:
            yield self
        finally:
            self.release()

    def handed_env(self) -> dict[str, str]:
        """The environment of workers that run under this (launcher's) lock."""
        return {LOCK_ENV: self.token}


def _guarded(place: Location) -> str:
    """The directory a lock guards: checkpoint.dir for its run.lock, the run directory for <run>.lock."""
    text = str(place)
    return text.rsplit("/", 1)[0] if text.endswith("/" + LOCK_FILE) else text.removesuffix(".lock")


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _what(lock) -> str:
    path = str(lock)
    if isinstance(lock, FileLock) and lock.path.name != LOCK_FILE:
        return f"run directory {path.removesuffix('.lock')}"
    return f"checkpoint directory {path.rsplit('/', 1)[0]}"


def _warn(message: str) -> None:
    from plait.engine.metrics import warn

    warn(message)
