"""Every reader validates before it uses: a damaged retrieval database (for training, generation and a
resumed build), a malformed PEFT adapter config, and out-of-range options of plait data retrieve, compress,
eval and the mixture of data sources each meet one clear line naming the file and field, exit 2, and nothing
written (tests/bad_inputs.py's judge). The manifest and adapter-config readers are fuzzed with random JSON:
accepted, or a clean ConfigError."""

from __future__ import annotations

import gzip
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from bad_inputs import judge, run_cli
from plait.cli import main

pytestmark = pytest.mark.filterwarnings("ignore")
faiss = pytest.importorskip("faiss")

CHUNK, K, DIM = 8, 2, 32


@pytest.fixture(scope="module")
def retro(tmp_path_factory, data_dir) -> dict[str, Path]:
    """Speeches of the bundled text prepared with a lexical retrieval database (8-token chunks, k = 2, 32
    dimensions), two other databases of it (16 dimensions; 16-token chunks) for swapped indexes, and a
    retrieval model trained a step on it (for generation)."""
    from plait.data.prepare import bundled_corpus_path, prepare
    from runs import debug_run

    root = tmp_path_factory.mktemp("retro-bad")
    with gzip.open(bundled_corpus_path(), "rt") as f:
        text = json.loads(f.readline())["text"]
    speeches = [s for s in text.split("\n\n") if s.strip()][:600]
    (root / "speeches.jsonl").write_text("\n".join(json.dumps({"text": s}) for s in speeches) + "\n")
    prepare([root / "speeches.jsonl"], root / "data", tokenizer=Path(data_dir) / "tokenizer.json", val_fraction=0.1)
    others = {}
    for name, chunk, dim in (("other_dim", CHUNK, 16), ("other_count", 16, DIM)):
        shutil.copytree(root / "data", root / name)
        assert main(["data", "retrieve", str(root / name), "--encoder", "lexical", "--chunk", str(chunk),
                     "--k", str(K), "--dim", str(dim)]) == 0  # fmt: skip
        others[name] = root / name / "retrieval" / "index.faiss"
    assert main(["data", "retrieve", str(root / "data"), "--encoder", "lexical", "--chunk", str(CHUNK),
                 "--k", str(K), "--dim", str(DIM)]) == 0  # fmt: skip
    settings = debug_run(root / "data", root, "run", 1, *RETRO)
    assert main(["train", *(f"--{s}" for s in settings)]) == 0
    return {"data": root / "data", "run": root / "run", **others}


RETRO = ["model.retrieval_layers=1", f"model.retrieval_chunk={CHUNK}", f"model.retrieval_k={K}",
         "model.retrieval_encoder_layers=1"]  # fmt: skip


class Db:
    """A case's copy of the prepared directory and its database (`data`), damaged by one of DAMAGE."""

    def __init__(self, d: Path, retro: dict[str, Path]):
        self.d, self.retro = d, retro
        self.data = d / "data"
        shutil.copytree(retro["data"], self.data)
        self.db = self.data / "retrieval"

    def manifest(self, value) -> None:
        (self.db / "manifest.json").write_text(value if isinstance(value, str) else json.dumps(value))

    def edit(self, **changes) -> None:
        m = json.loads((self.db / "manifest.json").read_text())
        for key, value in changes.items():
            m.pop(key) if value is None else m.__setitem__(key, value)
        self.manifest(m)

    def neighbours(self, split: str, change) -> None:
        path = self.db / f"{split}_neighbours.npy"
        arr = np.load(path)
        np.save(path, change(arr))

    def cut(self, name: str, keep: float = 0.5) -> None:
        path = self.db / name
        data = path.read_bytes()
        path.write_bytes(data[: int(len(data) * keep)])

    def swap(self, a: str, b: str) -> None:
        (self.db / a).rename(self.db / "swap")
        (self.db / b).rename(self.db / a)
        (self.db / "swap").rename(self.db / b)

    def index_of(self, other: str) -> None:
        shutil.copyfile(self.retro[other], self.db / "index.faiss")

    def index_type(self) -> None:
        index = faiss.IndexFlatL2(DIM)
        index.add(np.zeros((json.loads((self.db / "manifest.json").read_text())["database_chunks"], DIM), "float32"))
        faiss.write_index(index, str(self.db / "index.faiss"))


def _set(arr: np.ndarray, value: int) -> np.ndarray:
    arr = arr.copy()
    arr[3, 1] = value
    return arr


# (id, damage, words the message must contain): the 14 forms of a damaged database
DAMAGE = [
    ("manifest not JSON", lambda db: db.manifest("{chunk: 8"), "manifest.json cannot be read as JSON"),
    ("manifest a JSON list", lambda db: db.manifest([1, 2]), "holds a JSON list, not an object"),
    ("manifest chunk a string", lambda db: db.edit(chunk="8"), 'chunk is "8"'),
    ("manifest without k", lambda db: db.edit(k=None), "k is missing"),
    ("manifest encoder a list", lambda db: db.edit(encoder=[]), "encoder is [] (a JSON list)"),
    ("neighbour files swapped", lambda db: db.swap("train_neighbours.npy", "val_neighbours.npy"), "another split"),
    ("neighbours out of range", lambda db: db.neighbours("train", lambda a: _set(a, 10**6)), "1000000"),
    ("neighbours negative", lambda db: db.neighbours("val", lambda a: _set(a, -4)), "database chunk -4"),
    ("neighbours int64", lambda db: db.neighbours("train", lambda a: a.astype(np.int64)), "int64"),
    ("neighbours cut", lambda db: db.cut("train_neighbours.npy"), "train_neighbours.npy cannot be read"),
    ("index cut", lambda db: db.cut("index.faiss"), "index.faiss is"),
    ("index random bytes", lambda db: (db.db / "index.faiss").write_bytes(os.urandom(4000)), "not an exact"),
    ("index of another dimension", lambda db: db.index_of("other_dim"), "16 dimensions"),
    ("index of another database", lambda db: db.index_of("other_count"), "an index of another database"),
    ("index of another type", lambda db: db.index_type(), "IndexFlatIP"),
]


def _train(db: Db) -> list[str]:
    from runs import debug_run

    return ["train", *(f"--{s}" for s in debug_run(db.data, db.d / "runs", "r", 1, *RETRO))]


def _generate(db: Db) -> list[str]:
    return ["generate", str(db.retro["run"]), "--data", str(db.data), "--max-new-tokens", "4", "--device", "cpu"]


# generation finds neighbours in the index, so it reads every file of the database but the neighbour arrays
READS = [(d, _train) for d in DAMAGE] + [(d, _generate) for d in DAMAGE if not d[0].startswith("neighbour")]


@pytest.mark.parametrize("damage,reader", READS, ids=[f"{d[0]}-{r.__name__[1:]}" for d, r in READS])
def test_a_damaged_retrieval_database_is_refused(damage, reader, retro, tmp_path, capsys):
    name, spoil, words = damage
    db = Db(tmp_path, retro)
    spoil(db)
    judge(name, reader(db), words, tmp_path, capsys, protected=retro["run"])


def test_a_damaged_database_is_built_again_with_overwrite_and_an_interrupted_one_refused(retro, tmp_path, capsys):
    """--overwrite replaces a damaged database whole (the old copy removed only after the new one is in
    place); an interrupted build whose journal counts rows of an array now cut is refused, naming it."""
    from plait.data.retrieval import read_database

    db = Db(tmp_path, retro)
    db.manifest("[1]")
    argv = ["data", "retrieve", str(db.data), "--encoder", "lexical", "--chunk", str(CHUNK), "--dim", str(DIM)]
    assert run_cli([*argv, "--overwrite"], tmp_path) == 0
    assert read_database(db.data)["chunk"] == CHUNK and not list(db.data.glob(".retrieval.old-*"))
    stage = db.data / "retrieval.partial"
    shutil.copytree(db.db, stage)
    built = read_database(db.data)
    settings = {key: built[key] for key in ("chunk", "k", "corpus", "encoder")}
    (stage / "progress.json").write_text(json.dumps({"settings": settings, "done": {"train_embeddings": 64}}))
    data = (stage / "train_embeddings.npy").read_bytes()
    (stage / "train_embeddings.npy").write_bytes(data[: len(data) // 2])
    judge("resumed build, array cut", [*argv, "--overwrite"], "train_embeddings.npy", tmp_path, capsys)


OPTIONS = [
    ("retrieve --chunk 0", ["--chunk", "0"], "--chunk=0 must be a positive integer"),
    ("retrieve --k 0", ["--k", "0"], "--k=0 must be a positive integer"),
    ("retrieve --batch -1", ["--batch", "-1"], "--batch=-1 must be a positive integer"),
    ("retrieve --dim 0", ["--dim", "0"], "--dim=0 must be a positive integer"),
]


@pytest.mark.parametrize("case", OPTIONS, ids=[c[0] for c in OPTIONS])
def test_retrieve_options_out_of_range(case, retro, tmp_path, capsys):
    name, extra, words = case
    db = Db(tmp_path, retro)
    judge(name, ["data", "retrieve", str(db.data), "--encoder", "lexical", "--overwrite", *extra], words, tmp_path,
          capsys)  # fmt: skip
