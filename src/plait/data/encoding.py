"""Documents to token shards: each document encoded and followed by EOS (in worker processes, in the
documents' order whatever their number), held out to val or kept for train by a hash of its number and
text, and appended to shard files of at most `shard_tokens` tokens that are hashed as they are written.
plait.data.prepare drives it (a new corpus, a resumed one, documents appended)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

_ENCODE_CHUNK_CHARS = 4 << 20  # encode_batch parallelises within a chunk; chunks bound memory
_ENCODE_CHUNK_DOCS = 1024
_HASH_CHUNK = 1 << 20


def is_held_out(index: int, text: str, val_fraction: float) -> bool:
    """Deterministic split: sha1 of (index, content) read as a fraction in [0, 1)."""
    digest = hashlib.sha1(f"{index}\0".encode() + text.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < val_fraction


class ShardWriter:
    """Appends tokens to `{split}_{i:05d}.bin` files of at most `shard_tokens` tokens, hashing as it goes."""

    def __init__(self, out_dir: Path, split: str, dtype: np.dtype, shard_tokens: int, first: int = 0) -> None:
        self.out_dir, self.split, self.dtype, self.shard_tokens = out_dir, split, dtype, shard_tokens
        self.first = first  # the number of the first shard file (after those a prepare being appended to has)
        self.shards: list[dict[str, Any]] = []
        self.num_documents = 0
        self._file: Any = None
        self._hash: Any = None
        self._count = 0

    def write_document(self, ids: np.ndarray) -> None:
        self.num_documents += 1
        while len(ids):
            if self._file is None:
                name = f"{self.split}_{self.first + len(self.shards):05d}.bin"
                self._file, self._hash, self._count = open(self.out_dir / name, "wb"), hashlib.sha256(), 0  # noqa: SIM115
                self.shards.append({"file": name})
            take = min(len(ids), self.shard_tokens - self._count)
            data = ids[:take].tobytes()
            self._file.write(data)
            self._hash.update(data)
            self._count += take
            ids = ids[take:]
            if self._count == self.shard_tokens:
                self._finish_shard()

    def state(self) -> dict[str, Any]:
        """What a resumed prepare restores (restore): the shards, the open one's tokens so far (flushed)."""
        if self._file is not None:
            self._file.flush()
        count = self._count if self._file is not None else None
        return {"shards": [dict(s) for s in self.shards], "open_tokens": count, "num_documents": self.num_documents}

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from `state`: the open shard cut back to what it held then, later shard files removed."""
        self.shards, self.num_documents = [dict(s) for s in state["shards"]], state["num_documents"]
        n = len(self.shards)
        for later in self.out_dir.glob(f"{self.split}_*.bin"):
            if int(later.stem.rsplit("_", 1)[1]) >= self.first + n:
                later.unlink()
        if state["open_tokens"] is not None:
            path = self.out_dir / self.shards[-1]["file"]
            self._file = open(path, "r+b")  # noqa: SIM115 - kept open for the writes that follow
            self._file.truncate(state["open_tokens"] * self.dtype.itemsize)
            self._file.seek(0, os.SEEK_END)
            self._hash, self._count = hashlib.sha256(path.read_bytes()), state["open_tokens"]

    def _finish_shard(self) -> None:
        self._file.close()
        self.shards[-1].update(num_tokens=self._count, sha256=self._hash.hexdigest())
        self._file = None

    def close(self) -> dict[str, Any]:
        if self._file is not None:
            self._finish_shard()
        num_tokens = sum(s["num_tokens"] for s in self.shards)
        return {"shards": self.shards, "num_tokens": num_tokens, "num_documents": self.num_documents}


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_HASH_CHUNK):
            h.update(block)
    return h.hexdigest()


def _chunks(docs: Iterator[str]) -> Iterator[list[str]]:
    chunk: list[str] = []
    chars = 0
    for text in docs:
        chunk.append(text)
        chars += len(text)
        if chars >= _ENCODE_CHUNK_CHARS or len(chunk) >= _ENCODE_CHUNK_DOCS:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


def _encode_chunk(tok: Tokenizer, eos: int, dtype: np.dtype, start: int, chunk: list[str], val_fraction: float):
    """One chunk of documents from document number `start`: (their ids, each followed by EOS, concatenated;
    each one's length; whether each is held out)."""
    # add_special_tokens=False: pretrained post-processors (e.g. BOS) must not differ from EOS packing.
    encoded = tok.encode_batch_fast(chunk, add_special_tokens=False)
    lengths = np.array([len(e.ids) + 1 for e in encoded], dtype=np.int64)
    ids = np.empty(int(lengths.sum()), dtype=dtype)
    at = 0
    for e, n in zip(encoded, lengths, strict=True):
        ids[at : at + n - 1] = e.ids
        ids[at + n - 1] = eos
        at += n
    held = [is_held_out(start + i, text, val_fraction) for i, text in enumerate(chunk)]
    return ids, lengths, held


_WORKER: dict[str, Any] = {}


def _worker_init(tokenizer_path: str, eos: int, dtype: str, val_fraction: float) -> None:
    _WORKER.update(tok=Tokenizer.from_file(tokenizer_path), eos=eos, dtype=np.dtype(dtype), val=val_fraction)


def _worker_encode(job: tuple[int, list[str]]):
    w = _WORKER
    return _encode_chunk(w["tok"], w["eos"], w["dtype"], job[0], job[1], w["val"])


def _encoded_chunks(docs, tok, eos, dtype, val_fraction, workers: int, tokenizer_path: Path | None, first: int = 0):
    """The chunks of `docs` (numbered from `first`) encoded, in order: here, or by `workers` processes with at
    most 2 chunks each in flight (reading never runs far ahead of the writing)."""
    jobs = ((start, chunk) for start, chunk in _numbered(_chunks(docs), first))
    if workers <= 1:
        for start, chunk in jobs:
            yield _encode_chunk(tok, eos, dtype, start, chunk, val_fraction)
        return
    import multiprocessing
    from collections import deque

    ctx = multiprocessing.get_context("spawn")  # the tokenizer's thread pool does not survive a fork
    args = (str(tokenizer_path), eos, dtype.str, val_fraction)
    with ctx.Pool(workers, initializer=_worker_init, initargs=args) as pool:
        pending: deque = deque()
        for job in jobs:
            pending.append(pool.apply_async(_worker_encode, (job,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def _numbered(chunks: Iterator[list[str]], start: int = 0) -> Iterator[tuple[int, list[str]]]:
    for chunk in chunks:
        yield start, chunk
        start += len(chunk)


def tokenize_splits(
    docs: Iterator[str],
    tok: Tokenizer,
    eos: int,
    dtype: np.dtype,
    writers: dict[str, ShardWriter],
    val_fraction: float,
    workers: int = 1,
    tokenizer_path: Path | None = None,
    on_tokens: Callable[[int], None] = lambda n: None,
    first_index: int = 0,
    on_chunk: Callable[[int], None] = lambda written: None,
) -> None:
    """Encode documents (in `workers` processes), append EOS, and route each to train or val, in the
    documents' order whatever the number of workers.

    The last document is held back so that, if nothing landed in val (small corpora), it can go there.
    """
    pending: tuple[str, np.ndarray] | None = None
    index = 0
    assert workers <= 1 or tokenizer_path is not None
    chunks = _encoded_chunks(docs, tok, eos, dtype, val_fraction, workers, tokenizer_path, first_index)
    for ids, lengths, held in chunks:
        at = 0
        for n, val in zip(lengths, held, strict=True):
            if pending is not None:
                writers[pending[0]].write_document(pending[1])
            pending = ("val" if val else "train", ids[at : at + n])
            at += n
            index += 1
        on_tokens(len(ids))
        on_chunk(first_index + index - 1)  # documents written (the last one is held back)
    if pending is None:
        return
    split, ids = pending
    if val_fraction > 0 and index >= 2 and writers["val"].num_documents == 0:
        split = "val"
    elif writers["train"].num_documents == 0:
        split = "train"
    writers[split].write_document(ids)
