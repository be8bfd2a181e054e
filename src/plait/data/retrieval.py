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
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from plait.core.errors import ConfigError
from plait.core.publish import staged_dir
from plait.core.records import Record, first_line, read_json_object
from plait.data.loader import TokenDataset, read_manifest

RETRIEVAL_DIR = "retrieval"
FORMAT = "plait-retrieval-v1"
JOURNAL = "progress.json"
SEARCH_BLOCK = 4096  # query chunks per faiss search
INDEX_FILE = "index.faiss"
REBUILD = "build the database again (plait data retrieve DIR --encoder ... --overwrite)"

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


def check_build_settings(chunk: int, k: int, batch: int = 1, dim: int | None = None) -> None:
    """A build's sizes, refused before anything reads the corpus (`plait data retrieve`'s options)."""
    for name, value in (("chunk", chunk), ("k", k), ("batch", batch), ("dim", dim)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"--{name}={value} must be a positive integer, e.g. --chunk 64 --k 2 --batch 64")


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
    `encoder` describes the encoder (recorded); progress(stage, done, total) after every batch. The database
    appears whole or not at all (core.publish.staged_dir): a replaced one is removed only after the rename."""
    try:
        import faiss
    except ImportError:
        raise ConfigError("plait data retrieve needs faiss: pip install 'plait[retrieval]'") from None
    data_dir = Path(data_dir)
    corpus = read_manifest(data_dir)
    out, stage = data_dir / RETRIEVAL_DIR, data_dir / f"{RETRIEVAL_DIR}.partial"
    exists = ConfigError(f"{out} exists; pass --overwrite to build it again")
    if out.exists() and not overwrite:
        raise exists
    check_build_settings(chunk, k, batch)
    splits = {split: chunk_split(data_dir, split, chunk) for split in ("train", "val")}
    stored = len(splits["train"].tokens) - 1  # the last train chunk has no continuation
    if k > stored - 1:
        raise ConfigError(
            f"--k={k} neighbours but the database holds {max(stored, 0)} chunks of {chunk} tokens: at most "
            f"{max(stored - 1, 0)} (or a smaller --chunk)"
        )
    settings = dict(chunk=chunk, k=k, corpus=corpus_digest(corpus), encoder=encoder)
    with staged_dir(out, overwrite=overwrite, exists_error=exists, stage=stage):
        journal = _Journal.open(stage, settings)
        embeddings = {
            split: _embed(journal, f"{split}_embeddings", c.tokens, encode, batch, f"embedding {split}", progress)
            for split, c in splits.items()
        }
        index = faiss.IndexFlatIP(embeddings["train"].shape[1])
        index.add(np.ascontiguousarray(embeddings["train"][:stored]))
        _find_neighbours(journal, index, splits, embeddings, k, progress)
        faiss.write_index(index, str(stage / INDEX_FILE))
        manifest = {
            "format": FORMAT,
            **settings,
            "corpus_tokenizer_sha256": corpus.get("tokenizer_sha256", ""),
            "chunks": {split: len(c.tokens) for split, c in splits.items()},
            "database_chunks": stored,
            "index": {"type": "faiss.IndexFlatIP", "metric": "cosine (L2-normalised embeddings)", "exact": True},
            "neighbour_tokens": 2 * chunk,
            "excluded": "database chunks whose chunk or continuation shares a document with the query chunk or "
            "the chunk after it",
        }
        (stage / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        journal.close()
    return manifest


def _find_neighbours(journal: _Journal, index, splits: dict[str, Chunks], embeddings, k: int, progress) -> None:
    """Every chunk's k nearest database chunks outside its own documents, into {split}_neighbours.npy."""
    train, stored = splits["train"], index.ntotal
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


def _array(path: Path, shape: tuple[int, ...], dtype, fresh: bool) -> np.memmap:
    """The array an interrupted build left (its shape and dtype checked), or a fresh one."""
    if fresh or not path.exists():
        return np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape)
    fix = f"remove {path.parent} to build from the start"
    arr = _load_array(path, fix)  # read-only first: numpy's r+ map would lengthen a cut file to fit
    if arr.dtype != np.dtype(dtype) or arr.shape != shape:
        raise ConfigError(f"{path} is {arr.dtype} {arr.shape}, this build's {np.dtype(dtype)} {shape}: {fix}")
    return np.load(path, mmap_mode="r+", allow_pickle=False)


def _journal(stage: Path) -> dict[str, Any] | None:
    """An interrupted build's journal, or None where there is none (or none of this shape: a fresh build)."""
    try:
        state = json.loads((stage / JOURNAL).read_text())
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(state, dict) or not isinstance(state.get("done"), dict) or "settings" not in state:
        return None
    done = state["done"].values()
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in done):
        return None
    return state


def _load_array(path: Path, fix: str) -> np.ndarray:
    """A numpy array file, memory-mapped (never unpickled); a file numpy cannot map is refused saying `fix`."""
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise ConfigError(f"{path} cannot be read as a numpy array ({first_line(e)}): {fix}") from None
    if not isinstance(arr, np.ndarray) or arr.ndim != 2:
        raise ConfigError(f"{path} is not a two-dimensional array: {fix}")
    return arr


def read_database(data_dir: str | Path) -> dict[str, Any]:
    """A prepared directory's retrieval manifest, its fields checked (check_manifest) and checked against the
    corpus it sits beside."""
    data_dir = Path(data_dir)
    path = data_dir / RETRIEVAL_DIR / "manifest.json"
    if not path.is_file():
        raise ConfigError(f"{data_dir} has no retrieval database: build it with plait data retrieve {data_dir} ...")
    manifest = read_json_object(path, REBUILD)
    if manifest.get("format") != FORMAT:
        raise ConfigError(f"{path} is not a {FORMAT} manifest: build the database again")
    check_manifest(manifest, path)
    if manifest["corpus"] != corpus_digest(read_manifest(data_dir)):
        raise ConfigError(
            f"the retrieval database of {data_dir} was built from other data or another tokenizer: build it again"
        )
    return manifest


def check_manifest(manifest: dict[str, Any], path: Path | str) -> None:
    """Every field a reader of the database uses, of its kind and in range (and consistent with each other)."""
    m = Record(manifest, path, REBUILD)
    m.integer("chunk", 1)
    m.string("corpus")
    chunks = m.record("chunks")
    train = chunks.integer("train", 2)
    chunks.integer("val", 0)
    stored = m.integer("database_chunks", 1)
    if stored != train - 1:
        raise m.error("database_chunks", stored, f"chunks.train - 1 = {train - 1} (the chunks with a continuation)")
    k = m.integer("k", 1)
    if k >= stored:
        raise m.error("k", k, f"below database_chunks={stored}")
    encoder = m.record("encoder")
    encoder.string("path", empty=False)
    encoder.integer("dim", 1)
    encoder.string("kind", default="")
    if manifest["encoder"].get("kind") == "lexical":
        encoder.string("idf_sha256")


def database_for(data_dir: str | Path, chunk: int, k: int) -> dict[str, Any]:
    """The database's manifest, refused when a model of `chunk`-token chunks and k neighbours cannot read it;
    its index's header is checked too (check_index), so a damaged index stops a run before it trains."""
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
    check_index(data_dir, db)
    return db


_INDEX_HEADER = struct.Struct("<4siqqq?iQ")  # fourcc, d, ntotal, two unused, is_trained, metric, code words
_FLAT_IP, _INNER_PRODUCT = b"IxFI", 0


def check_index(data_dir: str | Path, db: dict[str, Any]) -> None:
    """index.faiss read by its header alone (cheap at any size, before faiss parses it): an exact
    inner-product index (faiss's IndexFlatIP) of the manifest's database_chunks vectors of the encoder's dim,
    whole (its size is the header's)."""
    path = Path(data_dir) / RETRIEVAL_DIR / INDEX_FILE
    try:
        with open(path, "rb") as f:
            head = f.read(_INDEX_HEADER.size)
        size = path.stat().st_size
    except OSError as e:
        raise ConfigError(f"{path} cannot be read ({first_line(e)}): {REBUILD}") from None
    if len(head) < _INDEX_HEADER.size:
        raise ConfigError(f"{path} is cut short ({size} bytes, not even a faiss header): {REBUILD}")
    fourcc, dim, total, _, _, _, metric, words = _INDEX_HEADER.unpack(head)
    check_index_fields(path, db, fourcc == _FLAT_IP and metric == _INNER_PRODUCT, dim, total)
    if words != dim * total or size != _INDEX_HEADER.size + 4 * words:
        raise ConfigError(
            f"{path} is {size} bytes; an index of {total} vectors of {dim} floats is "
            f"{_INDEX_HEADER.size + 4 * dim * total}: the file is cut or damaged: {REBUILD}"
        )


def check_index_fields(path: Path, db: dict[str, Any], flat_ip: bool, dim: int, total: int) -> None:
    """An index (read from its header or loaded by faiss) against its manifest: type, dimension and count."""
    if not flat_ip:
        raise ConfigError(f"{path} is not an exact inner-product faiss index (IndexFlatIP, as built): {REBUILD}")
    if dim != db["encoder"]["dim"]:
        raise ConfigError(
            f"{path} holds vectors of {dim} dimensions, the manifest's encoder {db['encoder']['dim']} (an index of "
            f"another database?): {REBUILD}"
        )
    if total != db["database_chunks"]:
        raise ConfigError(
            f"{path} holds {total} vectors, the manifest's database_chunks {db['database_chunks']} (an index of "
            f"another database?): {REBUILD}"
        )


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
        db = database_for(data_dir, chunk, k)
        path = Path(data_dir) / RETRIEVAL_DIR / INDEX_FILE
        try:
            self.index = faiss.read_index(str(path))
        except RuntimeError as e:
            raise ConfigError(f"{path} cannot be read by faiss ({first_line(e)}): {REBUILD}") from None
        flat_ip = isinstance(self.index, faiss.IndexFlatIP) and self.index.metric_type == faiss.METRIC_INNER_PRODUCT
        check_index_fields(path, db, flat_ip, self.index.d, self.index.ntotal)
        self.store, self.encode, self.chunk, self.k = TokenDataset(data_dir, "train"), encode, chunk, k

    def __call__(self, chunks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        vectors = np.asarray(self.encode(np.asarray(chunks, dtype=np.int64)), dtype=np.float32)
        if vectors.ndim != 2 or vectors.shape[1] != self.index.d:
            raise ConfigError(
                f"the encoder gives vectors of shape {vectors.shape[1:]}, the database's index holds {self.index.d} "
                f"dimensions: {REBUILD} with this encoder"
            )
        vectors /= np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        _, found = self.index.search(np.ascontiguousarray(vectors), self.k)
        c = self.chunk
        tokens = [self.store.tokens(int(j) * c, (int(j) + 2) * c) for j in found.reshape(-1)]
        return found.astype(np.int32), np.stack(tokens).reshape(len(found), self.k, 2 * c)


def neighbours(data_dir: str | Path, split: str, db: dict[str, Any] | None = None) -> np.ndarray:
    """(chunks, k) database chunk numbers of each chunk of a split (read-only, memory-mapped, no pickle),
    checked against the manifest `db` (read when not given): int32, a row per chunk of the split, k columns,
    every number a database chunk."""
    db = read_database(data_dir) if db is None else db
    path = Path(data_dir) / RETRIEVAL_DIR / f"{split}_neighbours.npy"
    arr = _load_array(path, REBUILD)
    want = (db["chunks"].get(split), db["k"])
    if arr.dtype != np.int32 or arr.shape != want:
        raise ConfigError(
            f"{path} is {arr.dtype} {arr.shape}; the manifest's {split} split needs int32 {want} (another split's "
            f"file?): {REBUILD}"
        )
    low, high = (int(arr.min()), int(arr.max())) if arr.size else (0, 0)
    if low < 0 or high >= db["database_chunks"]:
        raise ConfigError(
            f"{path} names database chunk {low if low < 0 else high}; the database holds chunks 0 to "
            f"{db['database_chunks'] - 1}: {REBUILD}"
        )
    return arr


class RetrievalDataset(TokenDataset):
    """A split whose windows come with their chunks' neighbours (a RETRO model's input, plait.model.retrieval):
    windows start on chunk boundaries (every seq_len + chunk tokens: the chunk - 1 tokens after each window's
    last target are skipped), and `neighbour_tokens` gives each of the window's seq_len / chunk chunks its k
    neighbours, each a database chunk and its continuation (2 chunk tokens of the train stream). The loader
    appends them to the window's inputs; its sample order, resumption and data-parallel split are the token
    loader's own."""

    def __init__(self, data_dir: str | Path, split: str, *, chunk: int, k: int, remote_cache_mb: int = 256) -> None:
        super().__init__(data_dir, split, remote_cache_mb)
        db = database_for(data_dir, chunk, k)
        self.chunk, self.k = chunk, k
        self.neighbours = neighbours(data_dir, split, db)[:, :k]
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
