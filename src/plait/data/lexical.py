"""A lexical encoder for the retrieval database (`plait data retrieve DIR --encoder lexical`): a chunk's TF-IDF
vector over the tokenizer's vocabulary, log(1 + tf) x idf with idf = log((N + 1) / (df + 1)) counted over the
N chunks of the train split (the database), L2-normalised and projected to `dim` dimensions by a fixed Gaussian
matrix (seeded; inner products kept to within about 1 / sqrt(dim), Johnson-Lindenstrauss), normalised again.

Nothing is learned and nothing is stored: the same corpus, chunk, dim and seed give the same encoder, so
generation rebuilds it from the database's manifest (which records the idf's hash, checked). Chunks that share
their rarer tokens (a play's names, a module's identifiers) come out near each other, which the mean hidden
state of a small language model does far less often (docs/data.md, "The lexical encoder": the share of
neighbours from the query's own play, measured by bench/retrieval_ceiling.py)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np

from plait.data.loader import read_manifest

DIM = 512
SEED = 0


def document_frequencies(chunks: np.ndarray, vocab: int) -> np.ndarray:
    """How many of the (n, chunk) token rows hold each token id (vocab,)."""
    if not len(chunks):
        return np.zeros(vocab, np.int64)
    ordered = np.sort(chunks, axis=1)
    first = np.ones_like(ordered, dtype=bool)
    first[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    return np.bincount(ordered[first], minlength=vocab)


def _idf_and_projection(data_dir: str | Path, chunk: int, dim: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    from plait.data.retrieval import chunk_split

    vocab = int(read_manifest(data_dir)["vocab_size"])
    database = chunk_split(Path(data_dir), "train", chunk).tokens
    idf = np.log((len(database) + 1) / (document_frequencies(database, vocab) + 1)).astype(np.float32)
    projection = np.random.default_rng(seed).standard_normal((vocab, dim), dtype=np.float32) / np.float32(dim**0.5)
    return idf, projection


def lexical_table(data_dir: str | Path, chunk: int, dim: int = DIM, seed: int = SEED) -> np.ndarray:
    """(vocab, dim) float32: idf(t) x the projection's row of t, for every token t. As the table of
    plait.model.retrieval_learned.bag_embed it embeds a chunk exactly as lexical_encoder does (where a learned
    retriever starts)."""
    idf, projection = _idf_and_projection(data_dir, chunk, dim, seed)
    return idf[:, None] * projection


def lexical_encoder(data_dir: str | Path, chunk: int, dim: int = DIM, seed: int = SEED):
    """(encode, its description) of a prepared directory's train chunks of `chunk` tokens:
    encode((n, chunk) token ids) -> (n, dim) float32 unit vectors."""
    idf, projection = _idf_and_projection(data_dir, chunk, dim, seed)

    def encode(tokens: np.ndarray) -> np.ndarray:
        tokens = np.asarray(tokens, dtype=np.int64)
        tf = (tokens[:, :, None] == tokens[:, None, :]).sum(-1)  # each position's token's count in its chunk
        weight = np.log1p(tf) * idf[tokens]  # a token's tf-idf, found at each of its tf positions
        norm = np.sqrt((weight**2 / tf).sum(1, keepdims=True))  # of the tf-idf vector (each token once)
        vectors = np.einsum("nc,ncd->nd", weight / tf / np.maximum(norm, 1e-12), projection[tokens])
        return (vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)).astype(np.float32)

    description: dict[str, Any] = {
        "path": "lexical",
        "kind": "lexical",
        "weighting": "log(1 + tf) * log((N + 1) / (df + 1)) over the train split's chunks",
        "dim": dim,
        "projection": f"Gaussian, numpy default_rng({seed})",
        "idf_sha256": hashlib.sha256(idf.tobytes()).hexdigest(),
    }
    return encode, description
