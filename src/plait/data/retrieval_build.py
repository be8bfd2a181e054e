"""Building a retrieval database (`plait data retrieve`; plait.data.retrieval has the overview): every chunk
embedded, the database's embeddings in an exact faiss index, each chunk's k nearest database chunks outside its
own documents. The build works in `retrieval.partial/` with a journal after every batch (an interrupted build
continues where it stopped when the same command runs again) and is renamed into place whole at the end."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from plait.core.errors import ConfigError
from plait.core.publish import staged_dir
from plait.data.loader import read_manifest
from plait.data.retrieval_format import (
    FORMAT,
    INDEX_FILE,
    RETRIEVAL_DIR,
    Chunks,
    Encoder,
    check_index,
    chunk_split,
    corpus_digest,
    load_array,
    read_database,
)

JOURNAL = "progress.json"
SEARCH_BLOCK = 4096  # query chunks per faiss search


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
        embeddings: dict[str, np.ndarray] = {}
        for split, c in splits.items():  # train first: an empty validation split takes its width
            dim = embeddings["train"].shape[1] if embeddings else 0
            embeddings[split] = _embed(journal, f"{split}_embeddings", c.tokens, encode, batch, split, progress, dim)
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


def find_in_database(
    data_dir: str | Path,
    source: str | Path,
    encode: Encoder,
    *,
    k: int = 2,
    batch: int = 64,
    overwrite: bool = False,
    progress: Callable[[str, int, int], None] = lambda stage, done, total: None,
) -> dict[str, Any]:
    """Neighbours for a prepared directory's chunks found in another's database (`plait data retrieve DIR
    --database SOURCE`; RETRO's setting: a database of other text), with `encode`, SOURCE's own encoder, at its
    chunk size: each chunk of DIR's splits gets SOURCE's k nearest chunks, none left out. DIR/retrieval holds
    them and a manifest naming SOURCE (its place and corpus digest), whose index and train stream the readers
    use (retrieval_format.index_dir). Journalled, staged, published whole as build_database; returns the manifest."""
    try:
        import faiss
    except ImportError:
        raise ConfigError("plait data retrieve needs faiss: pip install 'plait[retrieval]'") from None
    data_dir, source = Path(data_dir), Path(source).resolve()
    other, corpus = _source_database(data_dir, source)
    chunk = other["chunk"]
    check_build_settings(chunk, k, batch)
    if k >= other["database_chunks"]:  # as the manifest's reader requires (k below database_chunks)
        raise ConfigError(
            f"--k={k} but the database of {source} holds {other['database_chunks']} chunks: a smaller --k"
        )
    splits = {split: chunk_split(data_dir, split, chunk) for split in ("train", "val")}
    if len(splits["train"].tokens) < 2:
        raise ConfigError(f"{data_dir}'s train split holds fewer than 2 chunks of {chunk} tokens: nothing to train on")
    check_index(source, other)
    index = faiss.read_index(str(source / RETRIEVAL_DIR / INDEX_FILE))
    out, stage = data_dir / RETRIEVAL_DIR, data_dir / f"{RETRIEVAL_DIR}.partial"
    exists = ConfigError(f"{out} exists; pass --overwrite to build it again")
    if out.exists() and not overwrite:
        raise exists
    settings = dict(chunk=chunk, k=k, corpus=corpus_digest(corpus), encoder=other["encoder"],
                    database={"dir": str(source), "corpus": other["corpus"]})  # fmt: skip
    with staged_dir(out, overwrite=overwrite, exists_error=exists, stage=stage):
        journal = _Journal.open(stage, settings)
        for split, c in splits.items():
            found = _embed(journal, f"{split}_embeddings", c.tokens, encode, batch, split, progress, index.d)

            def search(rows: slice, found=found) -> np.ndarray:
                return index.search(np.ascontiguousarray(found[rows]), k)[1].astype(np.int32)

            _in_blocks(journal, f"{split}_neighbours", len(c.tokens), k, search, f"neighbours of {split}", progress)
        manifest = {
            "format": FORMAT,
            **settings,
            "corpus_tokenizer_sha256": corpus.get("tokenizer_sha256", ""),
            "chunks": {split: len(c.tokens) for split, c in splits.items()},
            "database_chunks": other["database_chunks"],
            "index": other.get("index"),
            "neighbour_tokens": 2 * chunk,
            "excluded": "none: the neighbours are another corpus's chunks",
        }
        (stage / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        journal.close()
    return manifest


def _source_database(data_dir: Path, source: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the manifest of the database in `source`, data_dir's corpus manifest): refused where source has no
    database of its own chunks, is data_dir itself, or was prepared with another tokenizer."""
    other = read_database(source, follow=False)
    if "database" in other:
        raise ConfigError(
            f"--database {source}: its own neighbours were found in {other['database']['dir']}; give the directory "
            "whose database holds the chunks"
        )
    if source == data_dir.resolve():
        raise ConfigError(f"--database names {data_dir} itself: build its own database with --encoder instead")
    corpus = read_manifest(data_dir)
    theirs, ours = other.get("corpus_tokenizer_sha256", ""), corpus.get("tokenizer_sha256", "")
    if theirs and ours and theirs != ours:
        raise ConfigError(
            f"{data_dir} was prepared with tokenizer {ours[:12]}, the database of {source} with {theirs[:12]} "
            f"(sha256 of tokenizer.json): prepare it with {source}/tokenizer.json (plait data prepare ... --tokenizer)"
        )
    return other, corpus


def _find_neighbours(journal: _Journal, index, splits: dict[str, Chunks], embeddings, k: int, progress) -> None:
    """Every chunk's k nearest database chunks outside its own documents, into {split}_neighbours.npy."""
    train, stored = splits["train"], index.ntotal
    # a neighbour (chunk j and its continuation j + 1) spans documents first_doc[j] .. last_doc[j + 1]
    span_first, span_last = train.first_doc[:stored], train.last_doc[1 : stored + 1]
    for split, chunks in splits.items():
        # a train chunk's neighbours serve the tokens of the chunk after it, so both chunks' documents are its
        # own (the next chunk may open another document); validation chunks: none in the database
        own = (chunks.first_doc, answers_last_doc(chunks.last_doc)) if split == "train" else None

        def search(rows: slice, own=own, split=split) -> np.ndarray:
            query = np.ascontiguousarray(embeddings[split][rows])
            mine = (own[0][rows], own[1][rows]) if own is not None else None
            return search_outside(index, query, k, mine, span_first, span_last, stored)

        _in_blocks(journal, f"{split}_neighbours", len(chunks.tokens), k, search, f"neighbours of {split}", progress)


def answers_last_doc(last_doc: np.ndarray) -> np.ndarray:
    """Each chunk's last document or, when there is a next chunk (the text its neighbours help predict), that
    chunk's last document."""
    return np.concatenate([last_doc[1:], last_doc[-1:]]) if len(last_doc) else last_doc


def search_outside(index, query, k: int, own, span_first, span_last, stored: int) -> np.ndarray:
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


def _embed(
    journal: _Journal, key: str, tokens: np.ndarray, encode: Encoder, batch: int, split: str, progress, dim: int
):
    """The L2-normalised embeddings of every chunk (rows already done kept), read back memory-mapped; a split
    without chunks (prepared with --val-fraction 0) gets an empty array `dim` wide."""
    total, done, what = len(tokens), journal.done(key), f"embedding {split}"
    arr = _array(journal.stage / f"{key}.npy", (0, dim), np.float32, fresh=True) if total == 0 else None
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
    arr = load_array(path, fix)  # read-only first: numpy's r+ map would lengthen a cut file to fit
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
