"""The lineage registry: where every run, checkpoint, export, adapter, evaluation and compressed model came from.

One SQLite file (default ``<run.out_dir>/lineage.sqlite``) holds what was made and from what; its store is
`plait.lifecycle.registry` (the tables, concurrency and crashes). This module finds the file a path belongs
to, and gathers what a record says about where a thing came from: the code version, the data's fingerprint,
the recording process.

Nothing here imports torch: ``plait lineage`` answers quickly and writer processes start fast.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import subprocess
from pathlib import Path
from typing import Any

from plait.lifecycle.registry import (  # the store's names, importable from here as before
    BUSY_TIMEOUT_S,
    KINDS,
    PINNING_KINDS,
    SCHEMA_VERSION,
    Artifact,
    Registry,
    effective_status,
)

__all__ = [
    "BUSY_TIMEOUT_S",
    "KINDS",
    "PINNING_KINDS",
    "REGISTRY_FILE",
    "SCHEMA_VERSION",
    "Artifact",
    "Registry",
    "code_version",
    "data_fingerprint",
    "effective_status",
    "find_registry",
    "open_registry",
    "process_info",
    "registry_path",
]

REGISTRY_FILE = "lineage.sqlite"


def registry_path(out_dir: str | Path, path: str = "") -> Path:
    """The registry of a run: ``lineage.path`` if set, else ``<run.out_dir>/lineage.sqlite``."""
    return Path(path).expanduser() if path else Path(out_dir).expanduser() / REGISTRY_FILE


def find_registry(start: str | Path) -> Path | None:
    """The registry that covers a path: the nearest ``lineage.sqlite`` in it or above it, or the one named by
    the config of the checkpoint it holds."""
    start = Path(start).expanduser().resolve()
    meta = (start if start.is_dir() else start.parent) / "plait.json"
    if meta.is_file():
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            configured = json.loads(meta.read_text())["config"].get("lineage", {}).get("path")
            if configured and Path(configured).expanduser().is_file():
                return Path(configured).expanduser()
    for directory in [start, *start.parents]:
        candidate = directory / REGISTRY_FILE
        if candidate.is_file():
            return candidate
    return None


def open_registry(explicit: str | None, near: str | Path | None = None, *, create: bool = False) -> Registry | None:
    """The registry given with --registry, else the one covering ``near``, else (no path given: `plait lineage
    list`) ./runs/lineage.sqlite if it exists; None when there is none (and ``create`` is false). A path
    outside every registry is not recorded in the working directory's: that would mix other projects' work
    (or a test's) into it."""
    if explicit:
        return Registry(explicit, create=create)
    found = find_registry(near) if near is not None and "://" not in str(near) else None
    if found is None and (near is None or "://" in str(near)) and Path("runs", REGISTRY_FILE).is_file():
        found = Path("runs", REGISTRY_FILE)
    return Registry(found, create=False) if found else None


def code_version() -> dict[str, Any]:
    """plait's version and, where the package lives in a git checkout, its commit (and whether it is dirty)."""
    import plait

    out: dict[str, Any] = {"plait": plait.__version__}
    root = Path(plait.__file__).resolve().parents[2]
    if (root / ".git").exists():
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            commit = subprocess.run(
                ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
            )
            if commit.returncode == 0:
                out["git_commit"] = commit.stdout.strip()
                status = subprocess.run(
                    ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                    capture_output=True,
                    text=True,
                    timeout=10,
                )
                out["git_dirty"] = bool(status.stdout.strip())
    return out


def data_fingerprint(data_dir: str | Path, source: str | None = None) -> dict[str, Any]:
    """What a prepared data directory holds, by content: the sha256 of each shard (and loss mask) and of the
    tokenizer, from its manifest, combined into one fingerprint."""
    data_dir = Path(data_dir)
    try:
        manifest = json.loads((data_dir / "manifest.json").read_text())
    except (OSError, ValueError):
        return {"source": source or str(data_dir), "dir": str(data_dir), "fingerprint": None}
    shards: dict[str, str] = {}
    tokens: dict[str, int] = {}
    for split, body in manifest.get("splits", {}).items():
        tokens[split] = body.get("num_tokens", 0)
        for shard in body.get("shards", []):
            shards[f"{split}/{shard['file']}"] = shard.get("sha256", "?")
            if "mask_file" in shard:
                shards[f"{split}/{shard['mask_file']}"] = shard.get("mask_sha256", "?")
    h = hashlib.sha256(json.dumps([manifest.get("tokenizer_sha256"), sorted(shards.items())]).encode())
    return {
        "source": source or str(data_dir),
        "dir": str(data_dir.resolve()),
        "fingerprint": h.hexdigest(),
        "tokenizer_sha256": manifest.get("tokenizer_sha256"),
        "num_tokens": tokens,
        "loss_mask": bool(manifest.get("loss_mask")),
        "shards": shards,
    }


def process_info() -> dict[str, Any]:
    return {"pid": os.getpid(), "host": socket.gethostname()}
