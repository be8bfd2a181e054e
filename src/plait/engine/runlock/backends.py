"""Where a run lock is kept (plait.engine.runlock): a file on a local or shared file system (created by link(2),
rewritten by rename), or a lease object on S3 (conditional PUTs on its ETag). Both offer the same operations:
create, read, replace (the holder's heartbeat), take over (a stale lock), remove, and a marker that tells a
displaced holder its lock was taken."""

from __future__ import annotations

import contextlib
import errno
import os
import time
import uuid
from pathlib import Path
from typing import Any

from plait.core import torch_private
from plait.core.storage import Location, RemotePath


class FileLock:
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


class S3Lease:
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


def is_lease(lock) -> bool:
    return isinstance(lock, S3Lease)


def backend(place: Location) -> FileLock | S3Lease:
    return S3Lease(place) if isinstance(place, RemotePath) else FileLock(Path(place))
