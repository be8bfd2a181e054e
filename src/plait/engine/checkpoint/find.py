"""Finding checkpoints: where a run's live, which of them are complete or damaged, the newest that loads, and
the plain-JSON part of one (plait.json). Reads only."""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from plait.config import Config
from plait.core import storage
from plait.core.errors import ConfigError, PlaitError
from plait.core.storage import DCP_METADATA, Location, RemotePath
from plait.engine.checkpoint.verify import check
from plait.engine.checkpoint.wording import one_line, some, warn

STEP_DIR = re.compile(r"^step_(\d+)$")
ANY_STEP_DIR = re.compile(r"^step_(\d+)(\.tmp)?$")
META = storage.META_FILE
FORMAT = "plait-checkpoint-v1"


def checkpoint_dir(cfg: Config) -> Location:
    """Where this run's checkpoints go: checkpoint.dir (a directory or s3://bucket/prefix), by default
    <run.out_dir>/<run.name>/checkpoints."""
    if cfg.run.out_dir.startswith("s3://"):
        raise ConfigError(
            f"run.out_dir={cfg.run.out_dir!r}: metrics and TensorBoard files need a local directory; put only "
            f"the checkpoints on S3 with checkpoint.dir=s3://bucket/prefix"
        )
    if not cfg.checkpoint.dir:
        return cfg.run_dir / "checkpoints"
    return storage.location(cfg.checkpoint.dir, cfg.checkpoint.s3_endpoint)


def list_checkpoints(ckpt_dir: Location | str) -> list[Location]:
    """Published checkpoints (with plait.json and DCP metadata), oldest first."""
    return scan_checkpoints(ckpt_dir)[0]


def scan_checkpoints(ckpt_dir: Location | str) -> tuple[list[Location], list[tuple[Location, str]]]:
    """(complete checkpoints, damaged ones with what is wrong), each oldest first.

    Complete: a step directory with plait.json and DCP's .metadata. Damaged: a published step directory
    (plait.json, or locally any ``step_<N>`` without ``.tmp``, which only a publish creates) that lacks one
    of them. Damaged checkpoints are never loaded, counted for retention, or deleted by plait. A remote
    step directory without plait.json is a save that never finished, not a damaged checkpoint."""
    root = ckpt_dir if isinstance(ckpt_dir, Path | RemotePath) else storage.location(ckpt_dir)
    return classify(root, _tree(root))


def _tree(root: Location) -> dict[str, set[str]]:
    try:
        return storage.list_tree(root)
    except PlaitError:
        raise
    except Exception as e:
        fix = (
            "; check that the server is up, checkpoint.s3_endpoint (or AWS_ENDPOINT_URL) and the AWS credentials"
            if isinstance(root, RemotePath)
            else ""
        )
        raise PlaitError(f"cannot list checkpoints in {root}: {one_line(e)}{fix}") from None


def classify(root: Location, tree: dict[str, set[str]]) -> tuple[list[Location], list[tuple[Location, str]]]:
    complete, damaged = [], []
    for name, files in tree.items():
        if not (m := STEP_DIR.match(name)):
            continue
        if META in files and DCP_METADATA in files:
            complete.append((int(m.group(1)), name, ""))
        elif META in files or not storage.is_remote(root):
            lost = [f for f in (META, DCP_METADATA) if f not in files]
            damaged.append((int(m.group(1)), name, f"{' and '.join(lost)} missing"))
    return [root / n for _, n, _ in sorted(complete)], [(root / n, why) for _, n, why in sorted(damaged)]


def _missing(loc: Location) -> str:
    """Why a checkpoint named by its step is not there, and what to do (its run's retention, or a hand, deleted
    it; a base something depends on is kept only where that dependent pinned it)."""
    plain = f"{loc} does not exist: give a checkpoint directory or a run directory"
    if not STEP_DIR.match(loc.name):
        return plain
    try:
        left = list_checkpoints(loc.parent)
    except Exception:
        return plain
    if not left:
        return plain
    return (
        f"checkpoint {loc} does not exist (any more): {loc.parent} now holds {', '.join(c.name for c in left[-4:])}; "
        f"its run's retention (checkpoint.keep_last) or a hand deleted it. A fine-tune, export or adapter made from "
        f"it keeps it only if recorded in the lineage registry (`plait lineage pins`). Start again from one that "
        f"exists (e.g. --finetune.init_from={left[-1]}), or restore that checkpoint from a copy"
    )


def checkpoint_problems(path: Location) -> str:
    """Why a checkpoint with both files present still cannot be loaded ("" if it looks loadable): plait.json
    unreadable or without a step and config, .metadata not the one plait.json names, shard files missing or
    short. Reads plait.json and .metadata only, not the tensors (their CRC32s are checked while loading)."""
    try:
        meta = read_meta(path)
        state = meta.get("train_state", {})
        step = state.get("step", 0) if isinstance(state, dict) else None
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            return f"{META} has no valid step ({step!r})"
        if not meta.get("weights_only") and not isinstance(meta.get("config"), dict):
            return f"{META} has no config"
    except PlaitError as e:
        return str(e)
    problems, md = check(path, meta, {})
    objects = sorted(
        k for k, v in (md.state_dict_metadata if md else {}).items() if not isinstance(v, TensorStorageMetadata)
    )
    if objects:  # plait writes tensors only: these were put there by something else
        problems.append(f"not tensors (pickled objects, which plait never loads): {some(objects)}")
    return "; ".join(problems)


def read_config(path: Location | str):
    """The resolved Config a checkpoint was written with; PlaitError naming the problem if plait.json has none
    or one plait cannot read."""
    from plait.config import from_dict

    meta = read_meta(path)
    if not isinstance(meta.get("config"), dict):
        raise PlaitError(f"checkpoint {path} is damaged: its {META} has no config (the model's shape is unknown)")
    try:
        return from_dict(meta["config"])
    except PlaitError as e:
        raise PlaitError(f"checkpoint {path} is damaged: the config in its {META} is not valid ({e})") from None


def read_meta(path: Location | str) -> dict[str, Any]:
    path = path if isinstance(path, Path | RemotePath) else storage.location(path)
    try:
        meta = json.loads(storage.read_bytes(path / META))
    except PlaitError:
        raise
    except Exception as e:
        raise PlaitError(f"checkpoint {path} has no readable {META}: {one_line(e)}") from None
    if not isinstance(meta, dict):
        raise PlaitError(f"checkpoint {path} is damaged: its {META} is not a JSON object")
    return meta


def resolve_checkpoint(ref: str | os.PathLike | Location, endpoint: str = "") -> Location:
    """A checkpoint (a local directory or an s3:// prefix holding plait.json), or the newest complete
    checkpoint of a run directory or of a checkpoints directory. The S3 endpoint comes from ``endpoint``, else
    $AWS_ENDPOINT_URL."""
    loc = ref if isinstance(ref, Path | RemotePath) else storage.location(ref, endpoint)
    try:
        if storage.exists(loc / META):
            return loc
        found = storage.exists(loc)
    except PlaitError:
        raise
    except Exception as e:
        raise PlaitError(f"cannot read {loc}: {one_line(e)}") from None
    if not found:
        raise PlaitError(_missing(loc))
    ckpts, broken = scan_checkpoints(loc / "checkpoints")
    if not ckpts and not broken:
        ckpts, broken = scan_checkpoints(loc)
    if not ckpts and not broken:
        raise PlaitError(f"{loc} holds no complete checkpoint (looked for step_*/{META})")
    usable, damaged = newest_first(ckpts)
    newest = step_of(usable[0]) if usable else -1
    damaged = sorted([*damaged, *(d for d in broken if step_of(d[0]) > newest)], key=lambda d: step_of(d[0]))
    problems = "; ".join(f"{p.name}: {why}" for p, why in damaged)
    if not usable:
        raise PlaitError(f"{loc} holds only damaged checkpoints: {problems}")
    if damaged:
        warn(f"the newer checkpoints are damaged and skipped ({problems}); using {usable[0]}")
    return usable[0]


def newest_first(ckpts: list[Location]) -> tuple[list[Location], list[tuple[Location, str]]]:
    """Complete checkpoints (oldest first, as `list_checkpoints` gives them) newest first from the newest that
    is not damaged (`checkpoint_problems`), and the newer ones passed over, each with what is wrong with it."""
    usable, damaged = list(reversed(ckpts)), []
    while usable and (why := checkpoint_problems(usable[0])):
        damaged.append((usable.pop(0), why))
    return usable, damaged


def local_file(loc: Location) -> Path | None:
    """A local path to a small file of a checkpoint (its tokenizer): the file itself, or for S3 a copy in a
    temporary directory that lives as long as the process. None where the file does not exist."""
    if isinstance(loc, Path):
        return loc if loc.is_file() else None
    if not storage.exists(loc):
        return None
    directory = Path(tempfile.mkdtemp(prefix="plait-s3-"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    target = directory / loc.name
    target.write_bytes(storage.read_bytes(loc))
    return target


def step_of(path: Location) -> int:
    m = ANY_STEP_DIR.match(path.name)
    return int(m.group(1)) if m else -1
