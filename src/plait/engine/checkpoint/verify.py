"""Whether a checkpoint fits what is to be loaded from it, before any tensor is read: its DCP metadata (the
hash plait.json names; parsed without unpickling), every wanted tensor present with its shape, no pickled
objects, every shard file present and long enough; and all ranks agreeing on the verdict."""

from __future__ import annotations

import hashlib
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from plait.core import storage
from plait.core.errors import PlaitError
from plait.core.storage import DCP_METADATA, Location
from plait.engine.checkpoint.wording import one_line, some

META = storage.META_FILE


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """DCP's key for each leaf: nested names joined with dots."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def check(
    path: Location, meta: dict, wanted: dict, expect_model: set[str] | None = None
) -> tuple[list[str], Metadata | None]:
    """Everything that would make loading `wanted` from `path` fail or load wrong, as readable lines."""
    try:
        raw = storage.read_bytes(path / DCP_METADATA)
    except Exception as e:
        return [f"{DCP_METADATA} cannot be read ({one_line(e)})"], None
    expected_hash = meta.get("dcp_metadata_sha256")
    if expected_hash and hashlib.sha256(raw).hexdigest() != expected_hash:
        return [f"{DCP_METADATA} does not match the hash in {META} (damaged, or files of different saves)"], None
    try:
        md = storage.parse_metadata(raw)
    except PlaitError as e:
        return [str(e)], None
    saved = md.state_dict_metadata
    problems: list[str] = []
    missing, not_tensor, shapes = [], [], []
    for key, value in flatten(wanted).items():
        entry = saved.get(key)
        if entry is None:
            missing.append(key)
        elif not isinstance(entry, TensorStorageMetadata):
            not_tensor.append(key)
        elif tuple(entry.size) != tuple(value.shape):
            shapes.append(f"{key} {tuple(entry.size)} in the checkpoint, {tuple(value.shape)} in the model")
    if expect_model is not None:
        unexpected = sorted(k for k in saved if k.startswith("model.") and k not in expect_model)
        if unexpected:
            problems.append(f"{len(unexpected)} tensors not in this model: {some(unexpected, 2)}")
    if missing:
        kinds = {"model": "of the model", "optim": "of the optimizer state"}
        parts = []
        for kind in sorted({k.split(".", 1)[0] for k in missing}):
            names = sorted(k for k in missing if k.split(".", 1)[0] == kind)
            parts.append(f"{len(names)} {kinds.get(kind, kind)} ({some(names, 1)})")
        problems.append("tensors missing from the checkpoint: " + ", ".join(parts))
    if shapes:  # one example: the settings that differ (said first, where known) are the cause
        problems.append(f"{len(shapes)} shape{'s differ' if len(shapes) > 1 else ' differs'}, e.g. {shapes[0]}")
    if not_tensor:
        problems.append(f"not tensors (pickled objects, which plait never loads): {some(sorted(not_tensor))}")
    problems.extend(_check_files(path, md))
    return problems, md


def _check_files(path: Location, md: Metadata) -> list[str]:
    """Every shard file DCP's metadata points into exists and is long enough."""
    need: dict[str, int] = {}
    for info in (md.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        if rel is not None:
            need[rel] = max(need.get(rel, 0), info.offset + info.length)
    try:
        sizes = storage.file_sizes(path)
    except Exception as e:
        return [f"its files cannot be listed ({one_line(e)})"]
    missing = sorted(f for f in need if f not in sizes)
    short = sorted(f"{f} has {sizes[f]} of {n} bytes" for f, n in need.items() if f in sizes and sizes[f] < n)
    out = []
    if missing:
        out.append(f"{len(missing)} shard files missing: {some(missing)}")
    if short:
        out.append(f"{len(short)} shard files truncated: {some(short)}")
    return out


def agree(problems: list[str], path: Location, group) -> None:
    """Raise on every rank if any rank found a problem (ranks check different tensors: pipeline stages)."""
    if group is not None:
        everyone: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, problems, group=group)
        merged: list[str] = []
        for rank_problems in everyone:
            merged.extend(p for p in rank_problems if p not in merged)
        problems = merged
    if problems:
        raise PlaitError(f"checkpoint {path} cannot be loaded: " + "; ".join(problems))


def model_settings_differ(saved, current: dict) -> str:
    """'model.dim 64 in the checkpoint, 128 here; ...' for the model settings that differ (at most 3)."""
    before = saved.get("model") if isinstance(saved, dict) else None
    now = current.get("model") if isinstance(current, dict) else None
    if not isinstance(before, dict) or not isinstance(now, dict):
        return ""
    diff = [f"model.{k}: {before[k]!r} in the checkpoint, {v!r} here" for k, v in now.items() if before.get(k, v) != v]
    return "; ".join(diff[:3]) + (f" and {len(diff) - 3} more" if len(diff) > 3 else "")
