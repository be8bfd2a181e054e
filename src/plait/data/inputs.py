"""The inputs of `plait data prepare`: which files (expand_inputs) and the documents in them (documents).

An input is a file, a directory (its supported files, sorted, recursively), a `datasets` dataset saved to
disk (its Arrow files in the dataset's order), or an `s3://bucket/prefix` (its supported objects, sorted by
key; the endpoint and credentials as for checkpoints: checkpoint.s3_endpoint / AWS_ENDPOINT_URL and the AWS
environment, never printed). Formats: UTF-8 text (one document per file), JSONL (gzipped or not), Parquet
and Arrow (the column `text_field`, a string column: a file whose column holds nulls is refused, with their
count, before any of it is read: a null is a missing document, not an empty one, and is fixed in the data; a
JSONL record whose text is null is refused the same way, naming its line).
An object on S3 is copied to a local scratch file while it is read, one at a time, retried as the training
reads are (plait.data.remote), and removed after.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plait.core.errors import ConfigError
from plait.core.storage import RemotePath, location

SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".parquet", ".arrow")

Advance = Callable[[int], None]  # reports how many bytes of the current input file were consumed


@dataclass(frozen=True)
class Input:
    """One input file: where (a resolved local path or an s3:// URL), its size, and what a resumed prepare
    checks unchanged (the modification time; the ETag on S3)."""

    where: str
    size: int
    stamp: str
    remote: RemotePath | None = None

    @property
    def name(self) -> str:
        return self.where.rsplit("/", 1)[-1]

    def __str__(self) -> str:
        return self.where

    @contextlib.contextmanager
    def local(self) -> Iterator[Path]:
        """A local file with the input's bytes: the file itself, or a scratch copy of the S3 object."""
        if self.remote is None:
            yield Path(self.where)
            return
        from plait.data.remote import _read

        remote = self.remote
        fd, scratch = tempfile.mkstemp(prefix="plait-prepare-", suffix=f"-{self.name}")
        os.close(fd)
        try:
            try:
                _read(lambda: remote.fs.get_file(remote.url, scratch), remote.url)
            except FileNotFoundError:
                raise ConfigError(f"input {remote.url} is gone from S3 (removed after it was listed)") from None
            yield Path(scratch)
        finally:
            os.unlink(scratch)


def _suffix(name: str) -> str | None:
    name = name.lower()
    return next((s for s in SUFFIXES if name.endswith(s)), None)


def _local(path: Path) -> Input:
    stat = path.stat()
    return Input(str(path.resolve()), stat.st_size, str(stat.st_mtime_ns))


def expand_inputs(inputs: Sequence[str | Path], endpoint: str = "") -> list[Input]:
    """Input files in order; directories expand to their supported files, sorted, recursively; a dataset
    saved by `datasets` to its Arrow files in order; an s3:// prefix to its supported objects, by key."""
    files: list[Input] = []
    for item in inputs:
        if str(item).startswith("s3://"):
            files.extend(_s3_inputs(str(item), endpoint))
            continue
        path = Path(item)
        if path.is_dir():
            files.extend(_directory(path))
        elif not path.exists():
            raise ConfigError(f"input {path} does not exist")
        elif _suffix(path.name) is None:
            raise ConfigError(f"input {path} has an unsupported type: use one of {', '.join(SUFFIXES)}")
        else:
            files.append(_local(path))
    if not files:
        raise ConfigError("no inputs given: pass at least one text, JSONL, Parquet or Arrow file or directory")
    return files


def _directory(path: Path) -> list[Input]:
    if (path / "dataset_dict.json").exists():  # datasets' DatasetDict.save_to_disk: one directory per split
        splits = sorted(p.name for p in path.iterdir() if (p / "state.json").exists())
        raise ConfigError(
            f"input {path} is a dataset with splits {splits}: pass the split to prepare, e.g. {path / splits[0]}"
            if splits
            else f"input {path} is a dataset dictionary without splits"
        )
    state = path / "state.json"
    if state.exists() and (path / "dataset_info.json").exists():  # datasets' Dataset.save_to_disk
        try:
            names = [f["filename"] for f in json.loads(state.read_text())["_data_files"]]
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{state} is not a datasets state file ({e})") from None
        return [_local(path / name) for name in names]
    found = sorted(p for p in path.rglob("*") if p.is_file() and _suffix(p.name))
    if not found:
        raise ConfigError(f"input directory {path} has no {', '.join(SUFFIXES)} files")
    return [_local(p) for p in found]


def _s3_inputs(url: str, endpoint: str) -> list[Input]:
    """The supported objects under an s3:// prefix (or the one object it names), sorted by key."""
    from plait.data.remote import _read

    root = location(url, endpoint)
    assert isinstance(root, RemotePath)
    key = root.url.removeprefix("s3://")
    try:
        found = _read(lambda: root.fs.find(key, detail=True), f"the listing of {root}")
    except FileNotFoundError:  # s3fs: no such bucket
        raise ConfigError(f"input {url} does not exist: no such bucket (check the bucket and the endpoint)") from None
    objects = sorted((name, info) for name, info in found.items() if info.get("type", "file") == "file")
    if not objects:
        raise ConfigError(f"input {url} holds no objects: check the bucket and prefix (and the endpoint)")
    supported = [(name, info) for name, info in objects if _suffix(name)]
    if not supported:
        raise ConfigError(f"input {url} has no {', '.join(SUFFIXES)} objects")
    return [
        Input(f"s3://{name}", int(info["size"]), str(info.get("ETag", "")), RemotePath(f"s3://{name}", root.options))
        for name, info in supported
    ]


# ---------------------------------------------------------------------------------------------- readers


def _check_text(value: Any, where: str, field: str) -> str:
    if value is None:  # as a Parquet or Arrow null: refused, never dropped in silence
        raise ConfigError(
            f"{where}: field {field!r} is null: a null is not a document; drop the record or give it text, and "
            "prepare again"
        )
    if not isinstance(value, str):
        raise ConfigError(f"{where}: field {field!r} is a {type(value).__name__}, expected a string")
    return value


def _read_txt(path: Path, name: str, field: str, advance: Advance) -> Iterator[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{name} is not UTF-8 text ({e})") from e
    advance(path.stat().st_size)
    yield text


def jsonl_records(path: Path, advance: Advance | None = None, name: str | None = None) -> Iterator[tuple[str, dict]]:
    """('file:line', record) for each non-blank line of a .jsonl or .jsonl.gz file; a line that is not a JSON
    object, or a corrupt or truncated gzip, is a ConfigError naming where (as `name`, the input's own name
    where `path` is a local copy). advance(bytes read) for progress. The one JSONL reader (pre-training text
    and instruction data)."""
    name = name or str(path)
    with open(path, "rb") as raw:
        # Binary reads keep raw.tell() usable for progress (compressed bytes for .gz).
        lines = gzip.GzipFile(fileobj=raw) if path.name.lower().endswith(".gz") else raw
        try:
            for lineno, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                where = f"{name}:{lineno}"
                try:
                    record = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise ConfigError(f"{where} is not valid JSON ({e})") from None
                if not isinstance(record, dict):
                    raise ConfigError(f"{where} is a JSON {type(record).__name__}, not an object")
                if advance is not None:
                    advance(raw.tell())
                yield where, record
        except (OSError, EOFError) as e:  # corrupt or truncated gzip
            raise ConfigError(f"{name} cannot be read ({e})") from e


def _read_jsonl(path: Path, name: str, field: str, advance: Advance) -> Iterator[str]:
    for where, record in jsonl_records(path, advance, name):
        if field not in record:
            raise ConfigError(f"{where} has no field {field!r} (found {sorted(record)}): set text_field")
        yield _check_text(record[field], where, field)


def _pyarrow(name: str):
    try:
        import pyarrow as pa
    except ImportError:
        raise ConfigError(f"{name}: reading Parquet and Arrow needs pyarrow: pip install 'plait[parquet]'") from None
    return pa


def _text_column(pa, schema, name: str, field: str) -> None:
    if field not in schema.names:
        raise ConfigError(f"{name} has no column {field!r} (columns: {schema.names}): set text_field")
    ctype = schema.field(field).type
    if not (pa.types.is_string(ctype) or pa.types.is_large_string(ctype) or pa.types.is_string_view(ctype)):
        raise ConfigError(f"{name}: column {field!r} has type {ctype}, expected a string column")


def _nulls(name: str, field: str, nulls: int, rows: int) -> ConfigError:
    return ConfigError(
        f"{name}: column {field!r} holds {nulls:,} nulls of {rows:,} rows: a null is not a document; drop or "
        f"fill those rows (e.g. with pyarrow.compute.drop_null) and prepare again"
    )


def _read_parquet(path: Path, name: str, field: str, advance: Advance) -> Iterator[str]:
    pa = _pyarrow(name)
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        _text_column(pa, pf.schema_arrow, name, field)
        nulls = _parquet_nulls(pf, field)
    except (pa.ArrowException, OSError) as e:
        raise ConfigError(f"{name} is not a readable Parquet file ({_first_line(e)})") from None
    if nulls:
        raise _nulls(name, field, nulls, pf.metadata.num_rows)
    size = path.stat().st_size
    for rg in range(pf.num_row_groups):  # one row group at a time bounds memory on large files
        try:
            column = pf.read_row_group(rg, columns=[field]).column(0)
        except (pa.ArrowException, OSError) as e:
            raise ConfigError(f"{name}: row group {rg} cannot be read ({_first_line(e)})") from None
        advance(size * (rg + 1) // pf.num_row_groups)
        yield from column.to_pylist()


def _parquet_nulls(pf, field: str) -> int:
    """The nulls in the text column: from the row groups' statistics, or (where one has none) by reading the
    column one row group at a time."""
    index = pf.schema_arrow.get_field_index(field)
    nulls = 0
    for rg in range(pf.num_row_groups):
        stats = pf.metadata.row_group(rg).column(index).statistics
        if stats is not None and stats.has_null_count:
            nulls += stats.null_count
        else:
            nulls += pf.read_row_group(rg, columns=[field]).column(0).null_count
    return nulls


def _first_line(e: BaseException) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0][:300]


def _arrow_batches(pa, source, name: str):
    """(schema, record batches) of a memory-mapped Arrow IPC file, stream format (as `datasets` writes) or file
    format; a file that is neither is a ConfigError."""
    try:
        reader = pa.ipc.open_stream(source)
        return reader.schema, iter(reader)
    except (pa.ArrowException, OSError, ValueError):
        source.seek(0)
    try:
        file = pa.ipc.open_file(source)
    except (pa.ArrowException, OSError, ValueError) as e:
        raise ConfigError(f"{name} is not an Arrow stream or file ({_first_line(e)})") from None
    return file.schema, (file.get_batch(i) for i in range(file.num_record_batches))


def _read_arrow(path: Path, name: str, field: str, advance: Advance) -> Iterator[str]:
    """An Arrow IPC file, memory-mapped: its text column counted for nulls first (cheap: validity bitmaps
    only), then read one record batch at a time."""
    pa = _pyarrow(name)
    for counting in (True, False):
        with pa.memory_map(str(path)) as source:
            schema, batches = _arrow_batches(pa, source, name)
            _text_column(pa, schema, name, field)
            nulls = rows = 0
            try:
                for batch in batches:
                    nulls, rows = nulls + batch.column(field).null_count, rows + batch.num_rows
                    if not counting:
                        advance(source.tell())
                        yield from batch.column(field).to_pylist()
            except (pa.ArrowException, OSError) as e:
                raise ConfigError(f"{name}: a record batch cannot be read ({_first_line(e)})") from None
        if nulls:
            raise _nulls(name, field, nulls, rows)


_READERS = {
    ".txt": _read_txt,
    ".jsonl": _read_jsonl,
    ".jsonl.gz": _read_jsonl,
    ".parquet": _read_parquet,
    ".arrow": _read_arrow,
}


def needs_pyarrow(files: list[Input]) -> None:
    """Refused before any work: Parquet or Arrow inputs without pyarrow installed."""
    tabular = [f for f in files if _suffix(f.name) in (".parquet", ".arrow")]
    if tabular:
        _pyarrow(tabular[0].where)


def _after(advance: Advance, done: int) -> Advance:
    """`advance` of a file's bytes, counted after the `done` bytes of the files before it."""
    return lambda pos: advance(done + pos)


def documents(files: list[Input], field: str, counts: list[int], advance: Advance) -> Iterator[str]:
    """Non-empty documents of all files in order; `advance` gets bytes consumed across all files."""
    done = 0
    for i, inp in enumerate(files):
        reader = _READERS[_suffix(inp.name) or ""]
        with inp.local() as path:
            for text in reader(path, inp.where, field, _after(advance, done)):
                if text.strip():
                    counts[i] += 1
                    yield text
        if counts[i] == 0:
            raise ConfigError(f"input {inp} has no non-empty documents (text field {field!r})")
        done += inp.size
