"""Turn text corpora into tokenized shards: `plait data prepare` and the bundled Shakespeare corpus.

Output layout (format plait-tokens-v1): `tokenizer.json`, `manifest.json`, and per split flat
little-endian token files `train_00000.bin`, `val_00000.bin`, ... in which every document is followed
by EOS. The directory is built under a temporary sibling name and renamed into place at the end, so a
reader never sees a half-written one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from tokenizers import Tokenizer

from plait.core.errors import ConfigError
from plait.core.progress import Progress as Lines
from plait.core.publish import is_nonempty, staged_dir
from plait.data.inputs import Input, documents, expand_inputs, needs_pyarrow
from plait.data.loader import FORMAT, MANIFEST, read_manifest, shard_paths
from plait.data.tokenizer import eos_id, load_tokenizer, train_bpe

TOKENIZER_FILE = "tokenizer.json"

_PROGRESS_MIN_BYTES = 1 << 20  # below this the work takes about a second: a bar would only flicker
_BPE_MAX_BYTES = 256 << 20  # BPE merges stabilise long before this; more text only costs time and memory
_ENCODE_CHUNK_CHARS = 4 << 20  # encode_batch parallelises within a chunk; chunks bound memory
_ENCODE_CHUNK_DOCS = 1024
_HASH_CHUNK = 1 << 20


def bundled_corpus_path() -> Path:
    """The bundled corpus: 42 Shakespeare works, JSONL with field "text"."""
    return Path(__file__).parent / "corpus" / "shakespeare.jsonl.gz"


def _first_bytes(docs: Iterator[str], limit: int) -> Iterator[str]:
    total = 0
    for text in docs:
        yield text
        total += len(text)
        if total >= limit:
            return


# ---------------------------------------------------------------------------------------------- output


def _is_val(index: int, text: str, val_fraction: float) -> bool:
    """Deterministic split: sha1 of (index, content) read as a fraction in [0, 1)."""
    digest = hashlib.sha1(f"{index}\0".encode() + text.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < val_fraction


class _ShardWriter:
    """Appends tokens to `{split}_{i:05d}.bin` files of at most `shard_tokens` tokens, hashing as it goes."""

    def __init__(self, out_dir: Path, split: str, dtype: np.dtype, shard_tokens: int, first: int = 0) -> None:
        self.out_dir, self.split, self.dtype, self.shard_tokens = out_dir, split, dtype, shard_tokens
        self.first = first  # the number of the first shard file (after those a prepare being appended to has)
        self.shards: list[dict[str, Any]] = []
        self.num_documents = 0
        self._file: Any = None
        self._hash: Any = None
        self._count = 0

    def write_document(self, ids: np.ndarray) -> None:
        self.num_documents += 1
        while len(ids):
            if self._file is None:
                name = f"{self.split}_{self.first + len(self.shards):05d}.bin"
                self._file, self._hash, self._count = open(self.out_dir / name, "wb"), hashlib.sha256(), 0  # noqa: SIM115
                self.shards.append({"file": name})
            take = min(len(ids), self.shard_tokens - self._count)
            data = ids[:take].tobytes()
            self._file.write(data)
            self._hash.update(data)
            self._count += take
            ids = ids[take:]
            if self._count == self.shard_tokens:
                self._finish_shard()

    def state(self) -> dict[str, Any]:
        """What a resumed prepare restores (restore): the shards, the open one's tokens so far (flushed)."""
        if self._file is not None:
            self._file.flush()
        count = self._count if self._file is not None else None
        return {"shards": [dict(s) for s in self.shards], "open_tokens": count, "num_documents": self.num_documents}

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from `state`: the open shard cut back to what it held then, later shard files removed."""
        self.shards, self.num_documents = [dict(s) for s in state["shards"]], state["num_documents"]
        n = len(self.shards)
        for later in self.out_dir.glob(f"{self.split}_*.bin"):
            if int(later.stem.rsplit("_", 1)[1]) >= self.first + n:
                later.unlink()
        if state["open_tokens"] is not None:
            path = self.out_dir / self.shards[-1]["file"]
            self._file = open(path, "r+b")  # noqa: SIM115 - kept open for the writes that follow
            self._file.truncate(state["open_tokens"] * self.dtype.itemsize)
            self._file.seek(0, os.SEEK_END)
            self._hash, self._count = hashlib.sha256(path.read_bytes()), state["open_tokens"]

    def _finish_shard(self) -> None:
        self._file.close()
        self.shards[-1].update(num_tokens=self._count, sha256=self._hash.hexdigest())
        self._file = None

    def close(self) -> dict[str, Any]:
        if self._file is not None:
            self._finish_shard()
        num_tokens = sum(s["num_tokens"] for s in self.shards)
        return {"shards": self.shards, "num_tokens": num_tokens, "num_documents": self.num_documents}


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_HASH_CHUNK):
            h.update(block)
    return h.hexdigest()


def _chunks(docs: Iterator[str]) -> Iterator[list[str]]:
    chunk: list[str] = []
    chars = 0
    for text in docs:
        chunk.append(text)
        chars += len(text)
        if chars >= _ENCODE_CHUNK_CHARS or len(chunk) >= _ENCODE_CHUNK_DOCS:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


def _encode_chunk(tok: Tokenizer, eos: int, dtype: np.dtype, start: int, chunk: list[str], val_fraction: float):
    """One chunk of documents from document number `start`: (their ids, each followed by EOS, concatenated;
    each one's length; whether each is held out)."""
    # add_special_tokens=False: pretrained post-processors (e.g. BOS) must not differ from EOS packing.
    encoded = tok.encode_batch_fast(chunk, add_special_tokens=False)
    lengths = np.array([len(e.ids) + 1 for e in encoded], dtype=np.int64)
    ids = np.empty(int(lengths.sum()), dtype=dtype)
    at = 0
    for e, n in zip(encoded, lengths, strict=True):
        ids[at : at + n - 1] = e.ids
        ids[at + n - 1] = eos
        at += n
    held = [_is_val(start + i, text, val_fraction) for i, text in enumerate(chunk)]
    return ids, lengths, held


_WORKER: dict[str, Any] = {}


def _worker_init(tokenizer_path: str, eos: int, dtype: str, val_fraction: float) -> None:
    _WORKER.update(tok=Tokenizer.from_file(tokenizer_path), eos=eos, dtype=np.dtype(dtype), val=val_fraction)


def _worker_encode(job: tuple[int, list[str]]):
    w = _WORKER
    return _encode_chunk(w["tok"], w["eos"], w["dtype"], job[0], job[1], w["val"])


def _encoded_chunks(docs, tok, eos, dtype, val_fraction, workers: int, tokenizer_path: Path | None, first: int = 0):
    """The chunks of `docs` (numbered from `first`) encoded, in order: here, or by `workers` processes with at
    most 2 chunks each in flight (reading never runs far ahead of the writing)."""
    jobs = ((start, chunk) for start, chunk in _numbered(_chunks(docs), first))
    if workers <= 1:
        for start, chunk in jobs:
            yield _encode_chunk(tok, eos, dtype, start, chunk, val_fraction)
        return
    import multiprocessing
    from collections import deque

    ctx = multiprocessing.get_context("spawn")  # the tokenizer's thread pool does not survive a fork
    args = (str(tokenizer_path), eos, dtype.str, val_fraction)
    with ctx.Pool(workers, initializer=_worker_init, initargs=args) as pool:
        pending: deque = deque()
        for job in jobs:
            pending.append(pool.apply_async(_worker_encode, (job,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def _numbered(chunks: Iterator[list[str]], start: int = 0) -> Iterator[tuple[int, list[str]]]:
    for chunk in chunks:
        yield start, chunk
        start += len(chunk)


def _tokenize_splits(
    docs: Iterator[str],
    tok: Tokenizer,
    eos: int,
    dtype: np.dtype,
    writers: dict[str, _ShardWriter],
    val_fraction: float,
    workers: int = 1,
    tokenizer_path: Path | None = None,
    on_tokens: Callable[[int], None] = lambda n: None,
    first_index: int = 0,
    on_chunk: Callable[[int], None] = lambda written: None,
) -> None:
    """Encode documents (in `workers` processes), append EOS, and route each to train or val, in the
    documents' order whatever the number of workers.

    The last document is held back so that, if nothing landed in val (small corpora), it can go there.
    """
    pending: tuple[str, np.ndarray] | None = None
    index = 0
    assert workers <= 1 or tokenizer_path is not None
    chunks = _encoded_chunks(docs, tok, eos, dtype, val_fraction, workers, tokenizer_path, first_index)
    for ids, lengths, held in chunks:
        at = 0
        for n, val in zip(lengths, held, strict=True):
            if pending is not None:
                writers[pending[0]].write_document(pending[1])
            pending = ("val" if val else "train", ids[at : at + n])
            at += n
            index += 1
        on_tokens(len(ids))
        on_chunk(first_index + index - 1)  # documents written (the last one is held back)
    if pending is None:
        return
    split, ids = pending
    if val_fraction > 0 and index >= 2 and writers["val"].num_documents == 0:
        split = "val"
    elif writers["train"].num_documents == 0:
        split = "train"
    writers[split].write_document(ids)


class _Task:
    """One phase's progress: bytes of input consumed (called with the running total) and tokens written."""

    def __init__(self, update: Callable[..., None] = lambda **kw: None) -> None:
        self.update, self.started, self.count = update, time.perf_counter(), 0

    def __call__(self, done: int) -> None:
        self.update(completed=done)

    def tokens(self, n: int) -> None:
        self.count += n
        rate = self.count / max(time.perf_counter() - self.started, 1e-9)
        self.update(tokens=f"{self.count:,} tokens, {rate:,.0f} tokens/s")


@contextlib.contextmanager
def _progress(total_bytes: int) -> Iterator[Callable[[str], _Task]]:
    """Yields `start(description) -> task`; a transient bar on stderr for large inputs: bytes read, their
    rate, tokens written and theirs."""
    if total_bytes < _PROGRESS_MIN_BYTES:
        yield lambda description: _Task()
        return
    if not sys.stderr.isatty():  # in a log: a line every few seconds (core.progress), not a bar
        with contextlib.ExitStack() as lines:
            started: list[Lines] = []

            def start_lines(description: str) -> _Task:
                if started:
                    started[-1].close()  # the phase before has ended: its closing line, with its own time
                line = lines.enter_context(Lines(f"data prepare: {description}", total_bytes >> 20, unit="MiB"))
                started.append(line)

                def update(completed: int | None = None, **_) -> None:
                    if completed is not None:
                        line.update(completed >> 20)

                return _Task(update)

            yield start_lines
        return
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
               TextColumn("{task.fields[tokens]}"), TimeRemainingColumn())  # fmt: skip
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:

        def start(description: str) -> _Task:
            task = bar.add_task(description, total=total_bytes, tokens="")
            return _Task(lambda **kw: bar.update(task, **kw))

        yield start


def prepare(
    inputs: Sequence[str | Path],
    out_dir: str | Path,
    *,
    tokenizer: str | Path | None = None,
    vocab_size: int = 4096,
    val_fraction: float = 0.05,
    text_field: str = "text",
    shard_tokens: int = 2**26,
    overwrite: bool = False,
    workers: int = 1,
    append: bool = False,
    s3_endpoint: str = "",
) -> dict[str, Any]:
    """Tokenize `inputs` into `out_dir` (see the module docstring); returns the manifest.

    With `tokenizer=None` a byte-level BPE of `vocab_size` is trained on the inputs (on the first
    256 MiB of text for very large corpora); otherwise the given tokenizer.json is copied and used.
    `workers` processes encode (the output is the same, byte for byte, for any number). With `append`,
    `out_dir` is a prepared directory: the inputs are tokenised with its tokenizer into new shards after its
    own, and its manifest then names them too (one rename: a reader sees the old corpus or the new one).
    Inputs on S3 (s3://bucket/prefix) are reached through `s3_endpoint` (default: AWS_ENDPOINT_URL, then AWS).
    """
    if workers < 1:
        raise ConfigError(f"--workers={workers} must be at least 1")
    if append:
        files = expand_inputs(inputs, s3_endpoint)
        return _append(files, Path(out_dir), tokenizer, text_field, shard_tokens, workers, val_fraction)
    out = Path(out_dir)
    if is_nonempty(out) and not overwrite:  # refused before any work
        raise ConfigError(f"{out} exists; pass --overwrite or choose another --out")
    if not 0 <= val_fraction < 1:
        raise ConfigError(f"val_fraction={val_fraction} must be in [0, 1)")
    if shard_tokens < 1:
        raise ConfigError(f"shard_tokens={shard_tokens} must be positive")
    files = expand_inputs(inputs, s3_endpoint)
    needs_pyarrow(files)
    given_tok = load_tokenizer(tokenizer) if tokenizer is not None else None

    exists = ConfigError(f"{out} exists; pass --overwrite or choose another --out")
    # An interrupted prepare left its work in `stage`, with a journal: the same command continues it.
    stage = out.parent / f".{out.name}.partial"
    signature = _signature(files, tokenizer, vocab_size, val_fraction, text_field, shard_tokens)
    journal = _read_journal(stage)
    if journal is not None and journal["signature"] != signature:
        if not overwrite:
            raise ConfigError(
                f"{stage} holds an interrupted prepare of other inputs or settings: run that command again to "
                f"resume it, or pass --overwrite to discard it"
            )
        journal = None
    if journal is None and stage.exists():
        shutil.rmtree(stage)
    try:
        with staged_dir(out, overwrite=overwrite, exists_error=exists, stage=stage) as tmp:
            manifest = _prepare_into(
                tmp, files, given_tok, tokenizer, vocab_size, val_fraction, text_field, shard_tokens, workers,
                journal=journal, signature=signature,
            )  # fmt: skip
            (tmp / JOURNAL).unlink()
    except BaseException as e:
        # Kept to resume: work interrupted after its first checkpoint (Ctrl-C, a crash; SIGKILL runs nothing
        # here). Bad input is not resumed (fixing it is other work): nothing is left of it.
        if isinstance(e, ConfigError) or _read_journal(stage) is None:
            shutil.rmtree(stage, ignore_errors=True)
        raise
    return manifest


JOURNAL = "progress.json"


def _signature(files, tokenizer, vocab_size, val_fraction, text_field, shard_tokens) -> dict[str, Any]:
    """What makes two prepares the same work (a journal of another is not resumed)."""
    inputs = [[f.where, f.size, f.stamp] for f in files]
    tok = _sha256_file(_tokenizer_file(Path(tokenizer))) if tokenizer is not None else None
    return dict(inputs=inputs, tokenizer=tok, vocab_size=vocab_size, val_fraction=val_fraction,
                text_field=text_field, shard_tokens=shard_tokens)  # fmt: skip


def _read_journal(stage: Path) -> dict[str, Any] | None:
    try:
        return json.loads((stage / JOURNAL).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _write_journal(stage: Path, journal: dict[str, Any]) -> None:
    tmp = stage / f".{JOURNAL}.tmp"
    tmp.write_text(json.dumps(journal))
    tmp.replace(stage / JOURNAL)


def _prepare_into(
    tmp: Path,
    files: list[Input],
    tok: Tokenizer | None,
    tokenizer_path: str | Path | None,
    vocab_size: int,
    val_fraction: float,
    text_field: str,
    shard_tokens: int,
    workers: int = 1,
    journal: dict[str, Any] | None = None,
    signature: dict[str, Any] | None = None,
) -> dict[str, Any]:
    total_bytes = sum(f.size for f in files)
    counts = [0] * len(files)
    with _progress(total_bytes) as start:
        if journal is not None:  # resuming: the tokenizer is the one the interrupted prepare used
            tok = load_tokenizer(tmp / TOKENIZER_FILE)
        elif tok is None:
            docs = documents(files, text_field, [0] * len(files), start("training tokenizer"))
            tok = train_bpe(_first_bytes(docs, _BPE_MAX_BYTES), vocab_size)
            tok.save(str(tmp / TOKENIZER_FILE))
        else:
            assert tokenizer_path is not None
            src = Path(tokenizer_path)
            shutil.copyfile(src / TOKENIZER_FILE if src.is_dir() else src, tmp / TOKENIZER_FILE)
        eos = eos_id(tok)
        vocab = tok.get_vocab_size(with_added_tokens=True)
        dtype = np.dtype("<u2") if vocab <= 65535 else np.dtype("<u4")
        writers = {split: _ShardWriter(tmp, split, dtype, shard_tokens) for split in ("train", "val")}
        task = start(f"tokenizing ({workers} worker{'s' if workers > 1 else ''})")
        docs = documents(files, text_field, counts, task)
        done = 0
        if journal is not None:
            done = journal["documents"]
            for split, w in writers.items():
                w.restore(journal["writers"][split])
            for _ in zip(range(done), docs, strict=False):  # read again, not tokenised
                pass

        def checkpoint(written: int) -> None:
            state = {split: w.state() for split, w in writers.items()}
            _write_journal(tmp, {"signature": signature, "documents": written, "writers": state})

        _tokenize_splits(docs, tok, eos, dtype, writers, val_fraction, workers, tmp / TOKENIZER_FILE, task.tokens,
                         done, checkpoint)  # fmt: skip
    manifest = {
        "format": FORMAT,
        "dtype": "uint16" if dtype.itemsize == 2 else "uint32",
        "vocab_size": vocab,
        "eos_id": eos,
        "splits": {split: w.close() for split, w in writers.items()},
        "sources": [{"path": f.where, "num_documents": n} for f, n in zip(files, counts, strict=True)],
        "tokenizer": TOKENIZER_FILE,
        "tokenizer_sha256": _sha256_file(tmp / TOKENIZER_FILE),
        "val_fraction": val_fraction,  # documents appended later are held out alike
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _append(
    files: list[Input], out: Path, tokenizer, text_field: str, shard_tokens: int, workers: int, val_fraction: float
) -> dict:
    manifest = read_manifest(out)
    for split in manifest["splits"]:
        shard_paths(out, manifest, split)  # every shard there, of its size, before anything is added
    tok_path = out / manifest["tokenizer"]
    if tokenizer is not None and _sha256_file(_tokenizer_file(Path(tokenizer))) != manifest["tokenizer_sha256"]:
        raise ConfigError(
            f"--tokenizer={tokenizer} is not the tokenizer {out} was prepared with: appended documents must use "
            f"the same one (leave --tokenizer out to use {tok_path})"
        )
    if manifest.get("loss_mask"):
        raise ConfigError(f"{out} holds instruction data (plait finetune prepare): --append adds pre-training text")
    known = {s["path"] for s in manifest.get("sources", [])}
    again = [f.where for f in files if f.where in known]
    if again:
        raise ConfigError(f"{again[0]} is already in {out} (its manifest's sources): append only new files")
    tok = load_tokenizer(tok_path)
    dtype = np.dtype(manifest["dtype"]).newbyteorder("<")
    splits = manifest["splits"]
    writers = {s: _ShardWriter(out, s, dtype, shard_tokens, first=len(splits[s]["shards"])) for s in splits}
    counts = [0] * len(files)
    val_fraction = manifest.get("val_fraction", val_fraction)  # the prepare's own (older manifests: as given)
    first = sum(s["num_documents"] for s in splits.values())
    with _progress(sum(f.size for f in files)) as start:
        task = start(f"appending ({workers} worker{'s' if workers > 1 else ''})")
        docs = documents(files, text_field, counts, task)
        _tokenize_splits(
            docs, tok, manifest["eos_id"], dtype, writers, val_fraction, workers, tok_path, task.tokens, first
        )
    for split, w in writers.items():
        added = w.close()
        splits[split]["shards"] += added["shards"]
        splits[split]["num_tokens"] += added["num_tokens"]
        splits[split]["num_documents"] += added["num_documents"]
        for shard in added["shards"]:
            os.chmod(out / shard["file"], 0o644)
    new = [{"path": f.where, "num_documents": n} for f, n in zip(files, counts, strict=True)]
    manifest["sources"] = manifest.get("sources", []) + new
    tmp = out / f".{MANIFEST}.{os.getpid()}"
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.chmod(tmp, 0o644)
    tmp.replace(out / MANIFEST)
    return manifest


def _tokenizer_file(path: Path) -> Path:
    return path / TOKENIZER_FILE if path.is_dir() else path


# ---------------------------------------------------------------------------------------------- use


def _is_complete(data_dir: Path) -> bool:
    try:
        manifest = read_manifest(data_dir)
        for split in manifest["splits"]:
            shard_paths(data_dir, manifest, split)
        return (data_dir / manifest["tokenizer"]).is_file()
    except (ConfigError, KeyError, TypeError):
        return False


def check_cache_dir(cache_dir: str | Path) -> None:
    """data.cache_dir must be a directory (or not exist yet): refused by name otherwise."""
    path = Path(cache_dir).expanduser()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"data.cache_dir={str(cache_dir)!r} is a file; give a directory (it is created if missing)")


def ensure_prepared(source: str, cache_dir: str | Path, vocab_size: int, seq_len_hint: int = 0) -> Path:
    """Prepared data directory for `source`: "shakespeare" (prepared once under `cache_dir`) or a directory.

    `seq_len_hint`, if positive, checks that the train split holds at least one window of that length.
    Concurrent callers are safe: each prepares privately and the first to publish wins.
    """
    if source == "shakespeare":
        check_cache_dir(cache_dir)
        data_dir = Path(cache_dir) / f"shakespeare-v{vocab_size}"
        if not _is_complete(data_dir):
            try:
                # A stale or damaged cache is replaced; a complete one is never touched.
                prepare([bundled_corpus_path()], data_dir, vocab_size=vocab_size, overwrite=data_dir.exists())
            except ConfigError:
                if not _is_complete(data_dir):  # otherwise another process published first: use its result
                    raise
    else:
        data_dir = Path(source)
        if not (data_dir / MANIFEST).is_file():
            raise ConfigError(
                f"data source {source!r} is neither 'shakespeare' nor a prepared directory: "
                f"run `plait data prepare INPUTS --out DIR` and pass DIR"
            )
    manifest = read_manifest(data_dir)
    num_train = manifest["splits"]["train"]["num_tokens"]
    if seq_len_hint > 0 and num_train < seq_len_hint + 1:
        raise ConfigError(
            f"{data_dir} has {num_train} train tokens but seq_len={seq_len_hint} needs at least "
            f"{seq_len_hint + 1}: lower seq_len or prepare more data"
        )
    return data_dir


def unigram_entropy(data_dir: str | Path, split: str = "train") -> float:
    """Entropy (nats/token) of a split's token frequencies: the loss of the best context-free model."""
    manifest = read_manifest(data_dir)
    counts = np.zeros(manifest["vocab_size"], dtype=np.int64)
    dtype = np.dtype(manifest["dtype"]).newbyteorder("<")
    for path, n in shard_paths(data_dir, manifest, split):
        if n == 0:
            continue
        tokens = np.memmap(path, dtype=dtype, mode="r")
        for lo in range(0, n, 1 << 24):  # chunks keep the int64 temporaries bounded
            counts += np.bincount(tokens[lo : lo + (1 << 24)], minlength=len(counts))
    total = counts.sum()
    if total == 0:
        raise ConfigError(f"split {split!r} of {data_dir} has no tokens")
    p = counts[counts > 0] / total
    return float(-(p * np.log(p)).sum())
