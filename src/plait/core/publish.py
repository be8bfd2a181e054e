"""Directories that appear whole or not at all: written under a temporary sibling name, published by rename.
The one place plait does this (prepared data, Hugging Face exports, imported checkpoints).

Fences: a run that holds its directory's lock (plait.engine.runlock) registers a fence here, and every writer
below it asks `check_fence(where)` just before it publishes there (a checkpoint, a final checkpoint). A fence
re-reads the lock: if another run has taken it over (run.break_lock, or this process was held up past its
lease), LockLost is raised and nothing is published. Registered from above, so that the writers need not
import the lock (arrows point down)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

from plait.core.errors import PlaitError


class LockLost(PlaitError):
    """Another run took this run's lock over: it stops before publishing anything more (exit 2, as a run refused
    by the lock at its start)."""


class Fence(Protocol):
    def covers(self, where: object) -> bool:
        """Whether the lock guards this location (a run or checkpoint directory, or something inside it)."""
        ...

    def fenced(self) -> str:
        """Why this process may no longer publish under the lock (it was taken over), or "" while it may."""
        ...

    def displaced(self) -> str:
        """The holder this lock was taken from while it may still be running (its unfinished files are not
        ours to delete), or ""."""
        ...


FENCES: list[Fence] = []
"""The fences of the locks this process holds (added on acquire, removed on release)."""


def check_fence(where: object, what: str) -> None:
    """Raise LockLost if a lock guarding `where` was taken over by another run; `what` is what was about to be
    published (for the message)."""
    for fence in list(FENCES):
        if fence.covers(where) and (why := fence.fenced()):
            raise LockLost(
                f"{why}: this run stops without publishing {what}, so that two runs do not write one directory "
                f"(its earlier checkpoints are kept; the other run now owns the directory)"
            )


def displaced_holder(where: object) -> str:
    """The holder (possibly still running) that a lock guarding `where` was taken from, or ""."""
    return next((d for f in list(FENCES) if f.covers(where) and (d := f.displaced())), "")


def is_nonempty(out: Path) -> bool:
    return out.exists() and (not out.is_dir() or any(out.iterdir()))


RENAME_EXCHANGE = 2
"""renameat2's flag (linux/fs.h): swap two paths in one step."""


def exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths in one step (Linux's renameat2 with RENAME_EXCHANGE, on local file systems that
    support it: ext4, xfs, btrfs, tmpfs). False where it is not available: the caller falls back."""
    if sys.platform != "linux":
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)  # glibc 2.28 and newer
    if renameat2 is None:
        return False
    at_cwd = -100  # AT_FDCWD
    if renameat2(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # this file system (or kernel) cannot
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def _publish(tmp: Path, out: Path, *, overwrite: bool, exists_error: PlaitError, keep_old: Path | None) -> None:
    """`tmp` becomes `out`. Over an existing `out`: swapped in one step where the system can (a crash leaves
    the old copy or the new one at `out`, never neither), else the old one moved aside, the new one renamed
    in (and the old one put back if that fails); the old copy is deleted last, or renamed to `keep_old`."""
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()
    if not out.exists():
        try:
            os.rename(tmp, out)
        except OSError as e:
            raise exists_error from e
        return
    if not overwrite:  # appeared meanwhile
        raise exists_error
    if exchange(tmp, out):
        old = tmp  # which now holds the old copy
    else:
        old = keep_old or out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(out, old)
        try:
            os.rename(tmp, out)
        except OSError as e:
            os.rename(old, out)
            raise exists_error from e
    if keep_old is not None:
        if old != keep_old:
            os.rename(old, keep_old)
    else:
        shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink()


@contextlib.contextmanager
def staged_dir(
    out: Path, *, overwrite: bool, exists_error: PlaitError, stage: Path | None = None, keep_old: Path | None = None
) -> Iterator[Path]:
    """Yield an empty temporary sibling of `out` (0755); when the block ends without an error, its files are
    made readable by others (0644) and it becomes `out` by one rename. A non-empty `out` raises exists_error
    unless overwrite, in which case the two are swapped in one step (_publish) and the old copy deleted after;
    on any failure the temporary directory is removed and `out` is as it was. With `stage`, that directory is
    used (created if missing, its contents kept) and kept on a failure: work that resumes from what it holds.
    With `keep_old`, a replaced copy is kept under that name instead of deleted."""
    if is_nonempty(out) and not overwrite:
        raise exists_error
    out.parent.mkdir(parents=True, exist_ok=True)
    if stage is not None:
        stage.mkdir(exist_ok=True)
    tmp = stage or Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the published directory is an ordinary one
    try:
        yield tmp
        for written in tmp.rglob("*"):  # e.g. safetensors writes its file 0600: the result is for others to read
            os.chmod(written, 0o755 if written.is_dir() else 0o644)
        _publish(tmp, out, overwrite=overwrite, exists_error=exists_error, keep_old=keep_old)
    except BaseException:
        if stage is None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
