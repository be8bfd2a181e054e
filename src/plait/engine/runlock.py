"""One run per run directory: a lock beside the run directory (local disks, NFS, Lustre) and a lease object in
an ``s3://`` checkpoint directory, each naming its holder and kept fresh by a heartbeat.

Two jobs on one run directory (a command started twice, a Slurm job resubmitted while the first still runs)
would both train, interleave their metrics and overwrite each other's checkpoints, and both exit 0. The lock
refuses the second at once, before it writes anything, naming the holder and the way out.

Where: ``<run.out_dir>/<run.name>.lock`` (beside the run directory, so that run.overwrite can move the directory
aside while the lock stays held), and ``<checkpoint.dir>/run.lock`` when checkpoints live elsewhere (a local
directory, or an S3 prefix: a lease object).

How, on a file system: the lock is written whole to a temporary file and hard-linked to its name. link(2) is
atomic and fails on an existing name on local disks, NFS and Lustre alike (where O_EXCL and flock are not
dependable everywhere). The holder rewrites its heartbeat every HEARTBEAT_S (temporary file + rename) after
checking that the file is still its own. On S3: a conditional PUT (If-None-Match: *) creates the lease;
heartbeats and take-overs are PUTs conditional on the ETag read (If-Match), so two contenders cannot both win.

Stale: on the same machine (same host, boot and PID namespace) a lock whose process is gone, a zombie, or
whose PID now belongs to a younger process: taken over at once, with a warning. Elsewhere a heartbeat older
than LEASE_S (clocks across a cluster agree within seconds): taken over. A heartbeat that is late but not yet
expired is waited out (at most LEASE_S). The same job restarted by torchrun's elastic agent (the same rendezvous
id, a higher restart count) takes its lock over from its earlier attempt without a warning; `plait train
--nproc` holds the lock in its launcher across its restarts and hands it to its workers (PLAIT_RUN_LOCK).
``run.break_lock=true`` takes over a lock that still looks alive (after a warning naming its holder).

Fencing: a holder can lose its lock without knowing it yet (run.break_lock, or it was stopped or held up past
its lease and then went on). Its heartbeat notices within HEARTBEAT_S, but a save may end sooner: so every
publish re-reads the lock first (the lock's token is the fencing token; plait.core.publish.check_fence) and a
run whose lock was taken stops there with exit 2, publishing nothing more. A run that took the lock from a
holder that may still be running (break_lock, an expired lease, a stopped process) deletes none of its
unfinished files (plait.engine.checkpoint moves them aside and says so). A heartbeat from the future (the
holder's clock is ahead) is named as such, and the lock file's own age judges that holder instead.
"""

from __future__ import annotations

import contextlib
import errno
import getpass
import json
import os
import socket
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from plait.core import publish, torch_private
from plait.core.errors import ConfigError, PlaitError
from plait.core.storage import Location, RemotePath

HEARTBEAT_S = 10.0
"""How often the holder rewrites its heartbeat."""
LEASE_S = 60.0
"""A heartbeat older than this: the holder is gone (a lost node, a SIGKILL elsewhere). Six heartbeats: a holder
held up by a slow shared file system for a while is not taken for dead."""
LATE_S = 3 * HEARTBEAT_S
"""A heartbeat older than this but within the lease: the holder may be gone; the lease is waited out."""
SKEW_S = 5.0
"""A heartbeat more than this in the future: the holder's clock is ahead of ours (its heartbeats are not
comparable with our clock; the lock file's age is used instead)."""
LOCK_ENV = "PLAIT_RUN_LOCK"
"""Set by `plait train --nproc` for its workers: the token of the lock their launcher holds."""
FORMAT = "plait-run-lock-v1"
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


# ------------------------------------------------------------------------------------------------ holders


def _read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _boot_id() -> str | None:
    return _read_text("/proc/sys/kernel/random/boot_id")


def _pid_ns() -> str | None:
    with contextlib.suppress(OSError):
        return os.readlink("/proc/self/ns/pid")
    return None


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks since boot) of a process, from /proc; None where unknown."""
    text = _read_text(f"/proc/{pid}/stat")
    if not text or ")" not in text:
        return None
    fields = text.rsplit(")", 1)[1].split()
    try:
        return fields[0], int(fields[19])
    except (IndexError, ValueError):
        return None


def _user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no name for this uid (a container)
        return ""


def identity(token: str | None = None) -> dict[str, Any]:
    """Who holds a lock: host, pid (with its start time, boot and PID namespace: a reused PID or another
    container is told apart), user, job (torchrun's rendezvous id) and restart count, the command, since when."""
    stat = _proc_stat(os.getpid())
    now = time.time()
    job = os.environ.get("TORCHELASTIC_RUN_ID", "") if "TORCHELASTIC_RESTART_COUNT" in os.environ else ""
    return {
        "format": FORMAT,
        "token": token or uuid.uuid4().hex,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "pid_start": stat[1] if stat else None,
        "boot": _boot_id(),
        "pid_ns": _pid_ns(),
        "user": _user(),
        "job": "" if job == "none" else job,  # torchrun's default id names no job
        "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0),
        "command": " ".join([os.path.basename(sys.argv[0] or "python"), *sys.argv[1:]])[:300],
        "since": now,
        "heartbeat": now,
    }


def holder_alive(holder: dict[str, Any]) -> bool | None:
    """True / False where this machine can tell (the holder ran on this host, this boot, this PID namespace),
    None where it cannot (another machine or container: its heartbeat decides)."""
    if (holder.get("host"), holder.get("boot"), holder.get("pid_ns")) != (socket.gethostname(), _boot_id(), _pid_ns()):
        return None
    pid = holder.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's live process
    stat = _proc_stat(pid)
    if stat is None:
        return True if holder.get("pid_start") is None else None
    state, start = stat
    if state in ("Z", "X"):  # killed, not yet reaped by its parent
        return False
    return holder.get("pid_start") in (None, start)  # else the PID was reused by a younger process


def describe(holder: dict[str, Any] | None) -> str:
    """'host h, pid 12 (user u), since 2026-11-27 10:01:02 UTC, last heartbeat 3 s ago: plait train ...'."""
    if not holder:
        return "an unknown holder (the lock file cannot be read)"
    since = holder.get("since")
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(since)) if isinstance(since, int | float) else "?"
    beat = holder.get("heartbeat")
    age = ""
    if isinstance(beat, int | float):
        ahead = beat - time.time()
        age = (
            f", last heartbeat {ahead:.0f} s in the future (its clock is ahead of this machine's by at least "
            f"{ahead:.0f} s)"
            if ahead > SKEW_S
            else f", last heartbeat {max(0.0, -ahead):.0f} s ago"
        )
    user = f" (user {holder['user']})" if holder.get("user") else ""
    job = f", job {holder['job']} restart {holder.get('restart', 0)}" if holder.get("job") else ""
    command = str(holder.get("command") or "")
    command = f": {command[:117] + '...' if len(command) > 120 else command}" if command else ""
    return f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}{user}{job}, since {when}{age}{command}"


def _parse(data: bytes) -> dict[str, Any] | None:
    try:
        holder = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None
    return holder if isinstance(holder, dict) and holder.get("format") == FORMAT else None


# ----------------------------------------------------------------------------------------------- backends


class _FileLock:
    """A lock file on a local or shared file system. `tag` is the content read: a change means another writer."""

    def __init__(self, path: Path):
        self.path = path
        self.made: list[Path] = []  # directories made for the lock: removed with it while empty

    def __str__(self) -> str:
        return str(self.path)

    def create(self, data: bytes) -> Any:
        """Write the lock whole under its name if there is none (link(2): atomic, NFS-safe); its tag, or None."""
        missing = [p for p in [self.path.parent, *self.path.parent.parents] if not p.exists()]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.made = self.made or missing
        tmp = self.path.with_name(f".{self.path.name}.{uuid.uuid4().hex[:12]}.tmp")
        _write_synced(tmp, data)
        try:
            os.link(tmp, self.path)
            return data
        except FileExistsError:
            return None
        except OSError as e:
            if e.errno in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):  # no hard links here
                return self._create_exclusive(data)
            with contextlib.suppress(OSError):  # NFS: the reply to a link that succeeded can be lost
                if os.stat(tmp).st_nlink == 2:
                    return data
            raise
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()

    def _create_exclusive(self, data: bytes) -> Any:
        """Where there are no hard links: O_EXCL (a reader meanwhile sees an empty file: judged by its age)."""
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return None
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return data

    def read(self) -> tuple[bytes, Any, float] | None:
        """(content, tag, seconds since the file last changed), or None when there is no lock."""
        try:
            data = self.path.read_bytes()
            age = time.time() - self.path.stat().st_mtime
        except FileNotFoundError:
            return None
        return data, data, age

    def replace(self, data: bytes, tag: Any) -> Any:
        """Rewrite the lock if it is still the one read as `tag` (the holder's own heartbeat); its new tag."""
        now = self.read()
        if now is None or now[1] != tag:
            return None
        tmp = self.path.with_name(f".{self.path.name}.{uuid.uuid4().hex[:12]}.tmp")
        _write_synced(tmp, data)
        os.replace(tmp, self.path)
        return data

    def take_over(self, data: bytes, tag: Any) -> Any:
        """Replace a stale lock read as `tag`: it is renamed aside first, which only one contender can do; if
        it changed meanwhile (its holder wrote a heartbeat), it is put back and the take-over fails."""
        aside = self.path.with_name(f".{self.path.name}.stale-{uuid.uuid4().hex[:12]}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return None
        try:
            if aside.read_bytes() != tag:
                with contextlib.suppress(OSError):
                    os.link(aside, self.path)
                return None
            return self.create(data)
        finally:
            with contextlib.suppress(OSError):
                aside.unlink()

    def _marker(self, token: str) -> Path:
        return self.path.with_name(f".{self.path.name}.displaced-{token[:16]}")

    def mark(self, token: str, data: bytes) -> None:
        """Leave word for the holder of `token`, taken over while it may still run (see displaced())."""
        tmp = self.path.with_name(f".{self.path.name}.{uuid.uuid4().hex[:12]}.tmp")
        _write_synced(tmp, data)
        os.replace(tmp, self._marker(token))

    def marked(self, token: str) -> bool:
        return self._marker(token).exists()

    def unmark(self, token: str) -> None:
        self._marker(token).unlink(missing_ok=True)

    def remove(self, tag: Any) -> None:
        now = self.read()
        if now is not None and now[1] == tag:
            self.path.unlink(missing_ok=True)
        for directory in self.made:  # a run refused before it wrote anything leaves no trace
            try:
                directory.rmdir()
            except OSError:
                break


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


class _S3Lease:
    """A lease object on S3 (or any store with conditional writes): `tag` is its ETag."""

    def __init__(self, loc: RemotePath):
        self.loc = loc
        self.bucket, self.key = loc.url.removeprefix("s3://").split("/", 1)

    def __str__(self) -> str:
        return str(self.loc)

    def _put(self, data: bytes, **condition) -> Any:
        try:
            return self.loc.fs.call_s3("put_object", Bucket=self.bucket, Key=self.key, Body=data, **condition)["ETag"]
        except OSError as e:
            if _precondition_failed(e):
                return None
            raise

    def create(self, data: bytes) -> Any:
        return self._put(data, IfNoneMatch="*")

    def read(self) -> tuple[bytes, Any, float] | None:
        """Content, ETag and age in one GET (the content and the tag of the same version)."""
        from fsspec.asyn import sync

        fs = self.loc.fs

        async def get():
            got = await torch_private.s3_get_object(fs, self.bucket, self.key)
            async with got["Body"] as body:
                return await body.read(), got["ETag"], got.get("LastModified")

        try:
            data, tag, modified = sync(fs.loop, get)
        except FileNotFoundError:
            return None
        return data, tag, time.time() - modified.timestamp() if modified is not None else 0.0

    def replace(self, data: bytes, tag: Any) -> Any:
        return self._put(data, IfMatch=tag)

    take_over = replace

    def _marker(self, token: str) -> RemotePath:
        return self.loc.parent / f"{self.loc.name}.displaced-{token[:16]}"

    def mark(self, token: str, data: bytes) -> None:
        self.loc.fs.pipe_file(self._marker(token).url.removeprefix("s3://"), data)

    def marked(self, token: str) -> bool:
        return self.loc.fs.exists(self._marker(token).url.removeprefix("s3://"))

    def unmark(self, token: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.loc.fs.rm_file(self._marker(token).url.removeprefix("s3://"))

    def remove(self, tag: Any) -> None:
        try:
            self.loc.fs.call_s3("delete_object", Bucket=self.bucket, Key=self.key, IfMatch=tag)
        except FileNotFoundError:
            pass
        except OSError as e:
            if not _precondition_failed(e):
                raise


def _precondition_failed(e: BaseException) -> bool:
    if isinstance(e, FileExistsError):
        return True
    cause = getattr(e, "__cause__", None)
    code = getattr(cause, "response", {}).get("Error", {}).get("Code", "") if cause is not None else ""
    return code in ("PreconditionFailed", "412", "ConditionalRequestConflict") or (
        not code and getattr(e, "errno", None) == errno.EINVAL
    )


def _remote(lock) -> bool:
    return isinstance(lock, _S3Lease)


def _backend(place: Location) -> _FileLock | _S3Lease:
    return _S3Lease(place) if isinstance(place, RemotePath) else _FileLock(Path(place))


# ------------------------------------------------------------------------------------------------ the lock


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
                lock = _backend(place)
                try:
                    self._acquire_one(lock, break_lock)
                except OSError as e:
                    fix = "; check that the server is up and the checkpoint.s3_endpoint" if _remote(lock) else ""
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
            lock = _backend(place)
            got = lock.read()
            holder = _parse(got[0]) if got else None
            if not holder or holder.get("token") != token:
                raise RunLocked(
                    f"{lock} is not held by this job's launcher (it holds: {describe(holder) if got else 'nothing'}); "
                    f"start the run again"
                )
        self.token, self.handed = token, True
        self._fence_locks = [_backend(place) for place in self.places]
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
            holder = _parse(raw)
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
        stopped = bool(alive) and _stopped(holder)
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
                holder = _parse(got[0])
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
            holder = _parse(got[0])
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
                if got is not None and (_parse(got[0]) or {}).get("token") == self.token:
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


def _stopped(holder: dict[str, Any]) -> bool:
    """The holder's process (on this machine) is stopped (SIGSTOP, Ctrl-Z): its heartbeat decides, as for a
    holder elsewhere; it may go on later, and then finds its lock taken (the fence)."""
    stat = _proc_stat(holder["pid"]) if isinstance(holder.get("pid"), int) else None
    return stat is not None and stat[0] in ("T", "t")


def _guarded(place: Location) -> str:
    """The directory a lock guards: checkpoint.dir for its run.lock, the run directory for <run>.lock."""
    text = str(place)
    return text.rsplit("/", 1)[0] if text.endswith("/" + LOCK_FILE) else text.removesuffix(".lock")


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _what(lock) -> str:
    path = str(lock)
    if isinstance(lock, _FileLock) and lock.path.name != LOCK_FILE:
        return f"run directory {path.removesuffix('.lock')}"
    return f"checkpoint directory {path.rsplit('/', 1)[0]}"


def _warn(message: str) -> None:
    from plait.engine.metrics import warn

    warn(message)
