"""What a retrieval database is on disk, and its readers (plait.data.retrieval has the overview): the chunks of
a split, the corpus digest a database is tied to, the manifest (every field checked), the index's header, each
split's neighbours array, and the record of a database a model trained with. Every reader checks what it reads
against the manifest and names the fix (build the database again) when something does not match."""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from plait.core.errors import ConfigError
from plait.core.records import Record, first_line, read_json_object
from plait.data.loader import TokenDataset, read_manifest

RETRIEVAL_DIR = "retrieval"
FORMAT = "plait-retrieval-v1"
INDEX_FILE = "index.faiss"
REBUILD = "build the database again (plait data retrieve DIR --encoder ... --overwrite)"

Encoder = Callable[[np.ndarray], np.ndarray]  # (n, chunk) token ids -> (n, d) embeddings


@dataclass
class Chunks:
    """A split cut into chunks: the tokens (chunks, chunk) and the first and last document of each."""

    tokens: np.ndarray
    first_doc: np.ndarray
    last_doc: np.ndarray


def chunk_split(data_dir: Path, split: str, chunk: int) -> Chunks:
    """The whole chunks of a split's stream, each with the documents it touches (a document ends with, and
    includes, its EOS token)."""
    data = TokenDataset(data_dir, split)
    n = data.num_tokens // chunk
    stream = data.tokens(0, n * chunk)
    ends = stream == data.eos_id
    docs = np.cumsum(ends) - ends  # each token's document
    docs = docs.reshape(n, chunk) if n else docs.reshape(0, chunk)
    return Chunks(stream.reshape(n, chunk), docs[:, 0].copy(), docs[:, -1].copy())


def corpus_digest(manifest: dict[str, Any]) -> str:
    """What a database was built from: the tokenizer's and every shard's hashes."""
    parts = [manifest.get("tokenizer_sha256", "")]
    for split in sorted(manifest["splits"]):
        parts += [s.get("sha256", "") for s in manifest["splits"][split]["shards"]]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def load_array(path: Path, fix: str) -> np.ndarray:
    """A numpy array file, memory-mapped (never unpickled); a file numpy cannot map is refused saying `fix`."""
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise ConfigError(f"{path} cannot be read as a numpy array ({first_line(e)}): {fix}") from None
    if not isinstance(arr, np.ndarray) or arr.ndim != 2:
        raise ConfigError(f"{path} is not a two-dimensional array: {fix}")
    return arr


def read_database(data_dir: str | Path, *, follow: bool = True) -> dict[str, Any]:
    """A prepared directory's retrieval manifest, its fields checked (check_manifest) and checked against the
    corpus it sits beside; where its neighbours were found in another corpus's database, that database too
    (unless not `follow`)."""
    data_dir = Path(data_dir)
    path = data_dir / RETRIEVAL_DIR / "manifest.json"
    if not path.is_file():
        raise ConfigError(f"{data_dir} has no retrieval database: build it with plait data retrieve {data_dir} ...")
    manifest = read_json_object(path, REBUILD)
    if manifest.get("format") != FORMAT:
        raise ConfigError(f"{path} is not a {FORMAT} manifest: build the database again")
    check_manifest(manifest, path)
    if manifest["corpus"] != corpus_digest(read_manifest(data_dir)):
        raise ConfigError(
            f"the retrieval database of {data_dir} was built from other data or another tokenizer: build it again"
        )
    if "database" in manifest and follow:
        _check_source(data_dir, manifest)
    return manifest


def index_dir(data_dir: str | Path, db: dict[str, Any]) -> str | Path:
    """The prepared directory whose index and train stream a database's neighbours are read from: its own, or,
    for neighbours found in another corpus's database (`plait data retrieve DIR --database OTHER`), OTHER."""
    return Path(db["database"]["dir"]) if "database" in db else data_dir


def _check_source(data_dir: str | Path, manifest: dict[str, Any]) -> None:
    """Neighbours found in another corpus's database hold that database's chunk numbers: refused once it is
    gone, rebuilt or built over other text since (the numbers would name other chunks)."""
    source = manifest["database"]["dir"]
    fix = f"find them again: plait data retrieve {data_dir} --database {source} --overwrite"
    try:
        other = read_database(source, follow=False)
    except ConfigError as e:
        raise ConfigError(
            f"{data_dir}'s neighbours were found in the database of {source}, which cannot be read now ({e}): {fix}"
        ) from None
    same = (other["corpus"], other["database_chunks"], other["chunk"], encoder_key(other["encoder"]))
    if "database" in other or same != (
        manifest["database"]["corpus"],
        manifest["database_chunks"],
        manifest["chunk"],
        encoder_key(manifest["encoder"]),
    ):
        raise ConfigError(
            f"the database of {source} has been built again since {data_dir}'s neighbours were found in it: {fix}"
        )


def check_manifest(manifest: dict[str, Any], path: Path | str) -> None:
    """Every field a reader of the database uses, of its kind and in range (and consistent with each other)."""
    m = Record(manifest, path, REBUILD)
    m.integer("chunk", 1)
    m.string("corpus")
    chunks = m.record("chunks")
    train = chunks.integer("train", 2)
    chunks.integer("val", 0)
    stored = m.integer("database_chunks", 1)
    if "database" in manifest:  # neighbours found in another corpus's database: its chunks
        source = m.record("database")
        source.string("dir", empty=False)
        source.string("corpus")
    elif stored != train - 1:
        raise m.error("database_chunks", stored, f"chunks.train - 1 = {train - 1} (the chunks with a continuation)")
    k = m.integer("k", 1)
    if k >= stored:
        raise m.error("k", k, f"below database_chunks={stored}")
    encoder = m.record("encoder")
    encoder.string("path", empty=False)
    encoder.integer("dim", 1)
    encoder.string("kind", default="")
    if manifest["encoder"].get("kind") == "lexical":
        encoder.string("idf_sha256")


def database_for(data_dir: str | Path, chunk: int, k: int) -> dict[str, Any]:
    """The database's manifest, refused when a model of `chunk`-token chunks and k neighbours cannot read it;
    its index's header is checked too (check_index), so a damaged index stops a run before it trains."""
    db = read_database(data_dir)
    if db["chunk"] != chunk:
        raise ConfigError(
            f"model.retrieval_chunk={chunk} but the retrieval database of {data_dir} has chunks of {db['chunk']} "
            f"tokens: set model.retrieval_chunk={db['chunk']}, or build it again with "
            f"`{rebuild_command(data_dir, db['encoder'], chunk, max(k, db['k']))}`"
        )
    if k > db["k"]:
        raise ConfigError(
            f"model.retrieval_k={k} but the retrieval database of {data_dir} holds {db['k']} neighbours per chunk: "
            f"set model.retrieval_k <= {db['k']}, or build it again with "
            f"`{rebuild_command(data_dir, db['encoder'], chunk, k)}`"
        )
    check_index(index_dir(data_dir, db), db)
    return db


def encoder_key(encoder: dict[str, Any]) -> tuple[str, Any]:
    """What makes two databases' encoders the same one: a model's weights (their hash), or the lexical
    encoder's size. The lexical encoder's idf is fitted on each corpus's own chunks by design, so databases of
    other text differ in it and still share their encoder; a model's path says nothing (the run may have moved
    on), its weights do. A model's description without a hash (none is written so) falls back to its path."""
    if encoder.get("kind") == "lexical":
        return ("lexical", encoder.get("dim"))
    return ("model", encoder.get("weights_hash") or encoder.get("path"))


def describe_encoder(encoder: dict[str, Any]) -> str:
    """An encoder in a few words, for a message: `lexical (dim 32)` or `PATH (weights 0123456789ab)`."""
    kind, key = encoder_key(encoder)
    if kind == "lexical":
        return f"lexical (dim {key})"
    digest = encoder.get("weights_hash")
    return f"{encoder.get('path')} (weights {digest[:12]})" if isinstance(digest, str) else str(encoder.get("path"))


def rebuild_command(data_dir: str | Path, encoder: dict[str, Any], chunk: int, k: int) -> str:
    """The `plait data retrieve` command that builds a database of `data_dir` with this encoder and sizes."""
    lexical = encoder.get("kind") == "lexical"
    use = f"lexical --dim {encoder.get('dim')}" if lexical else str(encoder.get("path"))
    return f"plait data retrieve {data_dir} --encoder {use} --chunk {chunk} --k {k} --overwrite"


@dataclass(frozen=True)
class ModelNeeds:
    """What a trained retrieval model needs of a database it retrieves from (another than the one it trained
    with, `plait generate --database DIR`): the model's chunk size and neighbour count, the tokenizer its ids
    are of (the sha256 of its tokenizer.json; "" where unknown), and the encoder its own database was built
    with (the manifest's description; None where no record of it survives). `model` names it in messages."""

    model: str
    chunk: int
    k: int
    tokenizer_sha256: str
    encoder: dict[str, Any] | None


def check_database_fits(data_dir: str | Path, db: dict[str, Any], needs: ModelNeeds) -> None:
    """Refuse a database built for another model, naming the field and both values: its corpus's tokenizer
    (the ids would be another vocabulary's), its chunk size or neighbour count (the model's input is cut in
    its own chunks), or its encoder (the neighbours the model learned to use are found by its own encoder).
    The fix is the `plait data retrieve` command with the model's encoder and sizes."""
    wanted = needs.encoder or db["encoder"]
    fix = f"build it again with `{rebuild_command(data_dir, wanted, needs.chunk, max(needs.k, db['k']))}`"
    where = f"the retrieval database of {data_dir}"
    tokenizer = db.get("corpus_tokenizer_sha256") or read_manifest(data_dir).get("tokenizer_sha256", "")
    if needs.tokenizer_sha256 and tokenizer and tokenizer != needs.tokenizer_sha256:
        raise ConfigError(
            f"{where} was built with tokenizer {tokenizer[:12]} (sha256 of its corpus's tokenizer.json), "
            f"{needs.model} reads tokenizer {needs.tokenizer_sha256[:12]}: prepare the text with the model's "
            f"tokenizer (plait data prepare ... --tokenizer {needs.model}/tokenizer.json) and {fix}"
        )
    if db["chunk"] != needs.chunk:
        raise ConfigError(
            f"{where} was built with chunk={db['chunk']} tokens, {needs.model} needs chunk={needs.chunk} "
            f"(model.retrieval_chunk): {fix}"
        )
    if db["k"] < needs.k:
        raise ConfigError(
            f"{where} was built with k={db['k']} neighbours per chunk, {needs.model} needs k={needs.k} "
            f"(model.retrieval_k): {fix}"
        )
    if needs.encoder is not None and encoder_key(db["encoder"]) != encoder_key(needs.encoder):
        raise ConfigError(
            f"{where} was built with encoder {describe_encoder(db['encoder'])}, {needs.model} trained with "
            f"neighbours found by encoder {describe_encoder(needs.encoder)}: {fix}"
        )


_INDEX_HEADER = struct.Struct("<4siqqq?iQ")  # fourcc, d, ntotal, two unused, is_trained, metric, code words
_FLAT_IP, _INNER_PRODUCT = b"IxFI", 0


def check_index(data_dir: str | Path, db: dict[str, Any]) -> None:
    """index.faiss read by its header alone (cheap at any size, before faiss parses it): an exact
    inner-product index (faiss's IndexFlatIP) of the manifest's database_chunks vectors of the encoder's dim,
    whole (its size is the header's)."""
    path = Path(data_dir) / RETRIEVAL_DIR / INDEX_FILE
    try:
        with open(path, "rb") as f:
            head = f.read(_INDEX_HEADER.size)
        size = path.stat().st_size
    except OSError as e:
        raise ConfigError(f"{path} cannot be read ({first_line(e)}): {REBUILD}") from None
    if len(head) < _INDEX_HEADER.size:
        raise ConfigError(f"{path} is cut short ({size} bytes, not even a faiss header): {REBUILD}")
    fourcc, dim, total, _, _, _, metric, words = _INDEX_HEADER.unpack(head)
    check_index_fields(path, db, fourcc == _FLAT_IP and metric == _INNER_PRODUCT, dim, total)
    if words != dim * total or size != _INDEX_HEADER.size + 4 * words:
        raise ConfigError(
            f"{path} is {size} bytes; an index of {total} vectors of {dim} floats is "
            f"{_INDEX_HEADER.size + 4 * dim * total}: the file is cut or damaged: {REBUILD}"
        )


def check_index_fields(path: Path, db: dict[str, Any], flat_ip: bool, dim: int, total: int) -> None:
    """An index (read from its header or loaded by faiss) against its manifest: type, dimension and count."""
    if not flat_ip:
        raise ConfigError(f"{path} is not an exact inner-product faiss index (IndexFlatIP, as built): {REBUILD}")
    if dim != db["encoder"]["dim"]:
        raise ConfigError(
            f"{path} holds vectors of {dim} dimensions, the manifest's encoder {db['encoder']['dim']} (an index of "
            f"another database?): {REBUILD}"
        )
    if total != db["database_chunks"]:
        raise ConfigError(
            f"{path} holds {total} vectors, the manifest's database_chunks {db['database_chunks']} (an index of "
            f"another database?): {REBUILD}"
        )


def database_record(data_dir: str | Path) -> dict[str, Any]:
    """What a retrieval model trained with, for its lineage and beside its exports: the database's place, the
    hash of its manifest, and the manifest's chunk, k, corpus digest, encoder and index (present: False when
    the directory holds no readable database)."""
    path = Path(data_dir) / RETRIEVAL_DIR / "manifest.json"
    try:
        text = path.read_text()
        manifest = json.loads(text)
    except (OSError, ValueError):
        return {"dir": str(Path(data_dir).resolve()), "present": False}
    keep = ("format", "chunk", "k", "corpus", "encoder", "index", "database_chunks", "excluded", "database")
    return {
        "dir": str((Path(data_dir) / RETRIEVAL_DIR).resolve()),
        "present": True,
        "manifest_sha256": hashlib.sha256(text.encode()).hexdigest(),
        **{key: manifest.get(key) for key in keep},
    }


def neighbours(data_dir: str | Path, split: str, db: dict[str, Any] | None = None) -> np.ndarray:
    """(chunks, k) database chunk numbers of each chunk of a split (read-only, memory-mapped, no pickle),
    checked against the manifest `db` (read when not given): int32, a row per chunk of the split, k columns,
    every number a database chunk."""
    db = read_database(data_dir) if db is None else db
    path = Path(data_dir) / RETRIEVAL_DIR / f"{split}_neighbours.npy"
    arr = load_array(path, REBUILD)
    want = (db["chunks"].get(split), db["k"])
    if arr.dtype != np.int32 or arr.shape != want:
        raise ConfigError(
            f"{path} is {arr.dtype} {arr.shape}; the manifest's {split} split needs int32 {want} (another split's "
            f"file?): {REBUILD}"
        )
    low, high = (int(arr.min()), int(arr.max())) if arr.size else (0, 0)
    if low < 0 or high >= db["database_chunks"]:
        raise ConfigError(
            f"{path} names database chunk {low if low < 0 else high}; the database holds chunks 0 to "
            f"{db['database_chunks'] - 1}: {REBUILD}"
        )
    return arr
