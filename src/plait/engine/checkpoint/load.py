"""Loading a checkpoint into a model, or into a whole run (model, optimizer, LR schedule, data position, RNG,
counters), under any layout: tensors only, never unpickled, each record's CRC32 checked while it is read."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from plait.core import storage
from plait.core.errors import ConfigError, PlaitError
from plait.core.storage import Location, RemotePath
from plait.engine.checkpoint.find import read_meta
from plait.engine.checkpoint.state import Optimizers, run_state, split
from plait.engine.checkpoint.verify import agree, check, model_settings_differ
from plait.engine.checkpoint.wording import short

# DCP warns on every save/load without a process group that it "assumes" one process: that is intended.
NO_DIST_WARNING = "torch.distributed is disabled, unavailable or uninitialized"


def load_model_weights(model: nn.Module, path: Location | str, *, group=None) -> None:
    """Load only the model from a checkpoint (generation, evaluation, export, a pipeline stage)."""
    path = path if isinstance(path, Path | RemotePath) else storage.location(path)
    sd = get_model_state_dict(model)
    problems, _ = check(path, read_meta(path), {"model": sd})
    agree(problems, path, group)
    agree(_read({"model": sd}, path), path, group)
    set_model_state_dict(model, sd, options=StateDictOptions(strict=True))


class _TensorsOnly(DefaultLoadPlanner):
    """DCP's planner, except that a non-tensor record is refused instead of unpickled."""

    def load_bytes(self, read_item, value) -> None:
        raise PlaitError(f"{read_item.dest_index.fqn} is a pickled object; plait loads tensors only")


def _read(state: dict, path: Location) -> list[str]:
    """Fill `state` in place from the checkpoint; the problems met (a checksum, a file that vanished).

    Every process reads on its own (DCP without collectives: its load plan needs nothing from other ranks,
    and DTensors pick out their own shards from the global metadata), so one rank can load alone (the main
    rank reading a published checkpoint back) and callers agree on the outcome afterwards."""
    try:
        with warnings.catch_warnings():  # pytest resets the module-level filter per test
            warnings.filterwarnings("ignore", message=NO_DIST_WARNING)
            dcp.load(state, storage_reader=storage.dcp_reader(path), planner=_TensorsOnly(), no_dist=True)
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        if isinstance(e, KeyboardInterrupt | SystemExit):
            raise
        return [f"reading failed: {short(e)}"]
    return []


def _union(names: set[str], group) -> set[str]:
    """The union of every rank's names (pipeline stages hold different parts of the model)."""
    if group is None:
        return names
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, sorted(names), group=group)
    return {n for rank_names in everyone for n in rank_names}


def load_state(path: Location, t, *, loader, state, group, rank: int, config: dict) -> None:
    """Restore into this rank's (possibly differently sharded) model parts and optimizers, their LR schedules,
    the data position, this rank's RNG and the counters (plait.engine.checkpoint.state.run_state). Every rank
    checks the tensors it needs (present, tensors, same shapes; files present and long enough) and all agree
    (over `group`) before anything is read; corrupt bytes are found while reading (see plait.engine.checkpoint).
    Only then is each part restored."""
    meta = read_meta(path)
    if meta.get("weights_only"):  # `plait ckpt import`: fine-tune these weights from step 0
        for part in t.parts:
            load_model_weights(part, path, group=group)
        return
    fresh = _fresh_optimizer(meta, config, path)
    parts = run_state(t, loader=loader, state=state, rank=rank)
    parts = [p for p in parts if not (fresh and isinstance(p, Optimizers))]
    wanted, _ = split([p for p in parts if p.TENSORS and not p.OPTIONAL])  # (the tensors to read into)
    everyone = _union({f"model.{k}" for k in wanted["model"]}, group)  # all pipeline stages' tensors
    problems, md = check(path, meta, wanted, expect_model=everyone)
    if problems and (other := model_settings_differ(meta.get("config"), config)):
        problems.insert(0, f"it is of another model ({other})")
    saved = md.state_dict_metadata if md is not None else {}
    optional, _ = split([p for p in parts if p.OPTIONAL])
    wanted.update(_present(optional, saved))  # e.g. the RNG where the saving run had this rank (and device)
    agree(problems, path, group)
    agree(_read(wanted, path), path, group)
    for part in parts:
        part.load_state_dict({**meta, **wanted})


def _fresh_optimizer(meta: dict, config: dict, path: Location) -> bool:
    """Whether to leave the optimizer's states out of this resume: asked for (checkpoint.fresh_optimizer), or
    refused, with the reason, where the checkpoint's optimizer is another (its states are of another kind)."""
    asked = bool(config.get("checkpoint", {}).get("fresh_optimizer"))
    saved_config = meta.get("config")
    saved_optim = saved_config.get("optim") if isinstance(saved_config, dict) else None
    before = saved_optim.get("name", "adamw") if isinstance(saved_optim, dict) else "adamw"
    now = config.get("optim", {}).get("name", "adamw")
    if before != now and not asked:
        raise ConfigError(
            f"checkpoint {path} was trained with optim.name={before!r} and this run has optim.name={now!r}: its "
            f"optimizer states are of another kind; set checkpoint.fresh_optimizer=true to resume the weights, step "
            f"and data position with a fresh {now} state, or optim.name={before!r} to continue as it trained"
        )
    return asked


def _present(tree: dict, saved: dict, prefix: str = "") -> dict:
    """The leaves of `tree` the checkpoint holds (by DCP key), without the branches left empty."""
    out: dict = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            if kept := _present(value, saved, f"{name}."):
                out[key] = kept
        elif name in saved:
            out[key] = value
    return out


def checkpoint_model(ckpt: Location, device: str | torch.device = "cpu") -> nn.Module:
    """The model a checkpoint holds, as its run trained it, in fp32 on ``device``: a LoRA run's checkpoint gives
    its frozen base with its adapters (unmerged, the training model's own computation), never the base alone.
    Every path that samples, evaluates or exports a run loads it here."""
    from plait.engine.checkpoint.find import read_config
    from plait.model.build import empty_model
    from plait.model.lora import apply_lora

    cfg = read_config(ckpt)
    model = empty_model(cfg.model, device)
    tune = cfg.finetune
    if tune.lora_rank:
        apply_lora(model, tune.lora_rank, tune.lora_alpha, tune.lora_targets)
    try:
        load_model_weights(model, ckpt)
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        if isinstance(e, KeyboardInterrupt | SystemExit | PlaitError):  # plait's own line says it already
            raise
        raise PlaitError(f"checkpoint {ckpt} does not match its own config: {str(e).strip()[-300:]}") from None
    return model
