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

This module holds what uses a built database: `Retriever` (neighbours of text being generated) and
`RetrievalDataset` (a RETRO model's training windows). The format and its checked readers are
plait.data.retrieval_format, the build plait.data.retrieval_build; their names are importable from here too.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from plait.core.errors import ConfigError
from plait.core.records import first_line
from plait.data.loader import TokenDataset
from plait.data.retrieval_build import JOURNAL, SEARCH_BLOCK, build_database, check_build_settings
from plait.data.retrieval_format import (
    FORMAT,
    INDEX_FILE,
    REBUILD,
    RETRIEVAL_DIR,
    Chunks,
    Encoder,
    ModelNeeds,
    check_database_fits,
    check_index,
    check_index_fields,
    check_manifest,
    chunk_split,
    corpus_digest,
    database_for,
    database_record,
    describe_encoder,
    encoder_key,
    index_dir,
    neighbours,
    read_database,
    rebuild_command,
)
from plait.data.retrieval_live import LiveIndex

__all__ = [  # the database's names, importable from here (its readers and builder live in the two modules above)
    "FORMAT",
    "INDEX_FILE",
    "JOURNAL",
    "REBUILD",
    "RETRIEVAL_DIR",
    "SEARCH_BLOCK",
    "Chunks",
    "Encoder",
    "ModelNeeds",
    "RetrievalDataset",
    "Retriever",
    "build_database",
    "check_build_settings",
    "check_database_fits",
    "check_index",
    "check_index_fields",
    "check_manifest",
    "chunk_split",
    "corpus_digest",
    "database_for",
    "database_record",
    "describe_encoder",
    "encoder_key",
    "index_dir",
    "neighbours",
    "read_database",
    "rebuild_command",
]


class Retriever:
    """Neighbours of new chunks (text being generated) from a prepared directory's database: each chunk
    embedded by `encode` (the database's own encoder), normalised as the database's, its k nearest database
    chunks found in the index, and each read with its continuation from the train stream (`store`, 2 chunk
    tokens). `retriever(chunks (n, chunk))` -> (database chunk numbers (n, k), their tokens (n, k, 2 chunk))."""

    def __init__(self, data_dir: str | Path, encode: Encoder, *, chunk: int, k: int, table=None) -> None:
        """`table`: a learned retriever's (plait.model.retrieval_learned), which embeds the database's chunks
        itself into an index in memory (the built index is of another encoder) and is then `encode`."""
        try:
            import faiss
        except ImportError:
            raise ConfigError("retrieval needs faiss: pip install 'plait[retrieval]'") from None
        db = database_for(data_dir, chunk, k)
        home = index_dir(data_dir, db)  # another corpus's, where the neighbours were found in its database
        if table is not None:
            live = LiveIndex(data_dir, db, chunk=chunk, k=k)
            self.index = live.build(table)
        else:
            path = Path(home) / RETRIEVAL_DIR / INDEX_FILE
            try:
                self.index = faiss.read_index(str(path))
            except RuntimeError as e:
                raise ConfigError(f"{path} cannot be read by faiss ({first_line(e)}): {REBUILD}") from None
            flat_ip = isinstance(self.index, faiss.IndexFlatIP) and self.index.metric_type == faiss.METRIC_INNER_PRODUCT
            check_index_fields(path, db, flat_ip, self.index.d, self.index.ntotal)
        self.store, self.encode, self.chunk, self.k = TokenDataset(home, "train"), encode, chunk, k
        self.data_dir = Path(home)  # where the passages are read from

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
        home = index_dir(data_dir, db)  # another corpus's, where the neighbours were found in its database
        own = split == "train" and "database" not in db
        self.store = self if own else TokenDataset(home, "train", remote_cache_mb)
        self.live: LiveIndex | None = None  # a learned retriever's index: neighbours searched, not read

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
        if self.live is not None:
            ids = self.live.neighbours(self.split, first, seq_len // c)
        else:
            ids = self.neighbours[first : first + seq_len // c]  # (chunks, k) database chunk numbers
        return np.concatenate([self.store.tokens(int(j) * c, (int(j) + 2) * c) for j in ids.reshape(-1)])
