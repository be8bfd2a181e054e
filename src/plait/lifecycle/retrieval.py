"""Encoders for the retrieval database (plait.data.retrieval): a frozen plait model, or any Hugging Face
decoder directory plait reads, embeds a chunk as the mean of its tokens' final hidden states (after the last
norm, before the output projection), computed on the chunk alone; "lexical" is plait.data.lexical's TF-IDF
encoder, fitted on the corpus's own train chunks."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

from plait.core.errors import ConfigError


def plait_encoder(model, device: str = "cpu"):
    """encode((n, chunk) token ids) -> (n, dim) float32 embeddings of a plait Transformer, frozen."""
    model.eval()

    @torch.no_grad()
    def encode(tokens: np.ndarray) -> np.ndarray:
        head, model.output = model.output, None  # the final hidden states, not the logits
        try:
            hidden = model(torch.from_numpy(np.ascontiguousarray(tokens, dtype=np.int64)).to(device))
        finally:
            model.output = head
        return hidden.float().mean(1).cpu().numpy()

    return encode


def load_encoder(ref: str, corpus_manifest: dict[str, Any], device: str = "cpu"):
    """(encode, its description for the database's manifest) of the model at `ref`, refused when it reads
    another tokenizer's ids than the corpus's."""
    from plait.lifecycle.models import load_model

    loaded = load_model(ref, device=device)
    vocab = corpus_manifest["vocab_size"]
    if loaded.model.args.vocab_size < vocab:
        raise ConfigError(
            f"the encoder {ref} has a vocabulary of {loaded.model.args.vocab_size}, the corpus {vocab}: encode with "
            "a model of the corpus's tokenizer"
        )
    tokenizer_hash = None
    if loaded.tokenizer is not None:
        tokenizer_hash = hashlib.sha256(Path(loaded.tokenizer).read_bytes()).hexdigest()
        if corpus_manifest.get("tokenizer_sha256") and tokenizer_hash != corpus_manifest["tokenizer_sha256"]:
            raise ConfigError(
                f"the encoder {ref} was trained with another tokenizer than the corpus (tokenizer.json hashes "
                f"{tokenizer_hash[:12]} and {corpus_manifest['tokenizer_sha256'][:12]}): encode with a model of "
                "the corpus's tokenizer"
            )
    from plait.lifecycle.lora import model_weights_hash

    description = {
        "path": str(loaded.path.resolve()) if isinstance(loaded.path, Path) else str(loaded.path),  # s3:// as is
        "kind": loaded.kind,
        "weights_hash": model_weights_hash(loaded.model),
        "dim": loaded.model.args.dim,
        "pooling": "mean of the final hidden states",
    }
    return plait_encoder(loaded.model, device), description


def encoder_for(ref: str, data_dir: str | Path, chunk: int, device: str = "cpu", dim: int | None = None):
    """(encode, description) of a database's encoder: "lexical" (plait.data.lexical, fitted on the prepared
    directory's train chunks), or a frozen model at `ref` (load_encoder)."""
    from plait.data.loader import read_manifest

    if ref == "lexical":
        from plait.data.lexical import DIM, lexical_encoder

        return lexical_encoder(data_dir, chunk, dim or DIM)
    if dim is not None:
        raise ConfigError(f"--dim={dim} sets the lexical encoder's size; a model's embeddings are its width")
    return load_encoder(ref, read_manifest(data_dir), device)


def database_retriever(data_dir: str | Path, model, device: str = "cpu"):
    """A retrieval model's Retriever (plait.data.retrieval) of the database in a prepared directory, with the
    encoder the database was built with (the one its manifest records)."""
    from plait.data.retrieval import Retriever, read_database

    db = read_database(data_dir)
    lexical = db["encoder"].get("kind") == "lexical"
    encode, described = encoder_for(db["encoder"]["path"], data_dir, db["chunk"], device,
                                    db["encoder"]["dim"] if lexical else None)  # fmt: skip
    if lexical and described["idf_sha256"] != db["encoder"]["idf_sha256"]:
        raise ConfigError(f"the lexical encoder of {data_dir} no longer matches its database: build it again")
    return Retriever(data_dir, encode, chunk=model.args.retrieval_chunk, k=model.args.retrieval_k)


def checkpoint_retriever(checkpoint: str | Path, model, data: str = "", device: str = "cpu"):
    """The Retriever a retrieval model generates with: the database in `data`, or (when empty) in the prepared
    directory its checkpoint (or run directory) trained on, with the encoder the database was built with.
    `device` is a spec plait.core.hardware.resolve_device reads ("auto" included). Refused when the run trained
    on data that has no database (the built-in corpus, a mixture)."""
    from plait.core.hardware import resolve_device
    from plait.engine.checkpoint import read_config, resolve_checkpoint

    data = data or read_config(resolve_checkpoint(checkpoint)).data.source
    if data == "shakespeare" or "," in data:
        raise ConfigError(f"{checkpoint} trained on {data!r}, which has no retrieval database: give --data DIR")
    return database_retriever(data, model, str(resolve_device(device)))
