"""Turn text corpora into tokenized shards: `plait data prepare` and the bundled Shakespeare corpus.

Output layout (format plait-tokens-v1): `tokenizer.json`, `manifest.json`, and per split flat
little-endian token files `train_00000.bin`, `val_00000.bin`, ... in which every document is followed
by EOS. The directory is built under a temporary sibling name and renamed into place at the end, so a
reader never sees a half-written one.
"""

from __future__ import annotations

import contextlib
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
from plait.data.encoding import ShardWriter, sha256_file, tokenize_splits
from plait.data.inputs import Input, documents, expand_inputs, needs_pyarrow
from plait.data.loader import FORMAT, MANIFEST, read_manifest, shard_paths
from plait.data.tokenizer import eos_id, load_tokenizer, train_bpe

TOKENIZER_FILE = "tokenizer.json"

_PROGRESS_MIN_BYTES = 1 << 20  # below this the work takes about a second: a bar would only flicker
_BPE_MAX_BYTES = 256 << 20  # BPE merges stabilise long before this; more text only costs time and memory


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
    exists = ConfigError(f"{out} exists; pass --overwrite or choose another --out")
    if is_nonempty(out) and not overwrite:  # refused before any work
        raise exists
    if not 0 <= val_fraction < 1:
        raise ConfigError(f"val_fraction={val_fraction} must be in [0, 1)")
    if shard_tokens < 1:
        raise ConfigError(f"shard_tokens={shard_tokens} must be positive")
    files = expand_inputs(inputs, s3_endpoint)
    needs_pyarrow(files)
    given_tok = load_tokenizer(tokenizer) if tokenizer is not None else None
    # An interrupted prepare left its work in `stage`, with a journal: the same command continues it.
    stage = out.parent / f".{out.name}.partial"
    signature = _signature(files, tokenizer, vocab_size, val_fraction, text_field, shard_tokens)
    journal = _journal_to_resume(stage, signature, overwrite)
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
    tok = sha256_file(_tokenizer_file(Path(tokenizer))) if tokenizer is not None else None
    return dict(inputs=inputs, tokenizer=tok, vocab_size=vocab_size, val_fraction=val_fraction,
                text_field=text_field, shard_tokens=shard_tokens)  # fmt: skip


def _journal_to_resume(stage: Path, signature: dict[str, Any], overwrite: bool) -> dict[str, Any] | None:
    """The journal of the interrupted prepare in `stage` when it is this same work (None: start afresh, and
    `stage` is emptied); an interrupted prepare of other work is refused unless `overwrite` discards it."""
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
    return journal


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
        writers = {split: ShardWriter(tmp, split, dtype, shard_tokens) for split in ("train", "val")}
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

        tokenize_splits(docs, tok, eos, dtype, writers, val_fraction, workers, tmp / TOKENIZER_FILE, task.tokens,
                         done, checkpoint)  # fmt: skip
    manifest = {
        "format": FORMAT,
        "dtype": "uint16" if dtype.itemsize == 2 else "uint32",
        "vocab_size": vocab,
        "eos_id": eos,
        "splits": {split: w.close() for split, w in writers.items()},
        "sources": [{"path": f.where, "num_documents": n} for f, n in zip(files, counts, strict=True)],
        "tokenizer": TOKENIZER_FILE,
        "tokenizer_sha256": sha256_file(tmp / TOKENIZER_FILE),
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
    if tokenizer is not None and sha256_file(_tokenizer_file(Path(tokenizer))) != manifest["tokenizer_sha256"]:
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
    writers = {s: ShardWriter(out, s, dtype, shard_tokens, first=len(splits[s]["shards"])) for s in splits}
    counts = [0] * len(files)
    val_fraction = manifest.get("val_fraction", val_fraction)  # the prepare's own (older manifests: as given)
    first = sum(s["num_documents"] for s in splits.values())
    with _progress(sum(f.size for f in files)) as start:
        task = start(f"appending ({workers} worker{'s' if workers > 1 else ''})")
        docs = documents(files, text_field, counts, task)
        tokenize_splits(
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
