"""Where checkpoints live: a local directory or an S3 prefix, and DCP's readers and writers for both.

A location is a ``pathlib.Path`` (local) or a ``RemotePath`` (``s3://bucket/prefix`` through fsspec/s3fs).
The two differ in one way that matters: S3 has no rename. A checkpoint is therefore published on a local disk
by renaming ``step_N.tmp`` to ``step_N`` and on S3 by writing ``plait.json`` last; in both cases a checkpoint
without ``plait.json`` is not one (see ``plait.engine.checkpoint``).

S3 credentials come from the usual AWS chain (``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` /
``AWS_SESSION_TOKEN``, ``AWS_PROFILE``, instance roles); the endpoint from ``checkpoint.s3_endpoint`` or
``AWS_ENDPOINT_URL``. Nothing here prints or stores a credential.

Safety on load: DCP (torch 2.13) reads its ``.metadata`` file with a plain ``pickle.load`` and non-tensor
records with ``torch.load(weights_only=False)``; either runs arbitrary code from a crafted checkpoint. Our
reader replaces the first with an unpickler that builds only DCP's own metadata classes, and
``plait.engine.checkpoint`` refuses non-tensor records before reading. Every tensor record is written with a
trailing length + CRC32 (a DCP stream extension), so a flipped or cut byte fails the load instead of
loading silently. Both (the checksums, the restricted unpickler) live in ``plait.core.dcp_integrity``.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from plait.core import torch_private
from plait.core.dcp_integrity import DCP_METADATA as DCP_METADATA  # (importable from here, as it always was)
from plait.core.dcp_integrity import RecordChecksum, parse_metadata
from plait.core.errors import PlaitError

META_FILE = "plait.json"

# Retries of one checkpoint write (each rank's shard file, DCP's metadata, plait.json): a flaky or briefly
# unreachable object store should cost a few seconds, not the checkpoint. Delays 1 s, 2 s between attempts.
WRITE_ATTEMPTS = 3
RETRY_BACKOFF_S = 1.0

T = TypeVar("T")


class RemotePath:
    """An ``s3://`` location together with the filesystem options (endpoint) that reach it. Supports the
    part of ``pathlib.Path`` checkpoint code uses: ``/``, ``name``, ``parent``, ``str()``."""

    def __init__(self, url: str, options: dict[str, Any] | None = None):
        self.url = url.rstrip("/")
        self.options = options or {}

    @property
    def fs(self):
        return _s3_filesystem(tuple(sorted(self.options.items())))

    @property
    def name(self) -> str:
        return self.url.rsplit("/", 1)[-1]

    @property
    def parent(self) -> RemotePath:
        return RemotePath(self.url.rsplit("/", 1)[0], self.options)

    def __truediv__(self, name: str) -> RemotePath:
        return RemotePath(f"{self.url}/{name}", self.options)

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"RemotePath({self.url!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RemotePath) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)


Location = Path | RemotePath


def location(path: str | os.PathLike, endpoint: str = "") -> Location:
    """A local path, or an ``s3://bucket/prefix`` URL (with an optional endpoint URL, e.g. a MinIO server)."""
    text = os.fspath(path)
    if text.startswith("s3://"):
        if len(text) <= len("s3://") or text[len("s3://") :].startswith("/"):
            raise PlaitError(f"{text!r} is not an S3 location; write s3://bucket/prefix")
        endpoint = endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL", "")
        return RemotePath(text, {"endpoint_url": endpoint} if endpoint else {})
    if "://" in text:
        raise PlaitError(f"{text!r}: only local directories and s3://bucket/prefix are supported")
    return Path(text).expanduser()


def is_remote(loc: Location) -> bool:
    return isinstance(loc, RemotePath)


_FILESYSTEMS: dict[tuple, Any] = {}


def _s3_filesystem(options: tuple):
    """One s3fs filesystem per set of options (it holds a connection pool and an event loop thread)."""
    if options not in _FILESYSTEMS:
        try:
            import s3fs
        except ImportError:
            raise PlaitError("s3:// checkpoints need the s3fs package: pip install s3fs") from None
        fs = s3fs.S3FileSystem(
            **dict(options),
            use_listings_cache=False,  # other ranks and other runs write here: never trust a cached listing
            skip_instance_cache=True,
            # Fail fast and let retry() below pace the attempts: botocore's and s3fs's own retries would
            # otherwise multiply into minutes against a dead endpoint.
            config_kwargs={"connect_timeout": 5, "read_timeout": 60, "retries": {"max_attempts": 2}},
        )
        fs.retries = 2
        _FILESYSTEMS[options] = fs
    return _FILESYSTEMS[options]


def remote_key(loc: RemotePath) -> str:
    """The bucket/key path of an s3:// location, as the filesystem names it."""
    return loc.url.removeprefix("s3://")


_key = remote_key


# ------------------------------------------------------------------------------------------- file operations


def exists(loc: Location) -> bool:
    return loc.fs.exists(_key(loc)) if isinstance(loc, RemotePath) else loc.exists()


def read_bytes(loc: Location) -> bytes:
    return loc.fs.cat_file(_key(loc)) if isinstance(loc, RemotePath) else loc.read_bytes()


def write_bytes(loc: Location, data: bytes) -> None:
    """Whole or not at all: one PUT on S3; a temporary file, fsync and rename on a local disk."""
    if isinstance(loc, RemotePath):
        loc.fs.pipe_file(_key(loc), data)
        return
    tmp = loc.with_name(loc.name + ".part")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(loc)


def copy_in(src: Path, loc: Location) -> None:
    """Copy a local file to a location."""
    if isinstance(loc, RemotePath):
        loc.fs.put_file(str(src), _key(loc))
    else:
        shutil.copyfile(src, loc)


def makedirs(loc: Location) -> None:
    if isinstance(loc, Path):  # S3 has no directories: a key's prefix exists once a key is written
        loc.mkdir(parents=True, exist_ok=True)


def rename(src: Location, dst: Location) -> None:
    """Move a directory. Locally one rename, made durable before returning. S3 has no rename: each object is
    copied on the server, then the source removed (remove_tree: plait.json first); interrupted, both remain,
    so nothing is lost."""
    if isinstance(src, RemotePath) or isinstance(dst, RemotePath):
        if not (isinstance(src, RemotePath) and isinstance(dst, RemotePath)):
            raise ValueError(f"rename from {src} to {dst}: both must be on the same store")
        base = _key(src).rstrip("/") + "/"
        for key in src.fs.find(_key(src)):  # each object to its own key (a copy into an "existing directory"
            src.fs.copy(key, _key(dst).rstrip("/") + "/" + key.removeprefix(base))  # would nest below it)
        remove_tree(src)
        return
    src.rename(dst)
    fd = os.open(dst.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_tree(loc: Location) -> None:
    """Delete a checkpoint directory, ``plait.json`` first: if this is interrupted, what is left is no longer
    a checkpoint (rather than a checkpoint with missing shards)."""
    if isinstance(loc, RemotePath):
        fs, meta = loc.fs, loc / META_FILE
        if fs.exists(_key(meta)):
            fs.rm_file(_key(meta))
        if fs.exists(_key(loc)):
            fs.rm(_key(loc), recursive=True)
        return
    if (loc / META_FILE).is_file():
        (loc / META_FILE).unlink()
    shutil.rmtree(loc, ignore_errors=True)


def list_tree(root: Location) -> dict[str, set[str]]:
    """Names of the files in each direct sub-directory of root: ``{"step_00000010": {"plait.json", ...}}``.
    One recursive listing on S3 (no per-directory requests)."""
    out: dict[str, set[str]] = {}
    if isinstance(root, RemotePath):
        base = _key(root).rstrip("/") + "/"
        for key in root.fs.find(_key(root)):
            parts = key.removeprefix(base).split("/")
            if len(parts) == 2:
                out.setdefault(parts[0], set()).add(parts[1])
        return out
    if not root.is_dir():
        return out
    for sub in root.iterdir():
        if sub.is_dir():
            out[sub.name] = {p.name for p in sub.iterdir()}
    return out


def file_sizes(loc: Location) -> dict[str, int]:
    """Size of each file directly in a directory."""
    if isinstance(loc, RemotePath):
        entries = loc.fs.ls(_key(loc), detail=True)
        return {e["name"].rsplit("/", 1)[-1]: int(e["size"]) for e in entries if e.get("type") == "file"}
    return {p.name: p.stat().st_size for p in loc.iterdir() if p.is_file()}


FAILED_ATTEMPTS = [0]
"""Storage operations that failed (and were retried or given up) in this process: the checkpointer reads it
to tell a save that is slow because storage is failing from one that is merely long."""


def retry(fn: Callable[[], T], what: str, attempts: int = WRITE_ATTEMPTS) -> T:
    """Call fn; on an error wait (1 s, 2 s, ...) and try again, at most `attempts` times in all."""
    for attempt in range(attempts):
        try:
            return fn()
        except (PlaitError, KeyboardInterrupt):
            raise
        except Exception:
            FAILED_ATTEMPTS[0] += 1
            if attempt == attempts - 1:
                raise
            time.sleep(RETRY_BACKOFF_S * 2**attempt)
    raise AssertionError(f"unreachable: {what}")


class _SafeReading(torch_private.LabelledRecords):
    """Mixed into DCP's readers: metadata through the restricted unpickler (and only the global metadata
    file: no fall-back to per-rank files), record locations attached for checksum messages (LabelledRecords)."""

    fs: Any  # DCP's reader's (this class is mixed into one)
    load_id: Any

    def read_metadata(self) -> Metadata:
        with self.fs.create_stream(torch_private.dcp_metadata_path(self), "rb") as f:
            md = parse_metadata(f.read())
        storage_meta = getattr(md, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id
        md.storage_meta = storage_meta
        return md


if TYPE_CHECKING:  # the writer mixin below is mixed into DCP's writers: checked as one
    _WriterBase = FileSystemWriter
else:
    _WriterBase = object


class _LocalReader(_SafeReading, FileSystemReader):
    pass


class _RetryingWrites(_WriterBase):
    """Mixed into DCP's writers: each step that touches storage is retried with backoff (all ranks retry
    their own files independently; DCP's collectives only see the final outcome). The coordinator first
    clears the target directory (dcp_writer's before_write)."""

    plait_before_write: Callable[[], object]  # set on each writer by dcp_writer

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        self._coordinator = is_coordinator
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)

    def prepare_local_plan(self, plan):
        if self._coordinator:
            # Other ranks write only after the plan is agreed, which waits for this rank: no race.
            retry(self.plait_before_write, "clean")
        return retry(lambda: super(_RetryingWrites, self).prepare_local_plan(plan), "prepare")

    def write_data(self, plan, planner):
        return retry(lambda: super(_RetryingWrites, self).write_data(plan, planner), "write")

    plait_bytes = 0
    """Bytes of the records written (counted by the coordinator, which finishes the checkpoint)."""

    def finish(self, metadata, results) -> None:
        self.plait_bytes = sum(getattr(r.storage_data, "length", 0) for rank in results for r in rank)
        return retry(lambda: super(_RetryingWrites, self).finish(metadata, results), "finish")


class _LocalWriter(_RetryingWrites, FileSystemWriter):
    pass


def dcp_writer(loc: Location, *, single_file_per_rank: bool = True, before_write: Callable[[], None] | None = None):
    """A DCP StorageWriter for one checkpoint directory: one file per rank, record checksums, retries.

    ``before_write`` runs on the coordinator, in the save (asynchronous ones: off the training loop), before
    any rank writes; by default it removes whatever an earlier, failed save left in the directory.

    ``single_file_per_rank=False`` writes one file per tensor instead: DCP's writer keeps every tensor of a
    file referenced until that file is done, so a save whose tensors are made one at a time (see
    ``plait.interop.streaming``) holds two at most (the one written, the one before), not all, only this
    way. Readers take either layout."""
    if isinstance(loc, RemotePath):

        class _S3Writer(_RetryingWrites, torch_private.fsspec_storage()[0]):  # type: ignore[misc]  # DCP's
            pass

        # No fsync on S3 (an upload is durable once it completes; DCP would os.sync() the local machine).
        writer = torch_private.dcp_storage_writer(
            _S3Writer,
            loc.url,
            [RecordChecksum()],
            sync_files=False,
            overwrite=True,
            single_file_per_rank=single_file_per_rank,
        )
        writer.fs.fs = loc.fs
    else:
        writer = torch_private.dcp_storage_writer(
            _LocalWriter,
            loc,
            [RecordChecksum()],
            sync_files=True,
            overwrite=True,
            single_file_per_rank=single_file_per_rank,
        )
    writer.plait_before_write = before_write or (lambda: remove_tree(loc))
    return writer


def dcp_reader(loc: Location):
    """A DCP StorageReader that never unpickles and checks record checksums."""
    if isinstance(loc, RemotePath):

        class _S3Reader(_SafeReading, torch_private.fsspec_storage()[1]):  # type: ignore[misc]  # DCP's
            pass

        reader = torch_private.dcp_storage_reader(_S3Reader, loc.url, [RecordChecksum])
        reader.fs.fs = loc.fs
        return reader
    return torch_private.dcp_storage_reader(_LocalReader, loc, [RecordChecksum])
