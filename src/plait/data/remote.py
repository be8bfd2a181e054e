"""A prepared corpus on S3 (`data.source=s3://bucket/prefix`), read in place by byte ranges.

Every rank keeps a small local copy of the corpus's description (manifest.json and tokenizer.json, under
data.cache_dir/remote/) whose manifest names where the shards are; TokenDataset then reads each sample's
tokens from S3 through a bounded cache of aligned blocks (data.remote_cache_mb, least recently used out
first). Reads run in the loader's prefetch thread, data.prefetch batches ahead of the step. A failed read is
retried with growing pauses (1, 2, 4, 4, ... s) and a warning each time, for up to READ_PATIENCE_S; then
the run stops with the object, the byte range and the error named. Access refused (wrong credentials) stops
at once. Credentials come from the environment as for checkpoints, and are never printed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np

from plait.core.errors import ConfigError, PlaitError
from plait.core.storage import RemotePath, file_sizes, location, read_bytes
from plait.data.format import FORMAT, MANIFEST

log = logging.getLogger("plait.data")

BLOCK_BYTES = 1 << 20  # one ranged GET: 1 MiB, aligned (a sample of 8,193 uint16 tokens is 16 KiB)
READ_PATIENCE_S = 120.0  # an object store that stays unreachable longer than this ends the run
MAX_PAUSE_S = 4.0  # a store back from an outage is read again within this


def is_remote_source(text: str) -> bool:
    return text.startswith("s3://")


def mirror(source: str, endpoint: str, cache_dir: str | Path) -> Path:
    """The local description of the corpus at `source` (s3://bucket/prefix): manifest.json, naming the
    shards' location, and tokenizer.json, in a directory of data.cache_dir. Refreshed on every call (two
    small reads), written whole (a temporary file renamed), so ranks and runs sharing the cache are safe."""
    root = location(source, endpoint)
    assert isinstance(root, RemotePath)
    try:
        raw = _read(lambda: read_bytes(root / MANIFEST), f"{root}/{MANIFEST}")
    except FileNotFoundError:
        raise ConfigError(
            f"data.source={source!r} has no {MANIFEST}: prepare the corpus (plait data prepare ... --out DIR) and "
            f"copy DIR there (e.g. aws s3 cp --recursive DIR {source})"
        ) from None
    manifest = json.loads(raw)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ConfigError(f"{root}/{MANIFEST} is not a {FORMAT} manifest: prepare the data again with this version")
    tokenizer = _read(lambda: read_bytes(root / manifest["tokenizer"]), f"{root}/{manifest['tokenizer']}")
    here = Path(cache_dir).expanduser() / "remote" / hashlib.sha256(root.url.encode()).hexdigest()[:16]
    here.mkdir(parents=True, exist_ok=True)
    manifest["remote"] = {"url": root.url, "endpoint": root.options.get("endpoint_url", "")}
    for name, data in ((manifest["tokenizer"], tokenizer), (MANIFEST, json.dumps(manifest, indent=2).encode())):
        tmp = here / f".{name}.{os.getpid()}.{threading.get_ident()}"
        tmp.write_bytes(data)
        tmp.replace(here / name)
    return here


def remote_shards(manifest: dict, files: list[tuple[str, int]], dtype: np.dtype, cache_mb: int) -> list[RemoteShard]:
    """The files (name, number of items) of a mirrored corpus on S3, each size checked against the manifest;
    one block cache of cache_mb MiB for them all."""
    where = manifest["remote"]
    root = location(where["url"], where.get("endpoint", ""))
    assert isinstance(root, RemotePath)
    sizes = _read(lambda: file_sizes(root), f"the listing of {root}")
    cache = BlockCache(max(1, cache_mb * (1 << 20) // BLOCK_BYTES))
    out = []
    for name, items in files:
        expected = items * dtype.itemsize
        if name not in sizes:
            raise ConfigError(f"shard {root}/{name} is missing: upload the prepared directory again")
        if sizes[name] != expected:
            raise ConfigError(
                f"shard {root}/{name} has {sizes[name]} bytes, manifest says {expected}: upload the prepared "
                "directory again"
            )
        out.append(RemoteShard(root / name, dtype, items, cache))
    return out


class BlockCache:
    """The most recently used blocks of remote objects, at most `blocks` of them (thread-safe)."""

    def __init__(self, blocks: int) -> None:
        self.blocks, self._lock = blocks, threading.Lock()
        self._data: OrderedDict[tuple[str, int], bytes] = OrderedDict()
        self.reads = 0  # ranged GETs made

    def get(self, loc: RemotePath, index: int, size: int) -> bytes:
        key = (loc.url, index)
        with self._lock:
            if key in self._data:
                self._data.move_to_end(key)
                return self._data[key]
        start = index * BLOCK_BYTES
        end = min(start + BLOCK_BYTES, size)
        path = loc.url.removeprefix("s3://")
        data = _read(lambda: loc.fs.cat_file(path, start=start, end=end), f"{loc} bytes {start}-{end}")
        if len(data) != end - start:
            raise PlaitError(f"{loc} bytes {start}-{end}: {len(data)} bytes came back; the object changed?")
        with self._lock:
            self.reads += 1
            self._data[key] = data
            while len(self._data) > self.blocks:
                self._data.popitem(last=False)
        return data


class RemoteShard:
    """A token shard on S3, sliced like the memory-mapped local one: shard[lo:hi] reads those tokens."""

    def __init__(self, loc: RemotePath, dtype: np.dtype, num_tokens: int, cache: BlockCache) -> None:
        self.loc, self.dtype, self.num_tokens, self.cache = loc, dtype, num_tokens, cache
        self.nbytes = num_tokens * dtype.itemsize

    def __len__(self) -> int:
        return self.num_tokens

    def __getitem__(self, index: slice) -> np.ndarray:
        lo, hi, _ = index.indices(self.num_tokens)
        if hi <= lo:
            return np.empty(0, dtype=self.dtype)
        start, end = lo * self.dtype.itemsize, hi * self.dtype.itemsize
        first, last = start // BLOCK_BYTES, (end - 1) // BLOCK_BYTES
        data = b"".join(self.cache.get(self.loc, i, self.nbytes) for i in range(first, last + 1))
        offset = start - first * BLOCK_BYTES
        return np.frombuffer(data, dtype=self.dtype, count=hi - lo, offset=offset)


def _read(fn, what: str):
    """fn(), retried on a transient error with growing pauses and a warning each time, for READ_PATIENCE_S;
    access refused or a missing object is raised at once."""
    started, pause = time.monotonic(), 1.0
    while True:
        try:
            return fn()
        except (FileNotFoundError, ConfigError, PlaitError):
            raise
        except PermissionError:
            raise ConfigError(
                f"S3 refused access to {what}: check the credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or "
                "the AWS profile; they are not printed) and the endpoint (checkpoint.s3_endpoint)"
            ) from None
        except Exception as e:
            waited = time.monotonic() - started
            reason = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            if waited + pause > READ_PATIENCE_S:
                raise PlaitError(f"reading {what} failed for {waited:.0f} s, giving up: {reason}") from None
            log.warning("reading %s failed (%s); retrying in %.0f s", what, reason, pause)
            time.sleep(pause)
            pause = min(2 * pause, MAX_PAUSE_S)
