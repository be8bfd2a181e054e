"""Who holds a run lock (plait.engine.runlock): the holder's identity as written into the lock (host, PID with
its start time, boot and PID namespace, user, job, command, heartbeat), whether this machine can tell it is
still alive, and its description in messages."""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import socket
import sys
import time
import uuid
from typing import Any

FORMAT = "plait-run-lock-v1"
SKEW_S = 5.0
"""A heartbeat more than this in the future: the holder's clock is ahead of ours (its heartbeats are not
comparable with our clock; the lock file's age is used instead)."""


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


def parse(data: bytes) -> dict[str, Any] | None:
    try:
        holder = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None
    return holder if isinstance(holder, dict) and holder.get("format") == FORMAT else None


def process_stopped(holder: dict[str, Any]) -> bool:
    """The holder's process (on this machine) is stopped (SIGSTOP, Ctrl-Z): its heartbeat decides, as for a
    holder elsewhere; it may go on later, and then finds its lock taken (the fence)."""
    stat = _proc_stat(holder["pid"]) if isinstance(holder.get("pid"), int) else None
    return stat is not None and stat[0] in ("T", "t")
