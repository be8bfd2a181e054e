"""Data pipeline: tokenizer, corpus preparation, windowed dataset and the resumable DP-sharded loader."""

from __future__ import annotations

import gzip
import hashlib
import json
import random
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tokenizers import Tokenizer, models

from plait.core.errors import ConfigError
from plait.data import (
    EOS,
    PAD,
    TokenDataset,
    TokenLoader,
    ensure_prepared,
    eos_id,
    load_tokenizer,
    prepare,
    read_manifest,
    train_bpe,
    unigram_entropy,
)

VOCAB = 320
SEQ = 16
WORDS = [
    "the",
    "king",
    "queen",
    "sword",
    "crown",
    "héllo",
    "naïve",
    "中文",
    "🚀",
    "don't",
    "x\ty",
    "42",
    "!?",
]


def make_docs(n: int = 40, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"doc {i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 200))) + "\n" for i in range(n)]


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as f:
        for i, doc in enumerate(docs):
            f.write(json.dumps({"id": i, field: doc}) + "\n")
    return path


def read_stream(data_dir: Path, split: str) -> np.ndarray:
    manifest = read_manifest(data_dir)
    shards = manifest["splits"][split]["shards"]
    if not shards:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.fromfile(data_dir / s["file"], dtype="<u2") for s in shards]).astype(np.int64)


def decode_docs(data_dir: Path, split: str) -> list[str]:
    tok = load_tokenizer(data_dir / "tokenizer.json")
    stream = read_stream(data_dir, split)
    ends = np.flatnonzero(stream == eos_id(tok))
    assert len(stream) == 0 or ends[-1] == len(stream) - 1, "every document must end with EOS"
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tok.decode(stream[s:e].tolist()) for s, e in zip(starts, ends, strict=True)]


@pytest.fixture(scope="module")
def docs() -> list[str]:
    return make_docs()


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory, docs: list[str]) -> Path:
    """A prepared corpus with small shards, so that windows cross shard boundaries."""
    root = tmp_path_factory.mktemp("prepared")
    prepare([write_jsonl(root / "c.jsonl", docs)], root / "out", vocab_size=VOCAB, shard_tokens=500)
    return root / "out"


def batches(loader: TokenLoader, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = [next(loader) for _ in range(n)]
    loader.close()
    return out


# ---------------------------------------------------------------------------------------------- tokenizer


def test_tokenizer_round_trip_and_specials(docs: list[str]) -> None:
    tok = train_bpe(docs, VOCAB)
    assert tok.token_to_id(EOS) == 0 and tok.token_to_id(PAD) == 1 and eos_id(tok) == 0
    assert tok.get_vocab_size() <= VOCAB
    rng = random.Random(1)
    code_points = [c for c in range(0x0, 0x2FFFF) if not 0xD800 <= c < 0xE000]
    texts = ["", " leading and trailing ", "\x00\x01\xff", bytes(range(256)).decode("latin-1")]
    texts += ["".join(chr(rng.choice(code_points)) for _ in range(rng.randint(1, 60))) for _ in range(50)]
    for text in texts:
        assert tok.decode(tok.encode(text).ids) == text
        assert tok.token_to_id("[UNK]") is None and 0 not in tok.encode(text).ids


def test_tokenizer_training_is_deterministic(docs: list[str]) -> None:
    assert train_bpe(docs, VOCAB).to_str() == train_bpe(iter(docs), VOCAB).to_str()


def test_load_tokenizer_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_tokenizer(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not a valid tokenizer.json"):
        load_tokenizer(tmp_path / "bad.json")


def test_eos_id_fallback_and_missing() -> None:
    tok = Tokenizer(models.WordLevel({"a": 0, "</s>": 1}, unk_token="a"))
    assert eos_id(tok) == 1
    with pytest.raises(ConfigError, match="no end-of-document token"):
        eos_id(Tokenizer(models.WordLevel({"a": 0}, unk_token="a")))


# ---------------------------------------------------------------------------------------------- prepare


def test_prepare_formats_agree_and_manifest(tmp_path: Path, docs: list[str]) -> None:
    txt_dir = tmp_path / "txt"
    txt_dir.mkdir()
    for i, doc in enumerate(docs):
        (txt_dir / f"doc_{i:03d}.txt").write_text(doc, encoding="utf-8")
    jsonl = write_jsonl(tmp_path / "c.jsonl", docs)
    jsonl_gz = write_jsonl(tmp_path / "c.jsonl.gz", docs)
    parquet = tmp_path / "c.parquet"
    pq.write_table(pa.table({"id": list(range(len(docs))), "body": docs}), parquet, row_group_size=7)

    ref = prepare([txt_dir], tmp_path / "out_txt", vocab_size=VOCAB)
    tok_path = tmp_path / "out_txt" / "tokenizer.json"
    assert ref["format"] == "plait-tokens-v1" and ref["dtype"] == "uint16"
    assert ref["eos_id"] == 0 and ref["vocab_size"] == load_tokenizer(tok_path).get_vocab_size()
    assert ref["splits"]["train"]["num_documents"] + ref["splits"]["val"]["num_documents"] == len(docs)
    assert ref["splits"]["val"]["num_documents"] >= 1
    assert [s["num_documents"] for s in ref["sources"]] == [1] * len(docs)
    assert read_manifest(tmp_path / "out_txt") == ref

    # Each split holds the documents in their original order, each followed by EOS.
    train, val = decode_docs(tmp_path / "out_txt", "train"), decode_docs(tmp_path / "out_txt", "val")
    assert sorted(train + val) == sorted(docs)
    assert train == [d for d in docs if d in set(train)] and val == [d for d in docs if d in set(val)]

    table = pa.table({"id": list(range(len(docs))), "body": docs})
    stream, arrow_file = tmp_path / "c.stream.arrow", tmp_path / "c.file.arrow"
    with pa.ipc.new_stream(stream, table.schema) as w:  # stream format, as datasets writes it
        for batch in table.to_batches(max_chunksize=5):
            w.write_batch(batch)
    with pa.ipc.new_file(arrow_file, table.schema) as w:
        w.write_table(table, max_chunksize=9)
    datasets = pytest.importorskip("datasets")
    saved = tmp_path / "saved"  # a datasets Dataset saved to disk in 3 files: read in the dataset's order
    datasets.Dataset.from_dict({"body": docs}).save_to_disk(str(saved), num_shards=3)

    # Same documents through every reader and the same tokenizer: byte-identical shards.
    for name, src, field in [
        ("jsonl", jsonl, "text"),
        ("gz", jsonl_gz, "text"),
        ("pq", parquet, "body"),
        ("arrow stream", stream, "body"),
        ("arrow file", arrow_file, "body"),
        ("datasets save_to_disk", saved, "body"),
    ]:
        m = prepare([src], tmp_path / name, tokenizer=tok_path, text_field=field)
        assert m["splits"] == ref["splits"], name
        assert m["tokenizer_sha256"] == ref["tokenizer_sha256"]
    # Training on the same documents from another format yields the same tokenizer.
    assert prepare([jsonl], tmp_path / "trained", vocab_size=VOCAB)["tokenizer_sha256"] == ref["tokenizer_sha256"]


def test_prepare_shards_and_hashes(prepared: Path) -> None:
    manifest = read_manifest(prepared)
    shards = manifest["splits"]["train"]["shards"]
    assert len(shards) > 2 and all(s["num_tokens"] <= 500 for s in shards)
    assert sum(s["num_tokens"] for s in shards) == manifest["splits"]["train"]["num_tokens"]
    for s in shards:
        data = (prepared / s["file"]).read_bytes()
        assert len(data) == 2 * s["num_tokens"] and hashlib.sha256(data).hexdigest() == s["sha256"]
    assert manifest["splits"]["train"]["num_documents"] == int((read_stream(prepared, "train") == 0).sum())


def test_two_documents_give_a_val_document(tmp_path: Path) -> None:
    m = prepare([write_jsonl(tmp_path / "c.jsonl", make_docs(2))], tmp_path / "out", vocab_size=VOCAB)
    assert m["splits"]["train"]["num_documents"] == 1 and m["splits"]["val"]["num_documents"] == 1


def test_prepare_refuses_to_overwrite(tmp_path: Path, docs: list[str]) -> None:
    src = write_jsonl(tmp_path / "c.jsonl", docs)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    with pytest.raises(ConfigError, match="--overwrite"):
        prepare([src], out, vocab_size=VOCAB)
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "precious"
    prepare([src], out, vocab_size=VOCAB, overwrite=True)
    assert not (out / "keep.txt").exists() and (out / "manifest.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl", "out"], "no temporary dirs left behind"


@pytest.mark.parametrize(
    ("content", "name", "field", "match"),
    [
        ('{"text": ""}\n{"text": "   "}\n', "empty.jsonl", "text", "no non-empty documents"),
        ('{"body": "hi"}\n', "nofield.jsonl", "text", "has no field 'text'"),
        ("{oops\n", "badjson.jsonl", "text", "not valid JSON"),
        ("hello", "notes.md", "text", "unsupported type"),
        (None, "missing.jsonl", "text", "does not exist"),
        (None, "nocol.parquet", "text", "has no column 'text'"),
        ("not arrow", "bad.arrow", "text", "is not an Arrow stream or file"),
        (None, "nocol.arrow", "text", "has no column 'text'"),
    ],
)
def test_prepare_input_errors(tmp_path: Path, content: str | None, name: str, field: str, match: str) -> None:
    path = tmp_path / "in" / name
    path.parent.mkdir()
    if name == "nocol.parquet":
        pq.write_table(pa.table({"body": ["a"]}), path)
    elif name == "nocol.arrow":
        with pa.ipc.new_stream(path, pa.schema([("body", pa.string())])) as w:
            w.write_table(pa.table({"body": ["a"]}))
    elif content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=match) as info:
        prepare([path], tmp_path / "out", vocab_size=VOCAB, text_field=field)
    assert name in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"], "nothing written on failure"


def test_a_dataset_with_splits_asks_for_one(tmp_path: Path, docs: list[str]) -> None:
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"text": docs})
    datasets.DatasetDict(train=ds, test=ds).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ConfigError, match=r"is a dataset with splits \['test', 'train'\]: pass the split"):
        prepare([tmp_path / "dd"], tmp_path / "out", vocab_size=VOCAB)
    m = prepare([tmp_path / "dd" / "train"], tmp_path / "out", vocab_size=VOCAB)
    assert sum(split["num_documents"] for split in m["splits"].values()) == len(docs)


# ---------------------------------------------------------------------------------------------- dataset


def test_dataset_windows_span_shards(prepared: Path) -> None:
    ds = TokenDataset(prepared, "train")
    stream = read_stream(prepared, "train")
    assert ds.num_tokens == len(stream) and ds.vocab_size == read_manifest(prepared)["vocab_size"]
    assert ds.eos_id == 0 and ds.num_samples(SEQ) == len(stream) // (SEQ + 1)
    for i in range(ds.num_samples(SEQ)):
        np.testing.assert_array_equal(ds.sample(i, SEQ), stream[i * (SEQ + 1) : (i + 1) * (SEQ + 1)])
    with pytest.raises(IndexError):
        ds.sample(ds.num_samples(SEQ), SEQ)


def test_dataset_errors(tmp_path: Path, prepared: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        TokenDataset(tmp_path / "nope")
    with pytest.raises(ConfigError, match="plait data prepare"):
        TokenDataset(tmp_path)
    with pytest.raises(ConfigError, match="lower seq_len"):
        TokenLoader(TokenDataset(prepared, "val"), seq_len=10**6, global_batch_size=1)
    broken = tmp_path / "broken"
    broken.mkdir()
    for p in prepared.iterdir():
        (broken / p.name).write_bytes(p.read_bytes())
    (broken / "train_00001.bin").write_bytes(b"\0\0")
    with pytest.raises(ConfigError, match="bytes, manifest says"):
        TokenDataset(broken)
    (broken / "train_00001.bin").unlink()
    with pytest.raises(ConfigError, match="missing"):
        TokenDataset(broken)


# ---------------------------------------------------------------------------------------------- loader


def make_loader(prepared: Path, **kw: object) -> TokenLoader:
    args: dict = {"seq_len": SEQ, "global_batch_size": 8, "seed": 0, "prefetch": 0} | kw
    return TokenLoader(TokenDataset(prepared, "train"), **args)


def test_loader_shapes_and_targets(prepared: Path) -> None:
    for inputs, targets in batches(make_loader(prepared, dp_degree=2, prefetch=2), 3):
        assert inputs.shape == targets.shape == (4, SEQ)
        assert inputs.dtype == targets.dtype == torch.int64 and inputs.is_contiguous()
        assert torch.equal(inputs[:, 1:], targets[:, :-1])


def test_loader_validates_arguments(prepared: Path) -> None:
    with pytest.raises(ValueError, match="multiple of dp_degree"):
        make_loader(prepared, global_batch_size=6, dp_degree=4)
    with pytest.raises(ValueError, match="dp_rank"):
        make_loader(prepared, dp_rank=2, dp_degree=2)


def test_loader_is_deterministic_per_seed(prepared: Path) -> None:
    a, b, c = (batches(make_loader(prepared, seed=s), 4) for s in (0, 0, 1))
    assert all(torch.equal(x[0], y[0]) for x, y in zip(a, b, strict=True))
    assert not all(torch.equal(x[0], y[0]) for x, y in zip(a, c, strict=True))


def test_a_placed_loader_takes_its_share_of_the_groups_batch(prepared: Path) -> None:
    """TokenLoader.place (a fault-tolerant step: engine.replicas): group s of n at the committed frontier takes the
    s-th share of the n groups' batch, keeps its prefetched batches where nothing changed, and goes back to the
    frontier of a step that did not commit."""
    whole = batches(make_loader(prepared, global_batch_size=24), 3)  # 3 groups x 8, as one process reads them
    group = make_loader(prepared, prefetch=2)
    group.place(24, dp_rank=1, dp_degree=3, global_batch_size=24)  # the second step, group 1 of 3
    second = next(group)
    assert torch.equal(second[0], whole[1][0][8:16])
    group.place(48, dp_rank=1, dp_degree=3, global_batch_size=24)  # where it already is: nothing restarts
    assert group._thread is not None and torch.equal(next(group)[0], whole[2][0][8:16])
    group.place(24, dp_rank=0, dp_degree=2, global_batch_size=16)  # a failed step, retried by two groups
    assert torch.equal(next(group)[0], whole[1][0][0:8])
    with pytest.raises(ValueError, match="cannot take a share"):
        group.place(0, dp_rank=3, dp_degree=3, global_batch_size=24)


def window_ids(ds: TokenDataset, rows: torch.Tensor, targets: torch.Tensor) -> list[int]:
    """Map each (inputs, targets) row back to its window index."""
    index = {tuple(ds.sample(i, SEQ).tolist()): i for i in range(ds.num_samples(SEQ))}
    full = torch.cat([rows, targets[:, -1:]], dim=1)
    return [index[tuple(r.tolist())] for r in full]


@pytest.mark.parametrize("shuffle", [True, False])
def test_each_epoch_visits_every_window_once(prepared: Path, shuffle: bool) -> None:
    loader = make_loader(prepared, global_batch_size=7, shuffle=shuffle)
    n = loader.num_windows
    steps = -(-2 * n // 7)  # two epochs; 7 does not divide n, so batches straddle the boundary
    got = batches(loader, steps)
    ids = window_ids(loader.dataset, torch.cat([x for x, _ in got]), torch.cat([y for _, y in got]))
    assert n % 7 != 0
    assert sorted(ids[:n]) == list(range(n)) and sorted(ids[n : 2 * n]) == list(range(n))
    assert (ids[:n] == list(range(n))) == (not shuffle)
    if shuffle:
        assert ids[:n] != ids[n : 2 * n], "each epoch has its own permutation"
    assert loader.epoch == steps * 7 // n and loader.steps_per_epoch == n // 7


@pytest.mark.parametrize("dp", [2, 4])
def test_dp_ranks_partition_the_global_batch(prepared: Path, dp: int) -> None:
    ref = batches(make_loader(prepared), 6)
    ranks = [batches(make_loader(prepared, dp_rank=r, dp_degree=dp, prefetch=1), 6) for r in range(dp)]
    for step, (inputs, targets) in enumerate(ref):
        assert torch.equal(torch.cat([r[step][0] for r in ranks]), inputs)
        assert torch.equal(torch.cat([r[step][1] for r in ranks]), targets)


@pytest.mark.parametrize("prefetch", [0, 3])
def test_exact_resume(prepared: Path, prefetch: int) -> None:
    ref = batches(make_loader(prepared), 10)
    first = make_loader(prepared, prefetch=prefetch)
    for step in range(4):
        assert torch.equal(next(first)[0], ref[step][0])
    time.sleep(0.05)  # let the prefetch thread run ahead: it must not move the saved position
    state = first.state_dict()
    first.close()
    assert state == {"samples_consumed": 32, "seed": 0, "seq_len": SEQ, "global_batch_size": 8}
    resumed = make_loader(prepared, prefetch=prefetch, seed=123)  # the saved seed wins
    next(resumed)  # a position already moved is reset by load_state_dict
    resumed.load_state_dict(state)
    for step, (inputs, targets) in enumerate(batches(resumed, 6), start=4):
        assert torch.equal(inputs, ref[step][0]) and torch.equal(targets, ref[step][1])


def test_resume_with_different_dp_and_batch_size(prepared: Path) -> None:
    ref = batches(make_loader(prepared), 8)
    first = make_loader(prepared)
    batches(first, 3)
    state = first.state_dict()
    ranks = []
    for r in range(2):
        loader = make_loader(prepared, dp_rank=r, dp_degree=2, prefetch=2)
        loader.load_state_dict(state)
        ranks.append(batches(loader, 5))
    for step in range(5):
        assert torch.equal(torch.cat([ranks[0][step][0], ranks[1][step][0]]), ref[3 + step][0])
    # The cursor counts samples, so a larger global batch continues at the same sample.
    bigger = make_loader(prepared, global_batch_size=16)
    bigger.load_state_dict(state)
    assert torch.equal(next(bigger)[0], torch.cat([ref[3][0], ref[4][0]]))
    with pytest.raises(ConfigError, match="seq_len"):
        make_loader(prepared, seq_len=SEQ + 1).load_state_dict(state)


class FailingDataset(TokenDataset):
    def sample(self, i: int, seq_len: int) -> np.ndarray:
        if i == 20:
            raise RuntimeError("disk on fire")
        return super().sample(i, seq_len)


def test_prefetch_thread_errors_reach_the_caller(prepared: Path) -> None:
    loader = TokenLoader(FailingDataset(prepared), seq_len=SEQ, global_batch_size=8, shuffle=False, prefetch=2)
    next(loader), next(loader)  # windows 0..15 are fine
    with pytest.raises(RuntimeError, match="disk on fire"):
        next(loader)  # window 20 is in the third batch
    assert loader.state_dict()["samples_consumed"] == 16
    loader.close()


# ---------------------------------------------------------------------------------------------- bundled


def test_bundled_corpus(tmp_path: Path) -> None:
    start = time.perf_counter()
    data_dir = ensure_prepared("shakespeare", tmp_path, 4096, seq_len_hint=256)
    elapsed = time.perf_counter() - start
    manifest = read_manifest(data_dir)
    assert data_dir == tmp_path / "shakespeare-v4096" and manifest["vocab_size"] == 4096
    assert sum(s["num_documents"] for s in manifest["splits"].values()) == 42
    assert manifest["splits"]["val"]["num_tokens"] > 50_000
    # Uniform over 4096 tokens would be ln(4096) = 8.3 nats; English text under BPE is far more skewed.
    assert 5.0 < unigram_entropy(data_dir) < 7.5
    mtime = (data_dir / "manifest.json").stat().st_mtime_ns
    assert ensure_prepared("shakespeare", tmp_path, 4096) == data_dir
    assert (data_dir / "manifest.json").stat().st_mtime_ns == mtime, "a complete cache is reused"
    assert ensure_prepared(str(data_dir), tmp_path / "other", 4096) == data_dir
    with pytest.raises(ConfigError, match="plait data prepare"):
        ensure_prepared(str(tmp_path / "missing"), tmp_path, 4096)
    print(f"bundled corpus prepared in {elapsed:.1f}s")


def test_workers_write_the_same_bytes_as_one_process(tmp_path: Path, docs: list[str]) -> None:
    """`plait data prepare --workers 2`: the chunks are encoded in two processes and written in order, so the
    shards, their hashes and the train/val split are those of one process."""
    src = write_jsonl(tmp_path / "c.jsonl", docs * 30)  # several encode chunks of 1,024 documents
    one = prepare([src], tmp_path / "one", vocab_size=VOCAB, shard_tokens=20_000)
    tok = tmp_path / "one" / "tokenizer.json"
    two = prepare([src], tmp_path / "two", tokenizer=tok, shard_tokens=20_000, workers=2)
    assert two["splits"] == one["splits"] and len(one["splits"]["train"]["shards"]) > 1
    with pytest.raises(ConfigError, match="--workers=0 must be at least 1"):
        prepare([src], tmp_path / "none", tokenizer=tok, workers=0)


def test_append_adds_new_shards_as_if_prepared_together(tmp_path: Path, docs: list[str]) -> None:
    """`plait data prepare B --out A_DIR --append`: B tokenised with A's tokenizer into new shards after A's;
    the token streams equal preparing A and B together (same held-out documents); nothing of A rewritten."""
    a, b = write_jsonl(tmp_path / "a.jsonl", docs * 3), write_jsonl(tmp_path / "b.jsonl", make_docs(60, seed=1))
    together = prepare([a, b], tmp_path / "together", vocab_size=VOCAB, shard_tokens=3000)
    tok = tmp_path / "together" / "tokenizer.json"
    prepare([a], tmp_path / "grown", tokenizer=tok, shard_tokens=3000)
    before = {p.name: p.read_bytes() for p in (tmp_path / "grown").glob("*.bin")}
    grown = prepare([b], tmp_path / "grown", shard_tokens=3000, append=True, workers=2)
    assert all((tmp_path / "grown" / name).read_bytes() == data for name, data in before.items())
    for split in ("train", "val"):
        assert (read_stream(tmp_path / "grown", split) == read_stream(tmp_path / "together", split)).all(), split
        assert grown["splits"][split]["num_documents"] == together["splits"][split]["num_documents"]
    assert [s["path"] for s in grown["sources"]] == [str(a.resolve()), str(b.resolve())]
    assert read_manifest(tmp_path / "grown") == grown
    with pytest.raises(ConfigError, match="is already in"):
        prepare([b], tmp_path / "grown", append=True)
    other = prepare([b], tmp_path / "other", vocab_size=VOCAB + 40)
    assert other["tokenizer_sha256"] != grown["tokenizer_sha256"]
    with pytest.raises(ConfigError, match="is not the tokenizer"):
        prepare([write_jsonl(tmp_path / "c.jsonl", docs)], tmp_path / "grown", append=True,
                tokenizer=tmp_path / "other" / "tokenizer.json")  # fmt: skip


@pytest.mark.slow
def test_an_interrupted_prepare_resumes_to_the_same_bytes(tmp_path: Path, data_dir: Path) -> None:
    """`plait data prepare` killed mid-way (SIGKILL) leaves its work and a journal beside --out; the same
    command continues from the journal (the documents already written are read, not tokenised, again) and
    publishes what an uninterrupted prepare writes. Another command refuses the leftover work unless
    --overwrite."""
    import signal
    import subprocess
    import sys

    from plait.data.prepare import bundled_corpus_path

    with gzip.open(bundled_corpus_path(), "rt") as f:
        speeches = [s for s in json.loads(f.readline())["text"].split("\n\n") if s.strip()]
    src = write_jsonl(tmp_path / "c.jsonl", speeches * 6)  # ~30 MB: several seconds of tokenising
    tok = str(Path(data_dir) / "tokenizer.json")
    cmd = [sys.executable, "-m", "plait.cli", "data", "prepare", str(src), "--tokenizer", tok]
    straight = prepare([src], tmp_path / "straight", tokenizer=tok, shard_tokens=2**26)
    out = tmp_path / "resumed"
    journal = tmp_path / ".resumed.partial" / "progress.json"
    proc = subprocess.Popen([*cmd, "--out", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if journal.exists() and json.loads(journal.read_text())["documents"] > 3000:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the prepare ended before it could be interrupted"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = json.loads(journal.read_text())["documents"]
    assert 0 < done < len(speeches) * 6 and not out.exists()
    refused = subprocess.run([*cmd[:-2], "--vocab-size", "300", "--out", str(out)], capture_output=True, text=True)
    assert refused.returncode == 2 and "holds an interrupted prepare" in refused.stderr
    finished = subprocess.run([*cmd, "--out", str(out)], capture_output=True, text=True)
    assert finished.returncode == 0, finished.stderr[-1000:]
    assert read_manifest(out) == straight and not journal.parent.exists()
    for split in ("train", "val"):
        assert np.array_equal(read_stream(out, split), read_stream(tmp_path / "straight", split))
