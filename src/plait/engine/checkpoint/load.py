"""Loading a checkpoint into a model, or into a whole run (model, optimizer, LR schedule, data position, RNG,
counters), under any layout: tensors only, never unpickled, each record's CRC32 checked while it is read."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from plait.core import storage
from plait.core.errors import PlaitError
from plait.core.storage import Location, RemotePath
from plait.engine.checkpoint.find import read_meta
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


def state_dicts(t) -> tuple[dict, dict, list]:
    """Model and optimizer tensors of all this rank's parts, keyed by fully qualified parameter name
    (identical under every layout, which is what makes checkpoints load anywhere)."""
    model_sd: dict = {}
    optim_sd: dict = {}
    groups: list = []
    for part, opt in zip(t.parts, t.optimizers, strict=True):
        model_sd.update(get_model_state_dict(part))
        osd = get_optimizer_state_dict(part, opt)
        optim_sd.update(cast(dict, osd["state"]))
        groups.extend(osd["param_groups"])
    return model_sd, optim_sd, groups


def _names(part: nn.Module) -> set[str]:
    return set(get_model_state_dict(part))


def _union(names: set[str], group) -> set[str]:
    """The union of every rank's names (pipeline stages hold different parts of the model)."""
    if group is None:
        return names
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, sorted(names), group=group)
    return {n for rank_names in everyone for n in rank_names}


def rng_state() -> dict[str, torch.Tensor]:
    out = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def _set_rng_state(rng: dict[str, torch.Tensor]) -> None:
    if "cpu" in rng:
        torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])


def load_state(path: Location, t, *, loader, state, group, rank: int, config: dict) -> None:
    """Restore into this rank's (possibly differently sharded) model parts and optimizers, their LR schedules,
    the data position, this rank's RNG and the counters. Every rank checks the tensors it needs (present,
    tensors, same shapes; files present and long enough) and all agree (over `group`) before anything is read;
    corrupt bytes are found while reading (see plait.engine.checkpoint)."""
    meta = read_meta(path)
    if meta.get("weights_only"):  # `plait ckpt import`: fine-tune these weights from step 0
        for part in t.parts:
            load_model_weights(part, path, group=group)
        return
    model_sd, optim_sd, _ = state_dicts(t)  # also creates empty Adam state to load into
    wanted = {"model": model_sd, "optim": optim_sd}
    everyone = _union({f"model.{k}" for k in model_sd}, group)  # all pipeline stages' tensors
    problems, md = check(path, meta, wanted, expect_model=everyone)
    if problems and (other := model_settings_differ(meta.get("config"), config)):
        problems.insert(0, f"it is of another model ({other})")
    # RNG state of this rank, where the saving run had this rank (and this kind of device)
    saved = md.state_dict_metadata if md is not None else {}
    rng = {k: v for k, v in rng_state().items() if f"rng.rank_{rank}.{k}" in saved}
    if rng:
        wanted["rng"] = {f"rank_{rank}": rng}
    agree(problems, path, group)
    agree(_read(wanted, path), path, group)
    for part, opt in zip(t.parts, t.optimizers, strict=True):
        set_model_state_dict(
            part, {k: v for k, v in model_sd.items() if k in _names(part)}, options=StateDictOptions(strict=True)
        )
        current = get_optimizer_state_dict(part, opt)
        state_part = {k: v for k, v in optim_sd.items() if k in current["state"]}
        set_optimizer_state_dict(part, opt, {"state": state_part, "param_groups": current["param_groups"]})
    _load_schedules(meta, t)
    loader.load_state_dict(meta["loader"])
    state.step, state.tokens = meta["train_state"]["step"], meta["train_state"]["tokens"]
    if rng:
        _set_rng_state(rng)


def _load_schedules(meta: dict, t) -> None:
    """Each part's LR schedule: its own where the saving run had as many parts, else the first part's (every
    part follows the same schedule; a resharded pipeline has another number of parts)."""
    saved = meta.get("schedulers") or [meta["scheduler"]]
    for i, (sched, opt) in enumerate(zip(t.schedulers, t.optimizers, strict=True)):
        sched.load_state_dict(saved[i] if len(saved) == len(t.schedulers) else saved[0])
        # The next update must use the LR the schedule had reached, not the fresh optimizer's.
        for group, lr in zip(opt.param_groups, sched.get_last_lr(), strict=True):
            group["lr"] = lr


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
