"""Neighbours found in another corpus's database (`plait data retrieve DATA --database OTHER`, RETRO's setting:
the database is other text than the training corpus): each chunk of DATA gets OTHER's nearest chunks, found with
OTHER's own encoder and chunk size; a model trains on DATA reading OTHER's passages and generates with them; a
database rebuilt under the neighbours is refused at training, and every bad request is refused by name. The
databases are tests/e2e/test_retrieval_database.py's `dbs` fixture."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from bad_inputs import judge
from plait.cli import main
from test_retrieval import corpus  # noqa: F401  (a fixture the next one needs)
from test_retrieval_database import CHUNK, RETRO, K, _generate, _retrieve, dbs  # noqa: F401

pytestmark = pytest.mark.filterwarnings("ignore")
faiss = pytest.importorskip("faiss")


@pytest.fixture(scope="module")
def reading(dbs, tmp_path_factory) -> dict[str, Path]:  # noqa: F811
    """The speeches (no database of their own) with their neighbours found in the other text's database (a copy,
    so that a test may rebuild it), and a retrieval model trained 2 steps on them."""
    from plait.api import train
    from plait.config import load_config
    from runs import debug_run

    root = tmp_path_factory.mktemp("other-corpus")
    other, data = root / "other", root / "data"
    shutil.copytree(dbs["other_text"], other)
    shutil.copytree(dbs["no_database"], data)
    assert main(["data", "retrieve", str(data), "--database", str(other), "--k", str(K)]) == 0
    train(load_config(None, debug_run(data, root, "run", 2, *RETRO)))
    return {"root": root, "other": other, "data": data, "run": root / "run"}


def test_each_chunk_gets_the_other_databases_nearest_chunks_and_a_model_reads_them(reading, capsys):
    """DATA's neighbours are OTHER's database chunks nearest to each DATA chunk under OTHER's encoder (its
    Retriever's search, the same exact index); the training windows carry OTHER's text as neighbours; the
    model trained on them generates with OTHER's passages, reported as OTHER's."""
    from plait.data.loader import TokenDataset
    from plait.data.retrieval import RetrievalDataset, chunk_split, neighbours, read_database
    from plait.engine.generate import load_for_generation
    from plait.lifecycle.retrieval import database_retriever

    data, other = reading["data"], reading["other"]
    db = read_database(data)
    assert db["database"] == {"dir": str(other.resolve()), "corpus": read_database(other)["corpus"]}
    assert db["chunk"] == CHUNK and db["database_chunks"] == read_database(other)["database_chunks"]
    model, _, _ = load_for_generation(reading["run"], "cpu")
    retrieve = database_retriever(other, model)
    for split in ("train", "val"):
        found = neighbours(data, split)
        chunks = chunk_split(data, split, CHUNK).tokens
        assert len(found) == len(chunks) > 0
        np.testing.assert_array_equal(found[:200], retrieve(chunks[:200])[0])
    windows = RetrievalDataset(data, "train", chunk=CHUNK, k=K)
    store = TokenDataset(other, "train")
    first = neighbours(data, "train")[: 32 // CHUNK]
    want = np.concatenate([store.tokens(int(j) * CHUNK, (int(j) + 2) * CHUNK) for j in first.reshape(-1)])
    np.testing.assert_array_equal(windows.neighbour_tokens(0, 32), want)
    capsys.readouterr()
    assert main(_generate(reading["run"])) == 0
    assert f"passages retrieved from {other.resolve()}" in capsys.readouterr().out


def test_a_database_rebuilt_under_the_neighbours_is_refused_at_training(reading, tmp_path, capsys):
    """OTHER built again (here with another chunk size) after DATA's neighbours were found in it: their chunk
    numbers name other chunks now, so training on DATA is refused, naming the command that finds them again."""
    root = tmp_path / "rebuilt"
    shutil.copytree(reading["root"] / "other", root / "other")
    shutil.copytree(reading["root"] / "data", root / "data")
    data, other = root / "data", root / "other"
    shutil.rmtree(data / "retrieval")
    assert main(["data", "retrieve", str(data), "--database", str(other), "--k", str(K)]) == 0
    _retrieve(other, "lexical", 16, "--overwrite")
    argv = ["train", f"--data.source={data}", "--model.preset=debug", "--train.steps=1", f"--run.out_dir={root}",
            *[f"--{c}" for c in RETRO]]  # fmt: skip
    judge("rebuilt", argv, "has been built again since", root, capsys)
    err = judge("rebuilt", argv, f"plait data retrieve {data} --database {other.resolve()} --overwrite", root, capsys)
    assert len([line for line in err.splitlines() if line.strip()]) == 1


# (id, the command's arguments after DATA, words the one line must contain)
REFUSED = [
    ("a directory without a database", ["--database", "{no_database}"], "has no retrieval database"),
    ("a missing directory", ["--database", "{root}/missing"], "has no retrieval database"),
    ("the directory itself", ["--database", "{self}"], "itself: build its own database with --encoder"),
    ("neighbours found elsewhere", ["--database", "{reading}"], "its own neighbours were found in"),
    ("another tokenizer", ["--database", "{other_tokenizer}"], "prepared with tokenizer"),
    ("an encoder too", ["--database", "{other_text}", "--encoder", "lexical"], "drop --encoder"),
    ("a chunk size too", ["--database", "{other_text}", "--chunk", "16"], "drop --chunk"),
    ("too many neighbours", ["--database", "{other_text}", "--k", "100000000"], "a smaller --k"),
    ("no k", ["--database", "{other_text}", "--k", "0"], "--k=0 must be a positive integer"),
    ("neither", [], "needs --encoder (lexical, or a model), or --database OTHER"),
]


@pytest.mark.parametrize("case", REFUSED, ids=[c[0] for c in REFUSED])
def test_a_bad_request_is_refused_by_name(case, dbs, reading, tmp_path, capsys):  # noqa: F811
    name, extra, words = case
    data = tmp_path / "data"
    shutil.copytree(dbs["no_database"], data)
    if name == "the directory itself":
        _retrieve(data)
    places = {**{key: str(value) for key, value in dbs.items()}, "self": str(data), "reading": str(reading["data"])}
    argv = ["data", "retrieve", str(data), *[e.format(**places) for e in extra]]
    err = judge(name, argv, words, tmp_path, capsys, protected=dbs["root"])
    assert len([line for line in err.splitlines() if line.strip()]) == 1, err
