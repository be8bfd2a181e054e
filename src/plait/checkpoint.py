"""Checkpoints with torch.distributed.checkpoint (DCP): sharded, layout-independent, atomic.

A checkpoint is a directory ``<run>/checkpoints/step_<N>/`` holding
- DCP files with every tensor: the model (fully qualified names) and the optimizer state per parameter
  name, so it loads under another layout or world size;
- ``plait.json`` with everything that is not a tensor (step, token count, data-loader position, optimizer
  hyper-parameters, the resolved config) — plain JSON, so loading never unpickles anything;
- ``tokenizer.json``, so ``plait generate`` needs nothing but the checkpoint.

A save writes to ``step_<N>.tmp`` and renames it when complete: a crash mid-save leaves no directory that
looks like a checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from plait.config import CheckpointConfig
from plait.errors import PlaitError

_STEP_DIR = re.compile(r"^step_(\d+)$")
META = "plait.json"


@dataclass
class TrainState:
    """Counters of a run: restored exactly on resume."""

    step: int = 0
    tokens: int = 0


def list_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    if not ckpt_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckpt_dir.iterdir() if (m := _STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found) if (p / META).is_file() and (p / ".metadata").is_file()]


def read_meta(path: Path) -> dict[str, Any]:
    try:
        return json.loads((path / META).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PlaitError(f"checkpoint {path} has no readable {META}: {e}") from None


class CheckpointManager:
    """Saves and restores model, optimizer, LR schedule, data position and counters of a run."""

    def __init__(self, ckpt_dir: Path, cfg: CheckpointConfig, *, is_writer: bool = True):
        self.dir = ckpt_dir
        self.cfg = cfg
        self.is_writer = is_writer

    def should_save(self, step: int, total_steps: int) -> bool:
        every = self.cfg.every_steps
        return (every > 0 and step % every == 0) or (step == total_steps and self.cfg.save_final)

    def save(self, step: int, t, *, loader, state: TrainState, config: dict, tokenizer_path: Path | None) -> Path:
        """Every rank writes its shards; the main rank writes the metadata and publishes the directory."""
        final = self.dir / f"step_{step:08d}"
        tmp = self.dir / f"step_{step:08d}.tmp"
        if self.is_writer:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()
        model_sd, optim_sd, groups = _state_dicts(t)
        with _single_process_quiet():
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
        if self.is_writer:
            meta = {
                "format": "plait-checkpoint-v1",
                "train_state": asdict(state),
                "loader": loader.state_dict(),
                "scheduler": t.schedulers[0].state_dict(),
                "param_groups": groups,
                "config": config,
            }
            (tmp / META).write_text(json.dumps(meta, indent=1, default=_jsonable))
            if tokenizer_path is not None:
                shutil.copyfile(tokenizer_path, tmp / "tokenizer.json")
            if final.exists():  # an older save of the same step (a rerun): replace it only now
                shutil.rmtree(final)
            tmp.rename(final)
            self._retain()
        _barrier()
        return final

    def load(self, path: Path, t, *, loader, state: TrainState) -> None:
        """Restore into this rank's (possibly differently sharded) model parts and optimizers."""
        meta = read_meta(path)
        if meta.get("weights_only"):  # `plait ckpt import`: fine-tune these weights from step 0
            for part in t.parts:
                load_model_weights(part, path)
            return
        model_sd, optim_sd, _ = _state_dicts(t)  # also creates empty Adam state to load into
        _dcp_load({"model": model_sd, "optim": optim_sd}, path)
        for part, opt in zip(t.parts, t.optimizers, strict=True):
            set_model_state_dict(
                part, {k: v for k, v in model_sd.items() if k in _names(part)}, options=StateDictOptions(strict=True)
            )
            current = get_optimizer_state_dict(part, opt)
            state_part = {k: v for k, v in optim_sd.items() if k in current["state"]}
            set_optimizer_state_dict(part, opt, {"state": state_part, "param_groups": current["param_groups"]})
        for sched, opt in zip(t.schedulers, t.optimizers, strict=True):
            sched.load_state_dict(meta["scheduler"])
            # The next update must use the LR the schedule had reached, not the fresh optimizer's.
            for group, lr in zip(opt.param_groups, sched.get_last_lr(), strict=True):
                group["lr"] = lr
        loader.load_state_dict(meta["loader"])
        state.step, state.tokens = meta["train_state"]["step"], meta["train_state"]["tokens"]

    def _retain(self) -> None:
        keep = max(1, self.cfg.keep_last)
        for old in list_checkpoints(self.dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)


def _state_dicts(t) -> tuple[dict, dict, list]:
    """Model and optimizer tensors of all this rank's parts, keyed by fully qualified parameter name
    (identical under every layout, which is what makes checkpoints load anywhere)."""
    model_sd: dict = {}
    optim_sd: dict = {}
    groups: list = []
    for part, opt in zip(t.parts, t.optimizers, strict=True):
        model_sd.update(get_model_state_dict(part))
        osd = get_optimizer_state_dict(part, opt)
        optim_sd.update(osd["state"])
        groups.extend(osd["param_groups"])
    return model_sd, optim_sd, groups


def _names(part: nn.Module) -> set[str]:
    return set(get_model_state_dict(part))


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def load_model_weights(model: nn.Module, path: Path) -> None:
    """Load only the model from a checkpoint (generation, evaluation, export)."""
    sd = get_model_state_dict(model)
    _dcp_load({"model": sd}, path)
    set_model_state_dict(model, sd, options=StateDictOptions(strict=True))


def _dcp_load(state: dict, path: Path) -> None:
    try:
        with _single_process_quiet():
            dcp.load(state, checkpoint_id=str(path))
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        raise PlaitError(f"checkpoint {path} does not match this model: {_short(e)}") from None


@contextlib.contextmanager
def _single_process_quiet():
    """DCP warns that it 'assumes' a single process when no group exists: that is intended here."""
    with warnings.catch_warnings():
        if not dist.is_initialized():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _short(e: Exception) -> str:
    text = str(e).strip().splitlines()
    hits = [line.strip() for line in text if "Size mismatch" in line or "Missing key" in line or "size" in line]
    return "; ".join(hits[:5]) or (text[-1] if text else type(e).__name__)


def _jsonable(obj):
    if isinstance(obj, torch.Tensor):
        return obj.item()
    if isinstance(obj, tuple):
        return list(obj)
    raise TypeError(f"cannot store {type(obj).__name__} in checkpoint metadata")
