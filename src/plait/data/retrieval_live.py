"""The index of a retriever that learns (model.retrieval_learned; plait.model.retrieval_learned has the model's
side): the database's chunks embedded with a snapshot of the learned encoder's table, in an exact faiss index
kept in memory, and each window's neighbours searched in it when the window is read, with the build's rule
(plait.data.retrieval_build.search_outside: a train chunk never gets a neighbour from its own documents or those
of the chunk after it).

A run builds its first index before its first step and then, every model.retrieval_refresh_steps, hands a new
snapshot to `submit`, which embeds and indexes the database on a background thread while the loop goes on;
`install` swaps it in at a step the run fixes in advance (plait.engine.retrieval_refresh), waiting only if the
build has not finished by then. Which index a step searches is so a function of the step alone, never of the
build's speed: a resumed run, or one on another machine, searches the same neighbours."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from plait.core.errors import ConfigError
from plait.data.retrieval_build import answers_last_doc, search_outside
from plait.data.retrieval_format import REBUILD, chunk_split, index_dir
from plait.model.retrieval_learned import bag_embed

EMBED_BLOCK = 4096
"""Chunks embedded at a time when the database is indexed."""


def check_learned_database(data_dir: str | Path, db: dict[str, Any], dim: int) -> None:
    """A learned retriever starts as the database's lexical encoder (plait.data.lexical.lexical_table): a database
    built with another encoder, or the lexical one at another size than model.retrieval_dim, is refused by name."""
    encoder = db["encoder"]
    if encoder.get("kind") != "lexical":
        raise ConfigError(
            f"model.retrieval_learned=true starts from the database's lexical encoder, but the database of {data_dir} "
            f"was built with {encoder.get('path')!r}: {REBUILD} with --encoder lexical, or set "
            "model.retrieval_learned=false"
        )
    if encoder.get("dim") != dim:
        raise ConfigError(
            f"model.retrieval_dim={dim}, but the lexical database of {data_dir} has {encoder.get('dim')} dimensions: "
            f"set model.retrieval_dim={encoder.get('dim')}"
        )


def embed_chunks(tokens: np.ndarray, table: np.ndarray) -> np.ndarray:
    """(n, d) float32 unit vectors of chunks (n, c) with a learned table (plait.model.retrieval_learned.bag_embed)."""
    weights = torch.from_numpy(np.ascontiguousarray(table, dtype=np.float32))
    out = np.empty((len(tokens), table.shape[1]), np.float32)
    with torch.no_grad():
        for start in range(0, len(tokens), EMBED_BLOCK):
            block = torch.from_numpy(np.asarray(tokens[start : start + EMBED_BLOCK], dtype=np.int64))
            out[start : start + len(block)] = bag_embed(block, weights).numpy()
    return out


def flat_index(vectors: np.ndarray):
    """An exact inner-product faiss index of unit vectors (the cosine, as the built databases' index)."""
    import faiss

    index = faiss.IndexFlatIP(vectors.shape[1])
    index.add(np.ascontiguousarray(vectors))
    return index


class LiveIndex:
    """The database of a prepared directory (or of the one its neighbours are found in: --database), indexed with
    snapshots of a learned table; `neighbours(split, first, count)` searches the chunks first .. first + count - 1
    of a split in the index installed now."""

    def __init__(self, data_dir: str | Path, db: dict[str, Any], *, chunk: int, k: int) -> None:
        try:
            import faiss  # noqa: F401
        except ImportError:
            raise ConfigError("retrieval needs faiss: pip install 'plait[retrieval]'") from None
        self.data_dir, self.home = Path(data_dir), Path(index_dir(data_dir, db))  # the queries' corpus, the database's
        self.own = "database" not in db  # else another corpus's database: nothing of the queries' documents is in it
        database = chunk_split(self.home, "train", chunk)
        self.stored = len(database.tokens) - 1  # the last chunk has no continuation
        self.database = database.tokens[: self.stored]
        self.spans = (database.first_doc[: self.stored], database.last_doc[1 : self.stored + 1])
        self._queries: dict[str, tuple[np.ndarray, Any]] = {}  # per split, read at its first search
        self.chunk, self.k = chunk, k
        # (the step its snapshot was taken at, the snapshot, its faiss index); the queries are embedded with the
        # snapshot the index was built with
        self.current: tuple[int, np.ndarray, Any] | None = None
        self.pending: tuple[int, np.ndarray, Future] | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="plait-index")

    def build(self, table: np.ndarray):
        """The database's faiss index with this table (what the background thread runs)."""
        return flat_index(embed_chunks(self.database, table))

    def start(self, step: int, table: np.ndarray) -> None:
        """Index with `table` now and search with it from now on."""
        table = np.array(table, dtype=np.float32)
        self.current = (step, table, self.build(table))

    def submit(self, step: int, table: np.ndarray) -> None:
        """Index with `table` (a copy, taken at the end of `step`) in the background, for a later `install`."""
        table = np.array(table, dtype=np.float32)
        self.pending = (step, table, self._pool.submit(self.build, table))

    def install(self) -> float:
        """Search with the index last submitted from now on; the seconds waited for its build (0 when done)."""
        import time

        assert self.pending is not None, "install without a submitted index"
        step, table, future = self.pending
        started = time.perf_counter()
        self.current, self.pending = (step, table, future.result()), None
        return time.perf_counter() - started

    def neighbours(self, split: str, first: int, count: int) -> np.ndarray:
        """(count, k) database chunk numbers: the neighbours of chunks first .. first + count - 1 of `split`."""
        assert self.current is not None, "no index built yet"
        _, table, index = self.current
        tokens, own = self._split(split)
        vectors = embed_chunks(tokens[first : first + count], table)
        mine = (own[0][first : first + count], own[1][first : first + count]) if own is not None else None
        return search_outside(index, vectors, self.k, mine, *self.spans, self.stored)

    def _split(self, split: str) -> tuple[np.ndarray, Any]:
        """(a split's chunks, the documents each may not take a neighbour from: None where the database is
        another's or the split is the held-out one)."""
        if split not in self._queries:
            chunks = chunk_split(self.data_dir, split, self.chunk)
            own = (chunks.first_doc, answers_last_doc(chunks.last_doc)) if self.own and split == "train" else None
            self._queries[split] = (chunks.tokens, own)
        return self._queries[split]

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
