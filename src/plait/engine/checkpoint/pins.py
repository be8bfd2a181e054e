"""Pins: a checkpoint that something else depends on (the base of a fine-tune, an export, an adapter) is kept
by its run's retention. The dependent writes one small file beside the checkpoints,
``<checkpoints>/pins/<step_N>.<id>.json`` (whole or not at all), saying what depends on it; retention
(CheckpointManager._retain) keeps a pinned checkpoint past checkpoint.keep_last and says so once. A pin is
removed by hand (or `plait lineage pins`) when its dependent is gone. Written from above (plait.lifecycle's
lineage registry), read here: this module knows no lineage."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from plait.core import storage
from plait.core.storage import Location

PINS_DIR = "pins"
_PIN = re.compile(r"^(step_\d+)\.([A-Za-z0-9_-]{1,64})\.json$")


def pin(ckpt: Location, holder: dict[str, Any], pin_id: str = "") -> Location:
    """Keep `ckpt` from retention for `holder` (what depends on it: kind, name, path, ...); the pin's path."""
    pin_id = pin_id or uuid.uuid4().hex[:16]
    if not _PIN.match(f"{ckpt.name}.{pin_id}.json"):
        raise ValueError(f"cannot pin {ckpt} as {pin_id!r}: a step_<N> checkpoint and a plain id are needed")
    where = ckpt.parent / PINS_DIR
    storage.makedirs(where)
    path = where / f"{ckpt.name}.{pin_id}.json"
    storage.write_bytes(path, json.dumps({"checkpoint": str(ckpt), **holder}, indent=1).encode())
    return path


def pinned(tree: dict[str, set[str]]) -> dict[str, list[str]]:
    """{checkpoint name: [pin file, ...]} from a listing of a checkpoints directory (storage.list_tree)."""
    out: dict[str, list[str]] = {}
    for name in sorted(tree.get(PINS_DIR, ())):
        if m := _PIN.match(name):
            out.setdefault(m.group(1), []).append(name)
    return out


def describe_pin(ckpt_dir: Location, name: str) -> str:
    """'adapter sft-1 (runs/sft-1)' from a pin file; its file name where it cannot be read."""
    try:
        holder = json.loads(storage.read_bytes(ckpt_dir / PINS_DIR / name))
        label = " ".join(str(holder[k]) for k in ("kind", "name") if holder.get(k))
        return f"{label} ({holder['path']})" if holder.get("path") else label or name
    except Exception:
        return f"{PINS_DIR}/{name}"


def pins_of(ckpt_dir: Location) -> list[tuple[str, str, str]]:
    """(checkpoint name, pin file, what depends on it) for each pin in a checkpoints directory."""
    try:
        tree = storage.list_tree(ckpt_dir)
    except FileNotFoundError:
        return []
    return [(c, n, describe_pin(ckpt_dir, n)) for c, names in pinned(tree).items() for n in names]
