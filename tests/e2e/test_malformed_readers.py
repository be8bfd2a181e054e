"""Every reader validates before it uses: a damaged retrieval database (for training, generation and a
resumed build), a malformed PEFT adapter config, and out-of-range options of plait data retrieve, compress,
eval and the mixture of data sources each meet one clear line naming the file and field, exit 2, and nothing
written (tests/bad_inputs.py's judge). The manifest and adapter-config readers are fuzzed with random JSON:
accepted, or a clean ConfigError."""

from __future__ import annotations

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
    from runs import debug_run, prepared_speeches

    root = tmp_path_factory.mktemp("retro-bad")
    prepared_speeches(root, 600, Path(data_dir) / "tokenizer.json")
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


# ------------------------------------------------------------------------------------------------ PEFT adapters
CHAT = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def lora(tmp_path_factory, data_dir) -> dict[str, Path]:
    """A base run, a LoRA run of it on chat data (a tokenizer with a chat template), and its PEFT export."""
    from runs import debug_run

    root = tmp_path_factory.mktemp("peft-bad")
    assert main(["train", *(f"--{s}" for s in debug_run(data_dir, root, "base", 1))]) == 0
    tok = root / "tok"
    tok.mkdir()
    shutil.copyfile(Path(data_dir) / "tokenizer.json", tok / "tokenizer.json")
    (tok / "chat_template.jinja").write_text(CHAT)
    chats = [{"messages": [{"role": "user", "content": f"Say {w}"}, {"role": "assistant", "content": f"{w} {w}."}]}
             for w in ("hello", "speak", "hear", "all", "first", "proceed") * 4]  # fmt: skip
    (root / "chat.jsonl").write_text("\n".join(json.dumps(c) for c in chats) + "\n")
    assert main(["finetune", "prepare", str(root / "chat.jsonl"), "--out", str(root / "chat"), "--tokenizer",
                 str(tok)]) == 0  # fmt: skip
    settings = debug_run(root / "chat", root, "lora", 1, f"finetune.init_from={root / 'base'}",
                         "finetune.lora_rank=4", "data.seq_len=16", "train.global_batch_size=2")  # fmt: skip
    assert main(["train", *(f"--{s}" for s in settings)]) == 0
    out = root / "peft"
    assert main(["ckpt", "export", str(root / "lora"), "--format", "peft", "--out", str(out)]) == 0
    return {"base": root / "base", "lora": root / "lora", "peft": out, "chat": root / "chat"}


def test_the_peft_export_carries_the_chat_template_and_replaces_whole(lora, tmp_path):
    assert (lora["peft"] / "chat_template.jinja").read_text() == CHAT
    out = tmp_path / "peft"
    shutil.copytree(lora["peft"], out)
    (out / "stale.txt").write_text("from the copy replaced")
    argv = ["ckpt", "export", str(lora["lora"]), "--format", "peft", "--out", str(out), "--overwrite"]
    assert run_cli([*argv, "--base", str(lora["base"])], tmp_path) == 0
    assert not (out / "stale.txt").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["peft"]
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(lora["base"])


def _config(**changes):
    def edit(config: dict) -> object:
        for key, value in changes.items():
            config.pop(key) if value is None else config.__setitem__(key, value)
        return config

    return edit


# (id, the adapter_config.json made of the exported one, words the message must contain)
PEFT_CONFIGS = [
    ("config a JSON list", lambda c: [c], "holds a JSON list, not an object"),
    ("config without r", _config(r=None), "r is missing"),
    ("r a string", _config(r="four"), 'r is "four" (a JSON string); it must be an integer of at least 1'),
    ("target_modules a number", _config(target_modules=5), "target_modules is 5 (a JSON integer)"),
    ("lora_alpha a string", _config(lora_alpha="big"), 'lora_alpha is "big"'),
    ("r zero", _config(r=0), "r is 0"),
    ("lora_dropout 2", _config(lora_dropout=2), "lora_dropout is 2"),
]


@pytest.mark.parametrize("case", PEFT_CONFIGS, ids=[c[0] for c in PEFT_CONFIGS])
def test_a_malformed_peft_adapter_config_is_refused(case, lora, data_dir, tmp_path, capsys):
    from runs import debug_run

    name, make, words = case
    adapter = tmp_path / "adapter"
    shutil.copytree(lora["peft"], adapter)
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(lora["base"])
    (adapter / "adapter_config.json").write_text(json.dumps(make(config)))
    settings = debug_run(data_dir, tmp_path / "runs", "r", 1, f"finetune.init_from={adapter}", "finetune.lora_rank=4")
    judge(name, ["train", *(f"--{s}" for s in settings)], words, tmp_path, capsys, protected=lora["base"])


def test_a_peft_export_to_a_mistyped_base_is_refused(lora, tmp_path, capsys):
    for base, words in ((tmp_path / "bsae", "does not exist"), (tmp_path, "is not a model")):
        argv = ["ckpt", "export", str(lora["lora"]), "--format", "peft", "--out", str(tmp_path / "out")]
        judge(f"--base {base.name}", [*argv, "--base", str(base)], words, tmp_path, capsys, protected=lora["lora"])


# ----------------------------------------------------------------------------------- options out of range
def _eval(run: Path, *extra: str) -> list[str]:
    return ["eval", str(run), "--no-perplexity", "--lm-eval", "plait-shakespeare-mc", *extra]


ARGUMENTS = [
    (
        "quantize --group-size 0",
        lambda r, d: ["compress", "quantize", str(r), "--bits", "4", "--group-size", "0", "--out", str(d / "q")],
        "--group-size=0 must be a positive",
    ),  # fmt: skip
    (
        "quantize --group-size -64",
        lambda r, d: ["compress", "quantize", str(r), "--group-size=-64", "--out", str(d / "q")],
        "--group-size=-64",
    ),  # fmt: skip
    ("lm-eval --limit -1", lambda r, d: _eval(r, "--limit=-1"), "--limit=-1 must be at least 1"),
    ("lm-eval --limit 0", lambda r, d: _eval(r, "--limit", "0"), "--limit=0"),
    ("lm-eval --num-fewshot -3", lambda r, d: _eval(r, "--num-fewshot=-3"), "--num-fewshot=-3 must be 0 or more"),
    (
        "mixture weights overflowing",
        lambda r, d: [
            "train",
            "--model.preset=debug",
            "--run.device=cpu",
            f"--data.sources=a={d}/a:1e308,b={d}/b:1e308",
        ],
        "add up to more than a float holds",
    ),  # fmt: skip
]


@pytest.mark.parametrize("case", ARGUMENTS, ids=[c[0] for c in ARGUMENTS])
def test_an_option_out_of_range_is_refused(case, lora, tmp_path, capsys):
    name, argv, words = case
    judge(name, argv(lora["base"], tmp_path), words, tmp_path, capsys, protected=lora["base"])


def test_a_compile_cache_on_s3_with_a_wrong_secret_names_the_bucket(s3, tmp_path, capsys, monkeypatch):
    from plait.core import storage

    monkeypatch.setattr(storage, "_FILESYSTEMS", {})  # a filesystem of the wrong key, not the cached right one
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    argv = ["compile", "--model.preset=debug", "--run.device=cpu", f"--run.out_dir={tmp_path}",
            f"--compile.cache_dir=s3://{s3.bucket}/cache", f"--checkpoint.s3_endpoint={s3.endpoint}"]  # fmt: skip
    judge("compile, wrong secret", argv, f"bucket {s3.bucket}): check the credentials", tmp_path, capsys)


# ------------------------------------------------------------------------------------- fuzz: random JSON
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
MANIFEST_KEYS = ["format", "chunk", "k", "corpus", "chunks", "database_chunks", "encoder", "train", "val", "dim",
                 "path", "kind", "idf_sha256", "r"]  # fmt: skip
FIELDS = st.dictionaries(st.sampled_from(MANIFEST_KEYS), JSON, max_size=8)


def _valid_manifest() -> dict:
    encoder = {"path": "lexical", "kind": "lexical", "dim": 4, "idf_sha256": "x"}
    return {"format": "plait-retrieval-v1", "chunk": 8, "k": 2, "corpus": "c", "chunks": {"train": 10, "val": 3},
            "database_chunks": 9, "encoder": encoder}  # fmt: skip


@settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.one_of(JSON, FIELDS, FIELDS.map(lambda f: {**_valid_manifest(), **f})))
def test_fuzz_the_retrieval_manifest_check(value):
    from plait.core.errors import ConfigError
    from plait.data.retrieval import check_manifest

    try:
        check_manifest(value if isinstance(value, dict) else {"encoder": value}, "manifest.json")
    except ConfigError as e:
        assert "\n" not in str(e) and "manifest.json" in str(e)


PEFT_KEYS = ["peft_type", "r", "lora_alpha", "lora_dropout", "target_modules", "bias", "use_rslora", "use_dora",
             "fan_in_fan_out", "rank_pattern", "modules_to_save", "base_model_name_or_path"]  # fmt: skip
PEFT_VALID = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}


@settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    st.one_of(JSON, st.dictionaries(st.sampled_from(PEFT_KEYS), JSON, max_size=8).map(lambda f: {**PEFT_VALID, **f}))
)
def test_fuzz_the_peft_adapter_config_check(value):
    from plait.core.errors import ConfigError
    from plait.interop.peft import check_peft_config

    try:
        check_peft_config(value, "adapter/adapter_config.json")
    except ConfigError as e:
        assert "\n" not in str(e)


# ---------------------------------------------------------------------------------------------- lm-eval offline
def test_a_hub_task_without_its_data_or_network_is_one_line(lora, tmp_path, capsys, monkeypatch):
    """No network and no cached copy: one line naming the task, the dataset and the offline setting, before
    the harness's retries (not its traceback after 30 s)."""
    pytest.importorskip("lm_eval")
    import time

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # an empty cache
    started = time.perf_counter()
    argv = ["eval", str(lora["base"]), "--no-perplexity", "--lm-eval", "hellaswag"]
    err = judge("hellaswag offline", argv, "--lm-eval hellaswag: its dataset", tmp_path, capsys)
    assert "HF_DATASETS_OFFLINE" in err and time.perf_counter() - started < 60


def test_plaits_own_task_scores_offline(lora, tmp_path, capsys, monkeypatch):
    """plait-shakespeare-mc: named like any task, scored with no network (its data ships with plait)."""
    pytest.importorskip("lm_eval")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    report = tmp_path / "eval.json"
    assert run_cli([*_eval(lora["base"]), "--limit", "8", "--json", str(report)], tmp_path) == 0
    scores = json.loads(report.read_text())["lm_eval"]["plait-shakespeare-mc"]
    assert 0 <= scores["acc,none"] <= 1


def test_an_include_directory_warns_that_its_python_runs(lora, tmp_path, capsys):
    (tmp_path / "tasks").mkdir()
    run_cli([*_eval(lora["base"]), "--limit", "2", "--lm-eval-include", str(tmp_path / "tasks")], tmp_path)
    assert "!function entries run the Python files there" in capsys.readouterr().err


PLAIT_CALLBACKS_TABLE = [  # (value, words of the one line)
    ("nosuchmod:make", "PLAIT_CALLBACKS entry 'nosuchmod:make': expected MODULE:FACTORY"),
    ("plait.api", "PLAIT_CALLBACKS entry 'plait.api': expected MODULE:FACTORY"),
    ("plait.api:nothing_here", "PLAIT_CALLBACKS entry 'plait.api:nothing_here': expected MODULE:FACTORY"),
    ("plait.api:load_config", "made Config, not plait.Callback objects"),
]


@pytest.mark.parametrize(("value", "words"), PLAIT_CALLBACKS_TABLE, ids=[v for v, _ in PLAIT_CALLBACKS_TABLE])
def test_bad_plait_callbacks_is_one_line_exit_2_and_writes_nothing(value, words, tmp_path, capsys, monkeypatch):
    from bad_inputs import judge

    monkeypatch.setenv("PLAIT_CALLBACKS", value)
    argv = ["train", "--model.preset=debug", "--train.steps=1", f"--run.out_dir={tmp_path / 'runs'}"]
    judge(value, argv, words, tmp_path, capsys)
