"""The retrieval database (plait.data.retrieval, `plait data retrieve`): chunks of a prepared corpus, their
embeddings by a frozen plait model, an exact faiss index, and for every chunk its nearest database chunks,
those of its own documents left out; equal to a brute-force search, never anything of the held-out split, an
interrupted build continues to the same files, and bad input is refused naming why."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from plait.cli import main
from plait.core.errors import ConfigError

faiss = pytest.importorskip("faiss")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, data_dir) -> tuple[Path, Path]:
    """(prepared speeches of the bundled text, a debug model trained a little on them as the encoder)."""
    from plait.api import train
    from plait.config import load_config
    from runs import debug_run, prepared_speeches

    root = tmp_path_factory.mktemp("retrieval")
    prepared_speeches(root, 1500, Path(data_dir) / "tokenizer.json")
    train(load_config(None, debug_run(root / "data", root, "encoder", 10)))
    return root / "data", root / "encoder"


def build(data: Path, encoder: Path, **kw):
    from plait.data.loader import read_manifest
    from plait.data.retrieval import build_database
    from plait.lifecycle.retrieval import load_encoder

    encode, described = load_encoder(str(encoder), read_manifest(data))
    return build_database(data, kw.pop("encode", encode), encoder=described, **kw)


def test_neighbours_are_the_nearest_chunks_outside_their_own_documents(corpus, tmp_path):
    from plait.data.retrieval import RETRIEVAL_DIR, chunk_split, neighbours, read_database

    data = tmp_path / "data"
    shutil.copytree(corpus[0], data)
    manifest = build(data, corpus[1], chunk=16, k=3)
    assert read_database(data) == manifest and manifest["database_chunks"] == manifest["chunks"]["train"] - 1
    db = np.load(data / RETRIEVAL_DIR / "train_embeddings.npy")[: manifest["database_chunks"]]
    train = chunk_split(data, "train", 16)
    span_first, span_last = train.first_doc[:-1], train.last_doc[1:]
    for split in ("train", "val"):
        found = neighbours(data, split)
        queries = np.load(data / RETRIEVAL_DIR / f"{split}_embeddings.npy")
        chunks = chunk_split(data, split, 16)
        assert found.shape == (len(chunks.tokens), 3) and found.max() < len(db)
        if split == "train":  # no chunk is offered a neighbour of its own or the next chunk's documents
            answer = np.concatenate([chunks.last_doc[1:], chunks.last_doc[-1:]])
            leaks = (span_first[found] <= answer[:, None]) & (span_last[found] >= chunks.first_doc[:, None])
            assert not leaks.any(), f"{leaks.any(1).sum()} chunks offered their own or the next chunk's text"
        for q in np.random.default_rng(0).choice(len(queries), 40, replace=False):
            scores = db @ queries[q]
            if split == "train":  # its own and the next chunk's documents (chunks, continuations) never offered
                answer = chunks.last_doc[min(q + 1, len(chunks.tokens) - 1)]  # what its neighbours help predict
                own = (span_first <= answer) & (span_last >= chunks.first_doc[q])
                assert not own[found[q]].any()
                scores = np.where(own, -np.inf, scores)
            best = np.sort(scores)[::-1][:3]
            np.testing.assert_allclose(scores[found[q]], best, rtol=1e-5, atol=1e-6)  # the exact nearest


def test_an_interrupted_build_continues_to_the_same_files(corpus, tmp_path):
    from plait.data.loader import read_manifest
    from plait.data.retrieval import RETRIEVAL_DIR
    from plait.lifecycle.retrieval import load_encoder

    whole, cut = tmp_path / "whole", tmp_path / "cut"
    for d in (whole, cut):
        shutil.copytree(corpus[0], d)
    encode, _ = load_encoder(str(corpus[1]), read_manifest(cut))
    every = []
    build(whole, corpus[1], chunk=16, k=2, batch=32, encode=lambda t: every.append(1) or encode(t))
    calls = []

    def dies(tokens):
        calls.append(1)
        if len(calls) == 7:
            raise KeyboardInterrupt
        return encode(tokens)

    with pytest.raises(KeyboardInterrupt):
        build(cut, corpus[1], chunk=16, k=2, batch=32, encode=dies)
    assert (cut / f"{RETRIEVAL_DIR}.partial" / "progress.json").is_file() and not (cut / RETRIEVAL_DIR).exists()
    again = []
    build(cut, corpus[1], chunk=16, k=2, batch=32, encode=lambda t: again.append(1) or encode(t))
    assert len(again) == len(every) - 6  # continued: the six finished batches are not encoded again
    for name in ("train_neighbours.npy", "val_neighbours.npy", "train_embeddings.npy", "index.faiss"):
        assert (whole / RETRIEVAL_DIR / name).read_bytes() == (cut / RETRIEVAL_DIR / name).read_bytes(), name


def test_the_command_reports_its_speed_and_bad_input_is_refused(corpus, tmp_path, capsys):
    from plait.data.loader import read_manifest
    from plait.data.retrieval import read_database
    from plait.lifecycle.retrieval import load_encoder

    data = tmp_path / "data"
    shutil.copytree(corpus[0], data)
    assert main(["data", "retrieve", str(data), "--encoder", str(corpus[1]), "--k", "2"]) == 0
    assert "chunks/s" in capsys.readouterr().out
    assert main(["data", "retrieve", str(data), "--encoder", str(corpus[1])]) == 2
    assert "exists; pass --overwrite" in capsys.readouterr().err
    assert main(["data", "retrieve", str(data), "--encoder", str(corpus[1]), "--k", "100000", "--overwrite"]) == 2
    assert "at most" in capsys.readouterr().err
    other = {**read_manifest(data), "tokenizer_sha256": "0" * 64}
    with pytest.raises(ConfigError, match="another tokenizer than the corpus"):
        load_encoder(str(corpus[1]), other)
    (data / "manifest.json").write_text(json.dumps({**read_manifest(data), "tokenizer_sha256": "0" * 64}))
    with pytest.raises(ConfigError, match="built from other data or another tokenizer"):
        read_database(data)


def test_the_lexical_encoder_is_tf_idf_and_generation_rebuilds_it(corpus, tmp_path, capsys):
    """`--encoder lexical`: each chunk's log(1 + tf) x idf vector (idf over the train chunks) through a seeded
    Gaussian projection, equal to the dense computation; the database records it, and the generation-time
    retriever rebuilds the same encoder from the corpus alone and finds the stored neighbours again."""
    from types import SimpleNamespace

    from plait.data.lexical import lexical_encoder
    from plait.data.loader import read_manifest
    from plait.data.retrieval import chunk_split, neighbours, read_database
    from plait.lifecycle.retrieval import database_retriever

    data = tmp_path / "data"
    shutil.copytree(corpus[0], data)
    encode, described = lexical_encoder(data, 16, dim=64)
    train = chunk_split(data, "train", 16).tokens
    vocab = read_manifest(data)["vocab_size"]
    counts = np.zeros((len(train), vocab))
    np.add.at(counts, (np.repeat(np.arange(len(train)), 16), train.ravel()), 1)
    idf = np.log((len(train) + 1) / ((counts > 0).sum(0) + 1))
    dense = np.log1p(counts) * idf
    dense /= np.linalg.norm(dense, axis=1, keepdims=True)
    projected = dense @ (np.random.default_rng(0).standard_normal((vocab, 64), dtype=np.float32) / np.float32(8.0))
    projected /= np.linalg.norm(projected, axis=1, keepdims=True)
    np.testing.assert_allclose(encode(train[:300]), projected[:300], atol=1e-5)

    assert main(["data", "retrieve", str(data), "--encoder", "lexical", "--dim", "64", "--chunk", "16"]) == 0
    db = read_database(data)
    assert db["encoder"] == described and db["encoder"]["kind"] == "lexical"
    retriever = database_retriever(data, SimpleNamespace(args=SimpleNamespace(retrieval_chunk=16, retrieval_k=2)))
    val = chunk_split(data, "val", 16).tokens
    found, tokens = retriever(val[:50])
    np.testing.assert_array_equal(found, neighbours(data, "val")[:50])
    np.testing.assert_array_equal(tokens[0, 0], np.concatenate([train[found[0, 0]], train[found[0, 0] + 1]]))
    manifest = data / "retrieval" / "manifest.json"
    manifest.write_text(manifest.read_text().replace(described["idf_sha256"], "0" * 64))
    with pytest.raises(ConfigError, match="no longer matches its database"):
        database_retriever(data, SimpleNamespace(args=SimpleNamespace(retrieval_chunk=16, retrieval_k=2)))
    capsys.readouterr()
    assert main(["data", "retrieve", str(data), "--encoder", str(corpus[1]), "--dim", "64", "--overwrite"]) == 2
    assert "lexical encoder's size" in capsys.readouterr().err
    assert main(["data", "retrieve", str(data), "--encoder", "lexical", "--device", "cuda", "--overwrite"]) == 2
    assert "runs on the CPU" in capsys.readouterr().err


def test_a_corpus_without_a_held_out_split_builds_with_no_validation_neighbours(corpus, tmp_path, data_dir):
    """Prepared with --val-fraction 0 (every document in the database): the validation split has no chunks, and
    its embeddings and neighbours are empty arrays of the right width instead of a crash."""
    from plait.data.prepare import prepare
    from plait.data.retrieval import RETRIEVAL_DIR, neighbours

    data = tmp_path / "all"
    prepare([corpus[0].parent / "speeches.jsonl"], data, tokenizer=Path(data_dir) / "tokenizer.json", val_fraction=0)
    manifest = build(data, corpus[1], chunk=16, k=2)
    assert manifest["chunks"]["val"] == 0 and manifest["database_chunks"] > 0
    width = np.load(data / RETRIEVAL_DIR / "train_embeddings.npy").shape[1]
    assert np.load(data / RETRIEVAL_DIR / "val_embeddings.npy").shape == (0, width)
    assert neighbours(data, "val").shape == (0, 2)
