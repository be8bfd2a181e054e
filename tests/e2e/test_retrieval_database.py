"""A retrieval model and the databases it reads (plait generate --database DIR): any database built with the
model's encoder, tokenizer and chunk size serves it, and the passages each chunk retrieved are reported (so a
database of other text shows other passages); one built with another is refused by name when it is used, with
the field, both values and the `plait data retrieve` command that builds a fitting one. The corpus and the
encoder model are tests/e2e/test_retrieval.py's `corpus` fixture."""

from __future__ import annotations

import gzip
import json
import re
import shutil
from pathlib import Path

import pytest

from bad_inputs import judge, run_cli
from plait.cli import main
from test_retrieval import corpus  # noqa: F401  (the prepared speeches and the encoder model, a fixture)

pytestmark = pytest.mark.filterwarnings("ignore")
faiss = pytest.importorskip("faiss")

CHUNK, K, DIM = 8, 2, 32
RETRO = ["model.retrieval_layers=1", f"model.retrieval_chunk={CHUNK}", f"model.retrieval_k={K}",
         "model.retrieval_encoder_layers=1"]  # fmt: skip


def _other_text(count: int) -> list[str]:
    """Text the model never saw: the first `count` speeches of the bundled plays with their words reversed."""
    from plait.data.prepare import bundled_corpus_path

    with gzip.open(bundled_corpus_path(), "rt") as f:
        text = json.loads(f.readline())["text"]
    return [" ".join(reversed(s.split())) for s in text.split("\n\n") if s.strip()][:count]


def _prepare(root: Path, name: str, speeches: list[str], tokenizer: Path | None) -> Path:
    from plait.data.prepare import prepare

    (root / f"{name}.jsonl").write_text("\n".join(json.dumps({"text": s}) for s in speeches) + "\n")
    kw = {"tokenizer": tokenizer} if tokenizer is not None else {"vocab_size": 512}
    prepare([root / f"{name}.jsonl"], root / name, val_fraction=0.1, **kw)
    return root / name


def _retrieve(data: Path, encoder: str = "lexical", chunk: int = CHUNK, *extra: str) -> Path:
    dim = ["--dim", str(DIM)] if encoder == "lexical" else []
    assert main(["data", "retrieve", str(data), "--encoder", encoder, "--chunk", str(chunk), "--k", str(K),
                 *dim, *extra]) == 0  # fmt: skip
    return data


@pytest.fixture(scope="module")
def dbs(corpus, tmp_path_factory) -> dict[str, Path]:  # noqa: F811
    """A retrieval model trained 2 steps on the speeches with a lexical database (8-token chunks, 32
    dimensions), and databases to give it: of other text (the same encoder: it fits), of another chunk
    size, of another encoder (the encoder model), of another tokenizer (a BPE of 512 trained on the text)."""
    from plait.api import train
    from plait.config import load_config
    from runs import debug_run

    root = tmp_path_factory.mktemp("retrieval-dbs")
    tokenizer = corpus[0] / "tokenizer.json"
    data = root / "data"
    shutil.copytree(corpus[0], data)
    _retrieve(data)
    train(load_config(None, debug_run(data, root, "run", 2, *RETRO)))
    other_text = _retrieve(_prepare(root, "other_text", _other_text(500), tokenizer))
    other_chunk = root / "other_chunk"
    shutil.copytree(other_text, other_chunk)
    _retrieve(other_chunk, "lexical", 16, "--overwrite")
    other_encoder = root / "other_encoder"
    shutil.copytree(other_text, other_encoder)
    _retrieve(other_encoder, str(corpus[1]), CHUNK, "--overwrite")
    other_tokenizer = _retrieve(_prepare(root, "other_tokenizer", _other_text(300), None))
    no_database = root / "no_database"
    shutil.copytree(corpus[0], no_database)
    return {"root": root, "run": root / "run", "data": data, "other_text": other_text, "other_chunk": other_chunk,
            "other_encoder": other_encoder, "other_encoder_model": corpus[1], "other_tokenizer": other_tokenizer,
            "no_database": no_database}  # fmt: skip


def _generate(run: Path, *extra: str) -> list[str]:
    return ["generate", str(run), "--prompt", "ROMEO:", "--max-new-tokens", "14", "--temperature", "0",
            "--device", "cpu", *extra]  # fmt: skip


# (id, the --database given, words the one line must contain)
REFUSED = [
    ("another tokenizer", "other_tokenizer", "was built with tokenizer"),
    ("another chunk size", "other_chunk", "was built with chunk=16 tokens"),
    ("another encoder", "other_encoder", "trained with neighbours found by encoder lexical (dim 32)"),
    ("a missing directory", "missing", "--database"),
    ("a directory without a database", "no_database", "has no retrieval database"),
    ("a file, not a directory", "file", "not a directory"),
]


@pytest.mark.parametrize("case", REFUSED, ids=[c[0] for c in REFUSED])
def test_a_database_the_model_cannot_use_is_refused_by_name(case, dbs, tmp_path, capsys):
    name, which, words = case
    (tmp_path / "file").write_text("not a database\n")
    database = dbs.get(which, tmp_path / which)
    err = judge(name, _generate(dbs["run"], "--database", str(database)), words, tmp_path, capsys,
                protected=dbs["root"])  # fmt: skip
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    if which.startswith("other_"):  # the database by name, and the command that builds one the model can use
        assert str(database) in err and f"--encoder lexical --dim {DIM} --chunk {CHUNK}" in err, err


def test_a_training_run_refuses_a_database_of_another_chunk_size_naming_the_rebuild(dbs, tmp_path, capsys):
    from runs import debug_run

    settings = debug_run(dbs["other_chunk"], tmp_path / "runs", "r", 1, *RETRO)
    argv = ["train", *(f"--{s}" for s in settings)]
    words = "model.retrieval_chunk=8 but the retrieval database"
    err = judge("train, another chunk size", argv, words, tmp_path, capsys, protected=dbs["root"])
    assert f"plait data retrieve {dbs['other_chunk']} --encoder lexical --dim {DIM} --chunk 8" in err, err


def test_evaluation_and_a_resumed_run_refuse_a_database_of_another_encoder(dbs, tmp_path, capsys):
    """plait eval CHECKPOINT --data DIR checks the database as generation does; a run resumed from a checkpoint
    whose record names the lexical encoder refuses its data's database rebuilt meanwhile with the encoder
    model (its neighbours would be another encoder's), naming both."""
    from plait.api import train
    from plait.config import load_config
    from runs import debug_run

    words = "trained with neighbours found by encoder lexical (dim 32)"
    argv = ["eval", str(dbs["run"]), "--data", str(dbs["other_encoder"]), "--batches", "1", "--device", "cpu"]
    judge("eval, another encoder", argv, words, tmp_path, capsys, protected=dbs["root"])
    data = tmp_path / "data"
    shutil.copytree(dbs["other_text"], data)
    train(load_config(None, debug_run(data, tmp_path, "r", 1, *RETRO)))
    _retrieve(data, str(dbs["other_encoder_model"]), CHUNK, "--overwrite")
    capsys.readouterr()
    assert run_cli(["train", *(f"--{s}" for s in debug_run(data, tmp_path, "r", 2, *RETRO))], tmp_path) == 2
    err = capsys.readouterr().err
    assert words in err and f"database of {data} was built with encoder" in err and "Traceback" not in err, err


def _passages(printed: str) -> list[tuple[int, str]]:
    return [(int(m[1]), m[2]) for m in re.finditer(r"database chunk (\d+): (.*)", printed)]


def test_generation_reports_its_passages_and_another_database_changes_them(dbs, capsys):
    """The same checkpoint, with no training, reads a database of other text built with its encoder: each
    chunk's passages are reported (their numbers and first words), they are the other database's, and they
    differ from those of the database it trained with; the Python function the command calls gives the same."""
    from plait.cli.generate import PREVIEW_CHARS
    from plait.engine.checkpoint import read_meta, resolve_checkpoint
    from plait.engine.generate import generate, load_for_generation
    from plait.lifecycle.retrieval import checkpoint_retriever, retrieved_passages

    run = dbs["run"]
    assert read_meta(resolve_checkpoint(run))["retrieval"]["encoder"]["kind"] == "lexical"  # the record it carries
    capsys.readouterr()
    assert main(_generate(run)) == 0
    trained = capsys.readouterr().out
    assert f"passages retrieved from {dbs['data']}" in trained, trained
    assert run_cli(_generate(run, "--database", str(dbs["other_text"] / "retrieval")), run) == 0
    other = capsys.readouterr().out
    assert f"passages retrieved from {dbs['other_text']} (chunks of {CHUNK} tokens, {K} each)" in other, other
    assert _passages(trained) and len(_passages(other)) == len(_passages(trained))
    assert _passages(other) != _passages(trained)

    model, tok, _ = load_for_generation(run, "cpu")
    retrieve, used = checkpoint_retriever(run, model, dbs["other_text"], "cpu"), []
    outs = generate(model, [tok.encode("ROMEO:").ids], max_new_tokens=14, temperature=0, retrieve=retrieve, used=used)
    report = retrieved_passages(retrieve, tok, outs, used)
    assert [r.chunk for r in report] == list(range(len(outs[0]) // CHUNK)) and len(report) >= 2
    listed = [(p.index, p.text) for r in report for p in r.passages]
    assert [i for i, _ in listed] == [i for i, _ in _passages(other)]
    for (index, text), (_, shown) in zip(listed, _passages(other), strict=True):
        assert shown == (repr(text[:PREVIEW_CHARS]) + "..." if len(text) > PREVIEW_CHARS else repr(text))
        tokens = retrieve.store.tokens(index * CHUNK, (index + 2) * CHUNK).tolist()
        assert text == tok.decode(tokens)  # the other database's own text
