"""The retrieval database's build (plait data retrieve) on the bundled corpus: chunks/s of the encoder and of
the neighbour search, the index's size, written to bench/results/retrieval_db.json.

    python bench/retrieval_db.py [--encoder RUN] [--chunk 64] [--k 2]

Without --encoder, plait's default model (preset tiny, 3.1M) is trained 100 steps on the corpus first (not
timed): an encoder of the corpus's tokenizer, as the database needs.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import torch


def corpus_and_encoder(
    work: Path, encoder: str | None = None, steps: int = 100, documents: str = "plays", chunk: int = 64
):
    """(the prepared bundled corpus in `work`, encode, its description): the encoder given ("lexical": TF-IDF
    over the corpus's chunks of `chunk` tokens), or plait's default model trained `steps` steps on the corpus
    (an encoder of its tokenizer). documents: "plays", the corpus as
    plait prepares it (each play a document: the held-out split is 5 whole plays, whose chunks retrieve from the
    other 37); "speeches", the same text cut at its blank lines (each speech a document, 10% of them held out:
    a held-out speech retrieves from the other speeches of its play), with the same tokenizer; "code", not the
    bundled corpus but text that recurs: this Python's standard library (`python_sources`), each file a
    document, with a tokenizer trained on it (a held-out file retrieves from the other files)."""
    from plait.api import train
    from plait.config import load_config
    from plait.data.prepare import bundled_corpus_path, ensure_prepared, prepare
    from plait.lifecycle.retrieval import encoder_for

    data = work / "data"
    prepared = ensure_prepared("shakespeare", Path.home() / ".cache" / "plait" / "data", 4096)
    if documents == "code":
        (work / "code.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in python_sources()) + "\n")
        prepare([work / "code.jsonl"], data, vocab_size=4096, val_fraction=0.05)
    elif documents == "speeches":
        with gzip.open(bundled_corpus_path(), "rt") as f:
            texts = [json.loads(line)["text"] for line in f if line.strip()]
        speeches = [s for text in texts for s in text.split("\n\n") if s.strip()]
        (work / "speeches.jsonl").write_text("\n".join(json.dumps({"text": s}) for s in speeches) + "\n")
        prepare([work / "speeches.jsonl"], data, tokenizer=prepared / "tokenizer.json", val_fraction=0.1)
    else:
        shutil.copytree(prepared, data)
    if encoder is None:
        overrides = [f"data.source={data}", f"train.steps={steps}", "eval.every_steps=0", "sample.max_new_tokens=0",
                     "log.tensorboard=false", f"run.out_dir={work}", "run.name=encoder"]  # fmt: skip
        train(load_config(None, overrides))
        encoder = str(work / "encoder")
    encode, described = encoder_for(encoder, data, chunk)
    return data, encode, described


CODE_BYTES = 5_000_000
"""About the bundled corpus's size (its 5.1 MB of text)."""
CODE_SKIPPED = {"test", "tests", "idle_test", "site-packages", "encodings", "idlelib", "lib2to3", "pydoc_data"}
"""Left out: test suites, installed packages, and the codecs (100 near-copies of one file, which would make
retrieval look better than it is)."""


def python_sources(limit: int = CODE_BYTES) -> list[str]:
    """This Python's standard-library modules (.py files outside CODE_SKIPPED), in path order, up to `limit`
    bytes: a corpus of code, in which idioms, names and whole passages recur across files."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    texts, size = [], 0
    for path in sorted(root.rglob("*.py")):
        if CODE_SKIPPED & set(path.relative_to(root).parts) or size >= limit:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        size += len(text.encode())
    return texts


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--encoder")
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--json", default="bench/results/retrieval_db.json")
    p.add_argument("--dry-run", action="store_true")
    a = p.parse_args()
    if a.dry_run:
        print(f"would build a database of the bundled corpus: chunk {a.chunk}, k {a.k}")
        return 0
    from plait.data.retrieval import RETRIEVAL_DIR, build_database

    work = Path(tempfile.mkdtemp(prefix="plait-retrieval-bench-"))
    data, encode, described = corpus_and_encoder(work, a.encoder, chunk=a.chunk)
    started = time.perf_counter()
    stages: dict[str, list[float]] = {}  # stage -> [its start (the previous stage's end), its last update, chunks]

    def progress(stage: str, done: int, total: int) -> None:
        now = time.perf_counter()
        if stage not in stages:
            stages[stage] = [max((v[1] for v in stages.values()), default=started), now, 0]
        stages[stage][1:] = [now, done]

    manifest = build_database(data, encode, encoder=described, chunk=a.chunk, k=a.k, batch=a.batch, progress=progress)
    seconds = time.perf_counter() - started
    chunks = sum(manifest["chunks"].values())
    index = (data / RETRIEVAL_DIR / "index.faiss").stat().st_size
    stored = sum(f.stat().st_size for f in (data / RETRIEVAL_DIR).iterdir())
    record = {
        "machine": f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}",
        "stage_chunks_per_s": {k: c / max(t1 - t0, 1e-9) for k, (t0, t1, c) in stages.items()},
        "encoder": described,
        "chunk": a.chunk,
        "k": a.k,
        "chunks": manifest["chunks"],
        "database_chunks": manifest["database_chunks"],
        "seconds": seconds,
        "chunks_per_s": chunks / seconds,
        "index_bytes": index,
        "database_bytes": stored,
        "corpus_token_bytes": sum(f.stat().st_size for f in data.glob("*_0*.bin")),
    }
    print(
        f"{chunks:,} chunks of {a.chunk} tokens (database {manifest['database_chunks']:,}) in {seconds:.1f} s: "
        f"{chunks / seconds:,.0f} chunks/s; index {index / 1e6:.1f} MB, database files {stored / 1e6:.1f} MB"
    )
    for stage, rate in record["stage_chunks_per_s"].items():
        print(f"  {stage}: {rate:,.0f} chunks/s")
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(record, indent=2) + "\n")
    shutil.rmtree(work)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
