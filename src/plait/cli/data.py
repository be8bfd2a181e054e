"""`plait data prepare INPUTS --out DIR`: tokenise a corpus into memory-mapped token shards; `plait data retrieve
DIR --encoder MODEL`: its retrieval database, or `--database OTHER`: its chunks' neighbours in another's."""

from __future__ import annotations

from plait.cli.args import PlaitParser
from plait.core.errors import ConfigError


def _parser() -> PlaitParser:
    parser = PlaitParser(prog="plait data", description="Prepare data for training.")
    sub = parser.add_subparsers(dest="action", required=True)
    p = sub.add_parser("prepare", help="Tokenise text / JSONL / Parquet / Arrow into memory-mapped token shards.")
    p.add_argument(
        "inputs",
        nargs="+",
        help="Files, directories (.txt, .jsonl, .jsonl.gz, .parquet, .arrow), datasets saved with save_to_disk, "
        "or s3://bucket/prefix.",
    )
    p.add_argument("--out", required=True, help="Output directory (must not exist or be empty).")
    p.add_argument("--tokenizer", help="An existing tokenizer.json; default: train a byte-level BPE.")
    p.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size when training one.")
    p.add_argument("--val-fraction", type=float, default=0.05, help="Share of documents held out.")
    p.add_argument("--text-field", default="text", help="Field / column holding the text in JSONL / Parquet / Arrow.")
    p.add_argument(
        "--s3-endpoint",
        default="",
        help="Endpoint URL of s3:// inputs (e.g. a MinIO server); default AWS_ENDPOINT_URL, else AWS itself.",
    )
    p.add_argument("--overwrite", action="store_true", help="Replace an existing output directory.")
    p.add_argument(
        "--workers", type=int, default=1, help="Processes that tokenise (the output is the same for any number)."
    )
    p.add_argument(
        "--append",
        action="store_true",
        help="Add the inputs to the prepared directory --out (its tokenizer; new shards; nothing re-tokenised).",
    )
    r = sub.add_parser(
        "retrieve",
        help="Build a prepared directory's retrieval database: chunks, their frozen embeddings, a faiss index "
        "and each chunk's nearest neighbours (RETRO).",
    )
    r.add_argument("data", help="A prepared directory (plait data prepare): the database sits beside its shards.")
    r.add_argument("--encoder",
                   help="lexical (TF-IDF of the corpus's tokens, nothing to train), or a frozen model: plait "
                        "checkpoint / run or HF decoder directory.")  # fmt: skip
    r.add_argument("--database", metavar="OTHER",
                   help="Instead of a database of its own: find each chunk's neighbours in the database of another "
                        "prepared directory OTHER (built first with --encoder), with OTHER's encoder and chunk "
                        "size (RETRO: a database of other text than the training corpus).")  # fmt: skip
    r.add_argument("--dim", type=int, help="The lexical encoder's dimensions (default 512).")
    r.add_argument("--chunk", type=int, help="Tokens per chunk (default 64; RETRO: 64).")
    r.add_argument("--k", type=int, default=2, help="Neighbours per chunk.")
    r.add_argument("--batch", type=int, default=64, help="Chunks per encoder forward.")
    r.add_argument("--device", default="cpu")
    r.add_argument("--overwrite", action="store_true", help="Build again over an existing database.")
    return parser


def cmd_data(argv: list[str]) -> int:
    a = _parser().parse_args(argv)
    if a.action == "retrieve":
        return _retrieve(a)
    if a.append and a.overwrite:
        raise ConfigError("--append adds to --out and --overwrite replaces it: give one")
    if a.vocab_size < 260:
        raise ConfigError(f"--vocab-size={a.vocab_size} is too small: at least 260 (256 bytes + specials)")
    if not 0 < a.val_fraction < 1:
        raise ConfigError(f"--val-fraction={a.val_fraction} must be between 0 and 1, e.g. 0.05")
    import time
    from pathlib import Path

    from plait.data import prepare
    from plait.data.prepare import expand_inputs

    size = sum(f.size for f in expand_inputs(a.inputs, a.s3_endpoint))
    started = time.perf_counter()
    manifest = prepare(
        a.inputs,
        a.out,
        tokenizer=a.tokenizer,
        vocab_size=a.vocab_size,
        val_fraction=a.val_fraction,
        text_field=a.text_field,
        overwrite=a.overwrite,
        workers=a.workers,
        append=a.append,
        s3_endpoint=a.s3_endpoint,
    )
    seconds = time.perf_counter() - started
    splits = manifest["splits"]
    tokens = splits["train"]["num_tokens"] + splits["val"]["num_tokens"]
    print(
        f"prepared {size / 1e6:,.1f} MB in {seconds:.1f} s with {a.workers} worker{'s' if a.workers > 1 else ''}: "
        f"{size / 1e6 / seconds:,.2f} MB/s, {tokens / seconds:,.0f} tokens/s\n"
        f"wrote {Path(a.out)}: train {splits['train']['num_tokens']:,} tokens / "
        f"{splits['train']['num_documents']} documents, val {splits['val']['num_tokens']:,} tokens / "
        f"{splits['val']['num_documents']} documents, vocabulary {manifest['vocab_size']}\n"
        f"train on it with: plait train --data.source={a.out} --model.vocab_size={manifest['vocab_size']}"
    )
    return 0


def _retrieve(a) -> int:
    import contextlib
    import sys
    import time

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeRemainingColumn

    from plait.core.progress import Progress as Lines
    from plait.data.retrieval import RETRIEVAL_DIR

    build = _other_database(a) if a.database else _own_database(a)
    started = time.perf_counter()
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[rate]}"),
               TimeRemainingColumn()]  # fmt: skip
    terminal = sys.stderr.isatty()  # a bar redrawn in place; in a log, a line every few seconds (core.progress)
    with Progress(*columns, transient=True, disable=not terminal) as bar, contextlib.ExitStack() as lines:
        tasks: dict[str, tuple[TaskID, float]] = {}
        logged: dict[str, Lines] = {}

        def progress(stage: str, done: int, total: int) -> None:
            if not terminal:
                if stage not in logged:
                    logged[stage] = lines.enter_context(Lines(f"data retrieve: {stage}", total, unit="chunks"))
                logged[stage].update(done)
                if done >= total:
                    logged[stage].close()  # its closing line now, with its own time
                return
            if stage not in tasks:
                tasks[stage] = (bar.add_task(stage, total=total, rate=""), time.perf_counter())
            task, since = tasks[stage]
            rate = f"{done / max(time.perf_counter() - since, 1e-9):,.0f} chunks/s"
            bar.update(task, completed=done, rate=rate)

        manifest = build(progress)
    seconds = time.perf_counter() - started
    chunks = sum(manifest["chunks"].values())
    from pathlib import Path

    if a.database:
        where = f"in the database of {manifest['database']['dir']}"
    else:
        where = f"index {(Path(a.data) / RETRIEVAL_DIR / 'index.faiss').stat().st_size / 1e6:.1f} MB"
    print(
        f"wrote {Path(a.data) / RETRIEVAL_DIR}: {manifest['database_chunks']:,} database chunks of {manifest['chunk']} "
        f"tokens, {a.k} neighbours for each of {chunks:,} chunks (train and val) in {seconds:.1f} s "
        f"({chunks / seconds:,.0f} chunks/s), {where}"
    )
    return 0


def _own_database(a):
    """build(progress) -> manifest: the prepared directory's own database, with --encoder."""
    from plait.data.retrieval import build_database, check_build_settings
    from plait.lifecycle.retrieval import encoder_for

    if not a.encoder:
        raise ConfigError("plait data retrieve needs --encoder (lexical, or a model), or --database OTHER")
    chunk = 64 if a.chunk is None else a.chunk
    check_build_settings(chunk, a.k, a.batch, a.dim)  # before the encoder, which cuts the corpus into chunks
    if a.encoder == "lexical" and a.device != "cpu":
        raise ConfigError(f"--device={a.device} places a model encoder; the lexical one runs on the CPU (numpy)")
    encode, described = encoder_for(a.encoder, a.data, chunk, a.device, a.dim)
    return lambda progress: build_database(a.data, encode, encoder=described, chunk=chunk, k=a.k, batch=a.batch,
                                           overwrite=a.overwrite, progress=progress)  # fmt: skip


def _other_database(a):
    """build(progress) -> manifest: neighbours found in another directory's database (--database), with its
    encoder and chunk size."""
    from plait.data.retrieval import check_build_settings, read_database
    from plait.data.retrieval_build import find_in_database
    from plait.lifecycle.retrieval import database_encoder

    given = [name for name in ("encoder", "dim", "chunk") if getattr(a, name) is not None]
    if given:
        raise ConfigError(
            f"--database {a.database} finds the neighbours with that database's own encoder and chunk size: drop "
            f"--{given[0]}"
        )
    check_build_settings(1, a.k, a.batch)
    db = read_database(a.database, follow=False)
    encode = database_encoder(a.database, db, a.device)
    return lambda progress: find_in_database(a.data, a.database, encode, k=a.k, batch=a.batch,
                                             overwrite=a.overwrite, progress=progress)  # fmt: skip
