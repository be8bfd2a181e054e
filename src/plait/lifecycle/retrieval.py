"""Encoders for the retrieval database (plait.data.retrieval): a frozen plait model, or any Hugging Face
decoder directory plait reads, embeds a chunk as the mean of its tokens' final hidden states (after the last
norm, before the output projection), computed on the chunk alone; "lexical" is plait.data.lexical's TF-IDF
encoder, fitted on the corpus's own train chunks.

Also what a trained retrieval model reads a database with: its Retriever (the database it trained with, or any
other built with its encoder, tokenizer and chunk size: `plait generate --database DIR`; another is refused
by name), the record of its database each checkpoint carries (DatabaseRecord), and the passages a generated
text retrieved, chunk by chunk (retrieved_passages)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from plait.core.errors import ConfigError, PlaitError
from plait.core.records import first_line
from plait.data.retrieval import ModelNeeds
from plait.engine.callbacks import Callback


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


def database_encoder(data_dir: str | Path, db: dict[str, Any], device: str = "cpu"):
    """The encoder a database was built with (the one its manifest `db` records), to embed queries as its chunks
    were: refused where that encoder has changed since (its queries would not be the database's)."""
    from plait.data.retrieval import index_dir, rebuild_command

    recorded = db["encoder"]
    lexical = recorded.get("kind") == "lexical"
    # the lexical encoder is fitted on the corpus whose database the neighbours are found in
    encode, described = encoder_for(recorded["path"], index_dir(data_dir, db), db["chunk"], device,
                                    recorded["dim"] if lexical else None)  # fmt: skip
    if lexical and described["idf_sha256"] != recorded["idf_sha256"]:
        raise ConfigError(f"the lexical encoder of {data_dir} no longer matches its database: build it again")
    now, then = described.get("weights_hash"), recorded.get("weights_hash")
    if not lexical and isinstance(then, str) and now != then:
        raise ConfigError(
            f"the encoder {recorded['path']} has weights {str(now)[:12]} now, the retrieval database of {data_dir} "
            f"was built with weights {then[:12]}: build it again with "
            f"`{rebuild_command(data_dir, recorded, db['chunk'], db['k'])}`"
        )
    return encode


def database_retriever(data_dir: str | Path, model, device: str = "cpu"):
    """A retrieval model's Retriever (plait.data.retrieval) of the database in a prepared directory, with the
    encoder the database was built with (database_encoder)."""
    from plait.data.retrieval import Retriever, read_database

    args = model.args
    if getattr(args, "retrieval_learned", False):  # its own encoder, in memory
        from plait.data.retrieval_live import embed_chunks

        table = learned_table(model)
        encode = partial(embed_chunks, table=table)
        return Retriever(data_dir, encode, chunk=args.retrieval_chunk, k=args.retrieval_k, table=table)
    encode = database_encoder(data_dir, read_database(data_dir), device)
    return Retriever(data_dir, encode, chunk=args.retrieval_chunk, k=args.retrieval_k)


def learned_table(model) -> np.ndarray:
    """A learned retriever's table as it is now (plait.model.retrieval_learned), float32 on the CPU."""
    from plait.model.retrieval import whole

    return whole(model.neighbour_pointer.retriever.table.detach()).float().cpu().numpy()


def checkpoint_retriever(checkpoint: str | Path, model, data: str | Path = "", device: str = "cpu"):
    """The Retriever a retrieval model generates with: the database of `data` (a prepared directory holding a
    database, or its retrieval/ folder) or, when empty, of the prepared directory its checkpoint (or run
    directory) trained on, with the encoder the database was built with. `device` is a spec
    plait.core.hardware.resolve_device reads ("auto" included). Refused, naming the field and both values,
    where the database was built with another tokenizer, chunk size or encoder than the model's (checkpoint_needs),
    and where the run trained on data that has no database (the built-in corpus, a mixture) and none is given."""
    from plait.core.hardware import resolve_device
    from plait.data.retrieval import check_database_fits, read_database
    from plait.engine.checkpoint import read_config, resolve_checkpoint

    found = resolve_checkpoint(checkpoint)
    if not data:
        data = str(read_config(found).data.source)
        if data == "shakespeare" or "," in data:
            raise ConfigError(f"{checkpoint} trained on {data!r}, which has no retrieval database: give --database DIR")
    data_dir = database_dir(data)
    db = read_database(data_dir)
    check_database_fits(data_dir, db, checkpoint_needs(found, model, str(found)))
    return database_retriever(data_dir, model, str(resolve_device(device)))


def check_checkpoint_database(found, model, data_dir: str | Path) -> None:
    """A checkpoint's retrieval model against the database of `data_dir` it is about to read (`plait eval
    CHECKPOINT --data DIR`): refused, as for generation, where built with another tokenizer, chunk size or
    encoder (plait.data.retrieval.check_database_fits)."""
    from plait.data.retrieval import check_database_fits, read_database

    check_database_fits(data_dir, read_database(data_dir), checkpoint_needs(found, model, str(found)))


def database_dir(data: str | Path) -> Path:
    """The prepared directory of a database given by it or by its retrieval/ folder; one that does not exist is
    refused naming it."""
    from plait.data.retrieval import RETRIEVAL_DIR

    path = Path(data).expanduser()
    if not path.is_dir():
        raise ConfigError(f"--database {data} is not a directory: give a prepared directory with a retrieval database")
    if path.name == RETRIEVAL_DIR and (path / "manifest.json").is_file() and (path.parent / "manifest.json").is_file():
        return path.parent
    return path


def checkpoint_needs(found, model, name: str) -> ModelNeeds:
    """What a checkpoint's model needs of a database (plait.data.retrieval.ModelNeeds): its chunk size and k,
    the sha256 of the tokenizer.json it carries, and the encoder of the database it trained with: the record
    its checkpoint carries (DatabaseRecord), else the manifest of the database in the directory it trained on,
    as that is now. Where neither can be read (a checkpoint of an older plait whose training data is gone) the
    encoder is not checked, with a warning: refusing would make the model unusable with any database, and
    nothing the user could rebuild would change that."""
    from plait.data.retrieval import read_database
    from plait.engine.checkpoint import local_file, read_config, read_meta
    from plait.engine.metrics import warn

    tokenizer = local_file(found / "tokenizer.json")
    digest = hashlib.sha256(tokenizer.read_bytes()).hexdigest() if tokenizer is not None else ""
    args = model.args
    record = read_meta(found).get("retrieval")
    encoder = record.get("encoder") if isinstance(record, dict) and record.get("present") else None
    if not isinstance(encoder, dict):
        source = read_config(found).data.source
        try:
            encoder = read_database(source)["encoder"]
        except PlaitError as e:
            warn(f"the database that {name} trained with cannot be read ({first_line(e)}): its encoder is not checked")
            encoder = None
    return ModelNeeds(name, args.retrieval_chunk, args.retrieval_k, digest, encoder)


class DatabaseRecord(Callback):
    """A retrieval run's checkpoints carry the record of the database it trains with (plait.json's "retrieval":
    plait.data.retrieval.database_record), so generation with another database is checked against the encoder
    the model learned with even after the training directory's database is rebuilt or gone. A run resumed from
    a checkpoint whose database was built with another encoder, chunk size or tokenizer than the one it reads
    now is refused by name (its model learned with other neighbours)."""

    def on_start(self, run) -> None:
        if not run.plait_model or not run.cfg.model.retrieval_ids or run.data_dir is None:
            return
        from plait.data.retrieval import check_database_fits, database_record, read_database
        from plait.engine.checkpoint import read_meta

        record = database_record(run.data_dir)
        if run.resumed_from is not None:
            saved = read_meta(run.resumed_from).get("retrieval")
            if isinstance(saved, dict) and saved.get("present") and isinstance(saved.get("encoder"), dict):
                m = run.cfg.model
                needs = ModelNeeds(str(run.resumed_from), m.retrieval_chunk, m.retrieval_k, "", saved["encoder"])
                check_database_fits(run.data_dir, read_database(run.data_dir), needs)
        run.checkpointer.describers.append(lambda step, t: {"retrieval": record})


@dataclass(frozen=True)
class Passage:
    """A database passage a chunk retrieved: its number in the database (the faiss index's id: the chunk's
    number in the database's train stream) and its text (that chunk and its continuation, 2 chunk tokens)."""

    index: int
    text: str


@dataclass(frozen=True)
class ChunkPassages:
    """The passages one chunk of a generated text retrieved: the sample, the chunk's number u (tokens u c to
    (u + 1) c of prompt and continuation together), its text, and its neighbours, nearest first."""

    sample: int
    chunk: int
    text: str
    passages: list[Passage]


def retrieved_passages(retrieve, tok, outs: list[list[int]], used) -> list[ChunkPassages]:
    """Which passages each complete chunk of the generated texts `outs` retrieved, from the `used` that
    plait.engine.generate.generate filled ((sample, chunk, database chunk numbers) per retrieval) with the
    Retriever `retrieve` (its database's train stream holds the passages' tokens); in sample and chunk order."""
    c = retrieve.chunk
    report = []
    for sample, chunk, ids in sorted(used, key=lambda u: (u[0], u[1])):
        passages = [Passage(int(j), tok.decode(retrieve.store.tokens(int(j) * c, (int(j) + 2) * c).tolist()))
                    for j in ids]  # fmt: skip
        text = tok.decode(outs[sample][chunk * c : (chunk + 1) * c])
        report.append(ChunkPassages(sample, chunk, text, passages))
    return report
