"""A retrieval database beside a prepared corpus (`plait data retrieve`): RETRO's chunks, their neighbours.

Each split's token stream is cut into chunks of `chunk` tokens (64 by default). The database is the train
split's chunks that have a continuation (the chunk after them): a neighbour is a chunk and its continuation,
2 x chunk tokens, as in RETRO. Every chunk gets a frozen embedding (an encoder of the caller's: a callable from
(n, chunk) token ids to (n, d) vectors); the database's embeddings, L2-normalised, go into a faiss index
(exact inner product: cosine similarity), and for every chunk of both splits its k nearest database chunks are
found and stored. A neighbour that shares a document with the query chunk or with the chunk after it (its chunk
or its continuation touches one of the documents those two touch) is excluded: it would leak the text the model
must predict, which is the next chunk's (with short documents, another document than the query's).
Validation chunks are never in the database, so the held-out split's documents are never retrieved.

Layout, beside the token shards: `retrieval/manifest.json` (chunk, k, encoder, the corpus it was built from:
its tokenizer's and shards' hashes, the index and the exclusion rule), `retrieval/index.faiss`,
`retrieval/{split}_neighbours.npy` (int32, (chunks, k): database chunk numbers; the tokens are read from the
train stream) and `retrieval/{split}_embeddings.npy`. Plain arrays (numpy's format, read without pickle) and
faiss's own index file. The build works in `retrieval.partial/` with a journal after every batch, so an
interrupted build continues where it stopped when the same command runs again; the directory is renamed into
place at the end.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from plait.core.errors import ConfigError
from plait.data.loader import TokenDataset, read_manifest

RETRIEVAL_DIR = "retrieval"
FORMAT = "plait-retrieval-v1"
JOURNAL = "progress.json"
SEARCH_BLOCK = 4096  # query chunks per faiss search

Encoder = Callable[[np.ndarray], np.ndarray]  # (n, chunk) token ids -> (n, d) embeddings


@dataclass
class Chunks:
    """A split cut into chunks: the tokens (chunks, chunk) and the first and last document of each."""

    tokens: np.ndarray
    first_doc: np.ndarray
    last_doc: np.ndarray


def chunk_split(data_dir: Path, split: str, chunk: int) -> Chunks:
    """The whole chunks of a split's stream, each with the documents it touches (a document ends with, and
    includes, its EOS token)."""
    data = TokenDataset(data_dir, split)
    n = data.num_tokens // chunk
    stream = data.tokens(0, n * chunk)
    ends = stream == data.eos_id
    docs = np.cumsum(ends) - ends  # each token's document
    docs = docs.reshape(n, chunk) if n else docs.reshape(0, chunk)
    return Chunks(stream.reshape(n, chunk), docs[:, 0].copy(), docs[:, -1].copy())


def corpus_digest(manifest: dict[str, Any]) -> str:
    """What a database was built from: the tokenizer's and every shard's hashes."""
    parts = [manifest.get("tokenizer_sha256", "")]
    for split in sorted(manifest["splits"]):
        parts += [s.get("sha256", "") for s in manifest["splits"][split]["shards"]]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def build_database(
    data_dir: str | Path,
    encode: Encoder,
    *,
    encoder: dict[str, Any],
    chunk: int = 64,
    k: int = 2,
    batch: int = 64,
    overwrite: bool = False,
    progress: Callable[[str, int, int], None] = lambda stage, done, total: None,
) -> dict[str, Any]:
    """Build (or continue building) the retrieval database of a prepared directory; returns its manifest.
    `encoder` describes the encoder (recorded); progress(stage, done, total) after every batch."""
    try:
        import faiss
    except ImportError:
        raise ConfigError("plait data retrieve needs faiss: pip install 'plait[retrieval]'") from None
    data_dir = Path(data_dir)
    corpus = read_manifest(data_dir)
    out, stage = data_dir / RETRIEVAL_DIR, data_dir / f"{RETRIEVAL_DIR}.partial"
    if out.exists() and not overwrite:
        raise ConfigError(f"{out} exists; pass --overwrite to build it again")
    if chunk < 1 or k < 1:
        raise ConfigError(f"--chunk={chunk} and --k={k} must be positive, e.g. --chunk 64 --k 2")
    splits = {split: chunk_split(data_dir, split, chunk) for split in ("train", "val")}
    stored = len(splits["train"].tokens) - 1  # the last train chunk has no continuation
    if k > stored - 1:
        raise ConfigError(
            f"--k={k} neighbours but the database holds {max(stored, 0)} chunks of {chunk} tokens: at most "
            f"{max(stored - 1, 0)} (or a smaller --chunk)"
        )
    settings = dict(chunk=chunk, k=k, corpus=corpus_digest(corpus), encoder=encoder)
    journal = _Journal.open(stage, settings)
    embeddings = {
        split: _embed(journal, f"{split}_embeddings", chunks.tokens, encode, batch, f"embedding {split}", progress)
        for split, chunks in splits.items()
    }
    train = splits["train"]
    index = faiss.IndexFlatIP(embeddings["train"].shape[1])
    index.add(np.ascontiguousarray(embeddings["train"][:stored]))
    # a neighbour (chunk j and its continuation j + 1) spans documents first_doc[j] .. last_doc[j + 1]
    span_first, span_last = train.first_doc[:stored], train.last_doc[1 : stored + 1]
    for split, chunks in splits.items():
        # a train chunk's neighbours serve the tokens of the chunk after it, so both chunks' documents are its
        # own (the next chunk may open another document); validation chunks: none in the database
        own = (chunks.first_doc, _answers_last_doc(chunks.last_doc)) if split == "train" else None

        def search(rows: slice, own=own, split=split) -> np.ndarray:
            query = np.ascontiguousarray(embeddings[split][rows])
            mine = (own[0][rows], own[1][rows]) if own is not None else None
            return _search(index, query, k, mine, span_first, span_last, stored)

        _in_blocks(journal, f"{split}_neighbours", len(chunks.tokens), k, search, f"neighbours of {split}", progress)
    faiss.write_index(index, str(stage / "index.faiss"))
    manifest = {
        "format": FORMAT,
        **settings,
        "corpus_tokenizer_sha256": corpus.get("tokenizer_sha256", ""),
        "chunks": {split: len(c.tokens) for split, c in splits.items()},
        "database_chunks": stored,
        "index": {"type": "faiss.IndexFlatIP", "metric": "cosine (L2-normalised embeddings)", "exact": True},
        "neighbour_tokens": 2 * chunk,
        "excluded": "database chunks whose chunk or continuation shares a document with the query chunk or the "
        "chunk after it",
    }
    (stage / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    journal.close()
    if out.exists():
        shutil.rmtree(out)
    stage.rename(out)
    return manifest


def _answers_last_doc(last_doc: np.ndarray) -> np.ndarray:
    """Each chunk's last document or, when there is a next chunk (the text its neighbours help predict), that
    chunk's last document."""
    return np.concatenate([last_doc[1:], last_doc[-1:]]) if len(last_doc) else last_doc


def _search(index, query, k: int, own, span_first, span_last, stored: int) -> np.ndarray:
    """The k nearest database chunks of each query row, those sharing a document with it left out (own: the
    query chunks' first and last documents, or None for validation queries)."""
    want = k if own is None else min(stored, 4 * k + 8)
    while True:
        _, found = index.search(query, want)
        if own is None:
            return found[:, :k].astype(np.int32)
        first, last = own
        safe = found >= 0
        clipped = np.where(safe, found, 0)
        overlaps = (span_first[clipped] <= last[:, None]) & (span_last[clipped] >= first[:, None])
        keep = safe & ~overlaps
        if (keep.sum(1) >= k).all() or want >= stored:
            if (keep.sum(1) < k).any():
                raise ConfigError(
                    f"some chunks have fewer than k={k} neighbours outside their own document: use a smaller --k"
                )
            order = np.argsort(~keep, axis=1, kind="stable")[:, :k]  # the first k kept, nearest first
            return np.take_along_axis(found, order, axis=1).astype(np.int32)
        want = min(stored, want * 4)


class _Journal:
    """A build's progress in its stage directory: the rows finished of each array, saved after every batch."""

    def __init__(self, stage: Path, state: dict[str, Any]) -> None:
        self.stage, self.state = stage, state

    @classmethod
    def open(cls, stage: Path, settings: dict[str, Any]) -> _Journal:
        """The interrupted build of the same settings, or a fresh one (another's work is discarded)."""
        state = _journal(stage)
        if state is not None and state["settings"] != settings:
            shutil.rmtree(stage)
            state = None
        stage.mkdir(exist_ok=True)
        return cls(stage, state or {"settings": settings, "done": {}})

    def done(self, key: str) -> int:
        return self.state["done"].get(key, 0)

    def finished(self, key: str, rows: int) -> None:
        self.state["done"][key] = rows
        tmp = self.stage / f".{JOURNAL}.tmp"
        tmp.write_text(json.dumps(self.state))
        tmp.replace(self.stage / JOURNAL)

    def close(self) -> None:
        (self.stage / JOURNAL).unlink()


def _embed(journal: _Journal, key: str, tokens: np.ndarray, encode: Encoder, batch: int, what: str, progress):
    """The L2-normalised embeddings of every chunk (rows already done kept), read back memory-mapped."""
    total, done = len(tokens), journal.done(key)
    arr = None
    for start in range(done, total, batch):
        vectors = np.asarray(encode(tokens[start : start + batch]), dtype=np.float32)
        if arr is None:
            arr = _array(journal.stage / f"{key}.npy", (total, vectors.shape[1]), np.float32, fresh=done == 0)
        arr[start : start + len(vectors)] = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        arr.flush()
        journal.finished(key, start + len(vectors))
        progress(what, start + len(vectors), total)
    return np.load(journal.stage / f"{key}.npy", mmap_mode="r")


def _in_blocks(journal: _Journal, key: str, total: int, k: int, search, what: str, progress) -> None:
    """The (total, k) neighbours array filled block by block by search(rows) (rows already done kept)."""
    done = journal.done(key)
    out = _array(journal.stage / f"{key}.npy", (total, k), np.int32, fresh=done == 0)
    for start in range(done, total, SEARCH_BLOCK):
        stop = min(start + SEARCH_BLOCK, total)
        out[start:stop] = search(slice(start, stop))
        out.flush()
        journal.finished(key, stop)
        progress(what, stop, total)


def _array(path: Path, shape: tuple[int, ...], dtype, fresh: bool) -> np.ndarray:
    if fresh or not path.exists():
        return np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape)
    return np.load(path, mmap_mode="r+")


def _journal(stage: Path) -> dict[str, Any] | None:
    try:
        return json.loads((stage / JOURNAL).read_text())
    except (OSError, ValueError):
        return None


def read_database(data_dir: str | Path) -> dict[str, Any]:
    """A prepared directory's retrieval manifest, checked against the corpus it sits beside."""
    data_dir = Path(data_dir)
    path = data_dir / RETRIEVAL_DIR / "manifest.json"
    if not path.is_file():
        raise ConfigError(f"{data_dir} has no retrieval database: build it with plait data retrieve {data_dir} ...")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise ConfigError(f"{path} is not a {FORMAT} manifest: build the database again")
    if manifest["corpus"] != corpus_digest(read_manifest(data_dir)):
        raise ConfigError(
            f"the retrieval database of {data_dir} was built from other data or another tokenizer: build it again"
        )
    return manifest


def database_for(data_dir: str | Path, chunk: int, k: int) -> dict[str, Any]:
    """The database's manifest, refused when a model of `chunk`-token chunks and k neighbours cannot read it."""
    db = read_database(data_dir)
    if db["chunk"] != chunk:
        raise ConfigError(
            f"model.retrieval_chunk={chunk} but the retrieval database of {data_dir} has chunks of {db['chunk']} "
            f"tokens: set model.retrieval_chunk={db['chunk']}, or build the database again with --chunk {chunk}"
        )
    if k > db["k"]:
        raise ConfigError(
            f"model.retrieval_k={k} but the retrieval database of {data_dir} holds {db['k']} neighbours per chunk: "
            f"set model.retrieval_k <= {db['k']}, or build it again with --k {k}"
        )
    return db


def database_record(data_dir: str | Path) -> dict[str, Any]:
    """What a retrieval model trained with, for its lineage and beside its exports: the database's place, the
    hash of its manifest, and the manifest's chunk, k, corpus digest, encoder and index (present: False when
    the directory holds no readable database)."""
    path = Path(data_dir) / RETRIEVAL_DIR / "manifest.json"
    try:
        text = path.read_text()
        manifest = json.loads(text)
    except (OSError, ValueError):
        return {"dir": str(Path(data_dir).resolve()), "present": False}
    keep = ("format", "chunk", "k", "corpus", "encoder", "index", "database_chunks", "excluded")
    return {
        "dir": str((Path(data_dir) / RETRIEVAL_DIR).resolve()),
        "present": True,
        "manifest_sha256": hashlib.sha256(text.encode()).hexdigest(),
        **{key: manifest.get(key) for key in keep},
    }


class Retriever:
    """Neighbours of new chunks (text being generated) from a prepared directory's database: each chunk
    embedded by `encode` (the database's own encoder), normalised as the database's, its k nearest database
    chunks found in the index, and each read with its continuation from the train stream (2 chunk tokens).
    `retriever(chunks (n, chunk))` -> (database chunk numbers (n, k), their tokens (n, k, 2 chunk))."""

    def __init__(self, data_dir: str | Path, encode: Encoder, *, chunk: int, k: int) -> None:
        try:
            import faiss
        except ImportError:
            raise ConfigError("retrieval needs faiss: pip install 'plait[retrieval]'") from None
        database_for(data_dir, chunk, k)
        self.index = faiss.read_index(str(Path(data_dir) / RETRIEVAL_DIR / "index.faiss"))
        self.store, self.encode, self.chunk, self.k = TokenDataset(data_dir, "train"), encode, chunk, k

    def __call__(self, chunks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        vectors = np.asarray(self.encode(np.asarray(chunks, dtype=np.int64)), dtype=np.float32)
        vectors /= np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        _, found = self.index.search(np.ascontiguousarray(vectors), self.k)
        c = self.chunk
        tokens = [self.store.tokens(int(j) * c, (int(j) + 2) * c) for j in found.reshape(-1)]
        return found.astype(np.int32), np.stack(tokens).reshape(len(found), self.k, 2 * c)


def neighbours(data_dir: str | Path, split: str) -> np.ndarray:
    """(chunks, k) database chunk numbers of each chunk of a split (read-only, memory-mapped, no pickle)."""
    return np.load(Path(data_dir) / RETRIEVAL_DIR / f"{split}_neighbours.npy", mmap_mode="r", allow_pickle=False)


class RetrievalDataset(TokenDataset):
    """A split whose windows come with their chunks' neighbours (a RETRO model's input, plait.model.retrieval):
    windows start on chunk boundaries (every seq_len + chunk tokens: the chunk - 1 tokens after each window's
    last target are skipped), and `neighbour_tokens` gives each of the window's seq_len / chunk chunks its k
    neighbours, each a database chunk and its continuation (2 chunk tokens of the train stream). The loader
    appends them to the window's inputs; its sample order, resumption and data-parallel split are the token
    loader's own."""

    def __init__(self, data_dir: str | Path, split: str, *, chunk: int, k: int, remote_cache_mb: int = 256) -> None:
        super().__init__(data_dir, split, remote_cache_mb)
        database_for(data_dir, chunk, k)
        self.chunk, self.k = chunk, k
        self.neighbours = neighbours(data_dir, split)[:, :k]
        self.store = self if split == "train" else TokenDataset(data_dir, "train", remote_cache_mb)

    def stride(self, seq_len: int) -> int:
        return seq_len + self.chunk

    def check_seq_len(self, seq_len: int) -> None:
        super().check_seq_len(seq_len)
        if seq_len % self.chunk:
            raise ConfigError(
                f"data.seq_len={seq_len} is not a multiple of model.retrieval_chunk={self.chunk}: a sequence is "
                f"retrieved for chunk by chunk; e.g. data.seq_len={max(self.chunk, seq_len // self.chunk * self.chunk)}"
            )

    def neighbour_tokens(self, i: int, seq_len: int) -> np.ndarray:
        """(seq_len / chunk x k x 2 chunk,) token ids: the neighbours of window i's chunks, in order."""
        c = self.chunk
        first = i * self.stride(seq_len) // c
        ids = self.neighbours[first : first + seq_len // c]  # (chunks, k) database chunk numbers
        return np.concatenate([self.store.tokens(int(j) * c, (int(j) + 2) * c) for j in ids.reshape(-1)])
