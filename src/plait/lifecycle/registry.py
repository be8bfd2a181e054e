"""The lineage registry's store: one SQLite file of artifacts (what was made, from what) and their events.

Two tables:

- ``artifacts``: one row per thing made, with its kind, path, parent artifact, the config that made it, a
  fingerprint of its data (the sha256 of every token shard), the code version (plait version and git commit),
  its metrics and the content hash of its weights (``lora.weights_hash``); an adapter also names the hash of
  the base weights it belongs to.
- ``events``: things that happen to an artifact over time, such as behavioural monitors at eval intervals.

Concurrency and crashes: the database runs in WAL mode (readers never block the writer), every write is one
``BEGIN IMMEDIATE`` transaction (it takes the write lock at once, so two writers never deadlock upgrading a
read lock) and connections wait up to ``busy_timeout`` for the lock instead of failing. SQLite's journal
makes each transaction all-or-nothing: a process killed mid-write leaves the previous state, and the lock it
held dies with it. Connections are short-lived (one per operation), so nothing is shared across fork. WAL
needs a local file system (not NFS).

Nothing here imports torch: ``plait lineage`` answers quickly and writer processes start fast.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sqlite3
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from plait.core.errors import PlaitError

if TYPE_CHECKING:  # not at run time: plait.core.storage imports torch
    from plait.core.storage import Location

SCHEMA_VERSION = 1
BUSY_TIMEOUT_S = 60.0
KINDS = ("import", "run", "checkpoint", "adapter", "export", "merged", "eval", "quantized", "pruned", "distilled")
PINNING_KINDS = ("run", "adapter", "export", "merged", "quantized", "pruned", "distilled")
"""Artifacts made from a checkpoint that keep it from its run's retention (a pin, plait.engine.checkpoint.pins):
a fine-tune (a run with finetune.init_from), an export, an adapter, a compressed model."""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS artifacts (
    id TEXT PRIMARY KEY,
    kind TEXT NOT NULL,
    name TEXT,
    path TEXT,
    parent_id TEXT REFERENCES artifacts(id),
    created REAL NOT NULL,
    updated REAL NOT NULL,
    status TEXT NOT NULL,
    weights_hash TEXT,
    base_hash TEXT,
    config TEXT,
    data TEXT,
    code TEXT,
    metrics TEXT,
    extra TEXT
);
CREATE INDEX IF NOT EXISTS artifacts_parent ON artifacts(parent_id);
CREATE INDEX IF NOT EXISTS artifacts_path ON artifacts(path);
CREATE INDEX IF NOT EXISTS artifacts_weights ON artifacts(weights_hash);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    artifact_id TEXT NOT NULL REFERENCES artifacts(id),
    step INTEGER,
    kind TEXT NOT NULL,
    created REAL NOT NULL,
    payload TEXT
);
CREATE INDEX IF NOT EXISTS events_artifact ON events(artifact_id);
"""
_JSON_FIELDS = ("config", "data", "code", "metrics", "extra")


@dataclass
class Artifact:
    id: str
    kind: str
    name: str | None
    path: str | None
    parent_id: str | None
    created: float
    updated: float
    status: str
    weights_hash: str | None
    base_hash: str | None
    config: dict | None
    data: dict | None
    code: dict | None
    metrics: dict | None
    extra: dict | None

    @classmethod
    def from_row(cls, row: sqlite3.Row) -> Artifact:
        values = dict(row)
        for key in _JSON_FIELDS:
            values[key] = json.loads(values[key]) if values[key] else None
        return cls(**values)

    @property
    def label(self) -> str:
        return f"{self.kind} {self.name or Path(self.path or '?').name} [{self.id[:8]}]"


class Registry:
    """A lineage registry file. Every method opens its own short connection (safe across processes)."""

    def __init__(self, path: str | Path, *, create: bool = True):
        self.path = Path(path).expanduser()
        if not self.path.exists():
            if not create:
                raise PlaitError(f"no lineage registry at {self.path}")
            self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._connect() as db:
            version = db.execute("PRAGMA user_version").fetchone()[0]
        if version == 0:
            with self._write() as db:  # (executescript would COMMIT early: one statement at a time instead)
                if db.execute("PRAGMA user_version").fetchone()[0] == 0:  # another process may have won
                    for statement in _SCHEMA.split(";"):
                        if statement.strip():
                            db.execute(statement)
                    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        elif version > SCHEMA_VERSION:
            raise PlaitError(f"{self.path} was written by a newer plait (schema {version}); upgrade plait")

    # ------------------------------------------------------------------------------------------- connections

    @contextlib.contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
        try:
            db.row_factory = sqlite3.Row
            db.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
            if db.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                db.execute("PRAGMA journal_mode = WAL")  # persistent: set once per file
            db.execute("PRAGMA synchronous = FULL")
            db.execute("PRAGMA foreign_keys = ON")
            yield db
        except sqlite3.DatabaseError as e:
            raise PlaitError(f"lineage registry {self.path}: {e}") from None
        finally:
            db.close()

    @contextlib.contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction: BEGIN IMMEDIATE ... COMMIT, rolled back on any error."""
        with self._connect() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    # ------------------------------------------------------------------------------------------------ writes

    def record(
        self,
        kind: str,
        *,
        name: str | None = None,
        path: str | Location | None = None,
        parent: str | None = None,
        status: str = "done",
        weights_hash: str | None = None,
        base_hash: str | None = None,
        config: Mapping | None = None,
        data: Mapping | None = None,
        code: Mapping | None = None,
        metrics: Mapping | None = None,
        extra: Mapping | None = None,
        events: list[tuple[int | None, str, Mapping]] | None = None,
    ) -> str:
        """Add an artifact (and optional events with it, in the same transaction); returns its id."""
        if kind not in KINDS:
            raise PlaitError(f"unknown artifact kind {kind!r}; one of {', '.join(KINDS)}")
        aid = uuid.uuid4().hex[:16]
        now = time.time()
        row = {
            "id": aid,
            "kind": kind,
            "name": name,
            "path": _norm(path),
            "parent_id": parent,
            "created": now,
            "updated": now,
            "status": status,
            "weights_hash": weights_hash,
            "base_hash": base_hash,
            "config": _dump(config),
            "data": _dump(data),
            "code": _dump(code),
            "metrics": _dump(metrics),
            "extra": _dump(extra),
        }
        with self._write() as db:
            db.execute(
                f"INSERT INTO artifacts ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})", list(row.values())
            )
            for step, event_kind, payload in events or []:
                db.execute(
                    "INSERT INTO events (artifact_id, step, kind, created, payload) VALUES (?, ?, ?, ?, ?)",
                    (aid, step, event_kind, now, _dump(payload)),
                )
        self._pin_base(aid, kind, name, path, parent, config)
        return aid

    def _pin_base(self, aid: str, kind: str, name, path, parent: str | None, config: Mapping | None) -> None:
        """The checkpoint an artifact is made from is pinned (kept by its run's retention, said when it is):
        not a run's own checkpoint it resumes, only the base a fine-tune starts from (finetune.init_from)."""
        if not parent or kind not in PINNING_KINDS:
            return
        base = self.get(parent)
        if base.kind != "checkpoint" or not base.path:
            return
        if kind == "run":
            init = _norm(str(((config or {}).get("finetune") or {}).get("init_from") or "")) if config else ""
            if not init or not (base.path == init or base.path.startswith(init.rstrip("/") + "/")):
                return
        from plait.core.storage import location
        from plait.engine.checkpoint.pins import pin

        holder = {"kind": kind, "name": name, "path": _norm(path), "artifact": aid, "registry": str(self.path)}
        try:
            pin(location(base.path), holder, aid)
        except Exception as e:  # the record stands; the base is then only as safe as its run's keep_last
            from plait.engine.metrics import warn

            warn(f"could not pin {base.path} for {kind} {name or aid} ({type(e).__name__}: {e}); its run's retention "
                 f"may delete it: copy it, or raise that run's checkpoint.keep_last")  # fmt: skip

    def pins(self) -> list[tuple[str, str, str]]:
        """(checkpoint, pin file, what depends on it) for every pin in the checkpoint directories this registry
        knows (`plait lineage pins`)."""
        from plait.core.storage import location
        from plait.engine.checkpoint.pins import pins_of

        dirs = sorted({a.path.rsplit("/", 1)[0] for a in self.all("checkpoint") if a.path and "/" in a.path})
        out = []
        for d in dirs:
            with contextlib.suppress(Exception):  # a directory gone or unreachable holds no pins to list
                out += [(f"{d}/{c}", f"{d}/pins/{n}", what) for c, n, what in pins_of(location(d))]
        return out

    def update(self, aid: str, **fields: Any) -> None:
        """Change fields of an artifact; ``metrics`` and ``extra`` are merged into the stored dicts."""
        allowed = {"status", "weights_hash", "base_hash", "metrics", "extra", "path", "name", "parent_id"}
        unknown = set(fields) - allowed
        if unknown:
            raise PlaitError(f"cannot update {', '.join(sorted(unknown))} of an artifact")
        with self._write() as db:
            row = db.execute("SELECT metrics, extra FROM artifacts WHERE id = ?", (aid,)).fetchone()
            if row is None:
                raise PlaitError(f"no artifact {aid} in {self.path}")
            for key in ("metrics", "extra"):
                if key in fields and fields[key] is not None:
                    fields[key] = _dump({**(json.loads(row[key]) if row[key] else {}), **fields[key]})
            if "path" in fields:
                fields["path"] = _norm(fields["path"])
            sets = ", ".join(f"{k} = ?" for k in fields)
            db.execute(f"UPDATE artifacts SET {sets}, updated = ? WHERE id = ?", [*fields.values(), time.time(), aid])

    def add_event(self, aid: str, kind: str, payload: Mapping, step: int | None = None) -> None:
        with self._write() as db:
            db.execute(
                "INSERT INTO events (artifact_id, step, kind, created, payload) VALUES (?, ?, ?, ?, ?)",
                (aid, step, kind, time.time(), _dump(payload)),
            )

    # ------------------------------------------------------------------------------------------------- reads

    def get(self, aid: str) -> Artifact:
        with self._connect() as db:
            row = db.execute("SELECT * FROM artifacts WHERE id = ?", (aid,)).fetchone()
        if row is None:
            raise PlaitError(f"no artifact {aid} in {self.path}")
        return Artifact.from_row(row)

    def all(self, kind: str | None = None) -> list[Artifact]:
        query = "SELECT * FROM artifacts"
        args: tuple[str, ...] = ()
        if kind:
            query, args = query + " WHERE kind = ?", (kind,)
        with self._connect() as db:
            rows = db.execute(query + " ORDER BY created, rowid", args).fetchall()
        return [Artifact.from_row(r) for r in rows]

    def children(self, aid: str) -> list[Artifact]:
        with self._connect() as db:
            rows = db.execute("SELECT * FROM artifacts WHERE parent_id = ? ORDER BY created, rowid", (aid,)).fetchall()
        return [Artifact.from_row(r) for r in rows]

    def events(self, aid: str, kind: str | None = None) -> list[dict]:
        query, args = "SELECT * FROM events WHERE artifact_id = ?", [aid]
        if kind:
            query, args = query + " AND kind = ?", [aid, kind]
        with self._connect() as db:
            rows = db.execute(query + " ORDER BY id", args).fetchall()
        return [{**dict(r), "payload": json.loads(r["payload"]) if r["payload"] else None} for r in rows]

    def by_path(self, path: str | Location, kinds: tuple[str, ...] | None = None) -> Artifact | None:
        """The newest artifact recorded at this path (of one of ``kinds``)."""
        with self._connect() as db:
            rows = db.execute(
                "SELECT * FROM artifacts WHERE path = ? ORDER BY created DESC, rowid DESC", (_norm(path),)
            )
            for row in rows:
                if kinds is None or row["kind"] in kinds:
                    return Artifact.from_row(row)
        return None

    def newest_under(self, directory: str | Path) -> Artifact | None:
        """The newest artifact recorded inside this directory (a run directory's checkpoints)."""
        prefix = (_norm(directory) or "").rstrip("/") + "/"
        with self._connect() as db:
            row = db.execute(
                "SELECT * FROM artifacts WHERE substr(path, 1, ?) = ? ORDER BY created DESC, rowid DESC LIMIT 1",
                (len(prefix), prefix),
            ).fetchone()
        return Artifact.from_row(row) if row else None

    def by_weights(self, weights_hash: str) -> Artifact | None:
        """The oldest artifact with these weights (the one that made them)."""
        with self._connect() as db:
            row = db.execute(
                "SELECT * FROM artifacts WHERE weights_hash = ? ORDER BY created, rowid LIMIT 1", (weights_hash,)
            ).fetchone()
        return Artifact.from_row(row) if row else None

    def find(self, ref: str) -> Artifact:
        """An artifact by id, id prefix, path, weights-hash prefix or name (the newest with that name)."""
        with self._connect() as db:
            row = db.execute("SELECT * FROM artifacts WHERE id = ?", (ref,)).fetchone()
            if row:
                return Artifact.from_row(row)
            if Path(ref).exists() or os.sep in ref:
                found = self.by_path(ref)
                if found:
                    return found
                if Path(ref).name == "adapter.safetensors" or Path(ref).is_file():
                    found = self.by_path(Path(ref).parent)
                    if found:
                        return found
                found = self.newest_under(ref)  # a run directory: its newest checkpoint (or import, export)
                if found:
                    return found
            for column in ("id", "weights_hash"):
                if len(ref) >= 4:
                    rows = db.execute(
                        f"SELECT * FROM artifacts WHERE {column} LIKE ? ORDER BY created", (ref + "%",)
                    ).fetchall()
                    ids = {r["id"] for r in rows}
                    if column == "id" and len(ids) > 1:
                        raise PlaitError(f"{ref!r} matches {len(ids)} artifacts in {self.path}; give more characters")
                    if rows:
                        return Artifact.from_row(rows[0])
            row = db.execute("SELECT * FROM artifacts WHERE name = ? ORDER BY created DESC LIMIT 1", (ref,)).fetchone()
            if row:
                return Artifact.from_row(row)
        raise PlaitError(f"nothing named {ref!r} in the lineage registry {self.path} (try `plait lineage list`)")

    def ancestors(self, aid: str) -> list[Artifact]:
        """The artifact and its parents up to the root, nearest first (stops at a cycle)."""
        chain, seen = [], set()
        current: str | None = aid
        while current and current not in seen:
            seen.add(current)
            art = self.get(current)
            chain.append(art)
            current = art.parent_id
        return chain

    def integrity(self) -> str:
        with self._connect() as db:
            return db.execute("PRAGMA integrity_check").fetchone()[0]


# ---------------------------------------------------------------------------------------------- helpers


def _dump(value: Mapping | None) -> str | None:
    return None if value is None else json.dumps(value, sort_keys=True, default=str)


def _norm(path: str | Location | None) -> str | None:
    if path is None or "://" in str(path):  # a remote location (s3://...) is kept as written
        return None if path is None else str(path).rstrip("/")
    return str(Path(str(path)).expanduser().resolve())  # str or Path here (a RemotePath's str has "://")


def effective_status(art: Artifact) -> str:
    """'running' only while the recording process lives (same host); a run whose process died is 'died'."""
    if art.status != "running" or not art.extra:
        return art.status
    pid, host = art.extra.get("pid"), art.extra.get("host")
    if host == socket.gethostname() and isinstance(pid, int):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return "died"
        except PermissionError:
            pass
    return art.status
