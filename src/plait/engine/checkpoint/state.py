"""What a checkpoint holds of a run, as Stateful objects (torch.distributed.checkpoint.stateful.Stateful): the
model parts, the counters, the data position, the LR schedules, the optimizers and this rank's RNG, assembled
in one list (`run_state`) that saving and loading both go through.

A part's state_dict() is the checkpoint entries it owns, by top-level name. The entries its TENSORS names go
into DCP's files (keys ``model.<fqn>``, ``optim.<fqn>.exp_avg``, ``rng.rank_<r>.cpu``: the same under every
layout), the others into plait.json as plain JSON. load_state_dict() is given every entry of the checkpoint
(the tensors read in place into the dicts state_dict() returned) and restores its own. The list's order is
the order of plait.json's keys and the order of restoring (the model before its optimizer)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, ClassVar, cast

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful


@dataclass
class TrainState:
    """Counters of a run: restored exactly on resume."""

    step: int = 0
    tokens: int = 0


class Part(Stateful):
    """One piece of a run's state in a checkpoint (see the module docstring)."""

    TENSORS: ClassVar[tuple[str, ...]] = ()
    """The entries of state_dict() that are tensors, written by DCP; the others go into plait.json."""
    OPTIONAL: ClassVar[bool] = False
    """Loaded only where the checkpoint has it (the RNG of a rank, and a kind of device, the saving run had)."""

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise NotImplementedError


class ModelParts(Part):
    """This rank's model parts, as one dict keyed by fully qualified parameter name (identical under every
    layout, which is what makes checkpoints load anywhere)."""

    TENSORS = ("model",)

    def __init__(self, parts: list[nn.Module]):
        self.parts = parts

    def state_dict(self) -> dict[str, Any]:
        model: dict = {}
        for part in self.parts:
            model.update(get_model_state_dict(part))
        return {"model": model}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        model = state_dict["model"]
        for part in self.parts:
            names = set(get_model_state_dict(part))
            set_model_state_dict(
                part, {k: v for k, v in model.items() if k in names}, options=StateDictOptions(strict=True)
            )


class Optimizers(Part):
    """The optimizers' state per parameter name (tensors), and their parameter groups (plain JSON, written for
    the reader: a resumed run keeps its own groups, and its LR schedules set their learning rates). Asking for
    the state dict also creates an empty Adam state to load into."""

    TENSORS = ("optim",)

    def __init__(self, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]):
        self.parts, self.optimizers = parts, optimizers

    def state_dict(self) -> dict[str, Any]:
        optim: dict = {}
        groups: list = []
        for part, opt in zip(self.parts, self.optimizers, strict=True):
            osd = get_optimizer_state_dict(part, opt)
            optim.update(cast(dict, osd["state"]))
            groups.extend(osd["param_groups"])
        return {"optim": optim, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        optim = state_dict["optim"]
        for part, opt in zip(self.parts, self.optimizers, strict=True):
            current = get_optimizer_state_dict(part, opt)
            state_part = {k: v for k, v in optim.items() if k in current["state"]}
            set_optimizer_state_dict(part, opt, {"state": state_part, "param_groups": current["param_groups"]})


class Schedules(Part):
    """Each part's LR schedule ("scheduler", the first one's, is what plait read before there were several)."""

    def __init__(self, schedulers: list, optimizers: list[torch.optim.Optimizer]):
        self.schedulers, self.optimizers = schedulers, optimizers

    def state_dict(self) -> dict[str, Any]:
        return {
            "scheduler": self.schedulers[0].state_dict(),
            "schedulers": [s.state_dict() for s in self.schedulers],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Its own schedule where the saving run had as many parts, else the first part's (every part follows
        the same schedule; a resharded pipeline has another number of parts)."""
        saved = state_dict.get("schedulers") or [state_dict["scheduler"]]
        for i, (sched, opt) in enumerate(zip(self.schedulers, self.optimizers, strict=True)):
            sched.load_state_dict(_regrouped(saved[i] if len(saved) == len(self.schedulers) else saved[0], sched))
            # The next update must use the LR the schedule had reached, not the fresh optimizer's.
            for group, lr in zip(opt.param_groups, sched.get_last_lr(), strict=True):
                group["lr"] = lr


def _regrouped(saved: dict, sched) -> dict:
    """A saved schedule for this optimizer's parameter groups: where their number differs (another optimizer,
    resumed with checkpoint.fresh_optimizer), its position and factor applied to this one's base rates."""
    if len(saved.get("base_lrs", [])) == len(sched.base_lrs) or not saved.get("base_lrs"):
        return saved
    factor = saved["_last_lr"][0] / saved["base_lrs"][0] if saved["base_lrs"][0] else 0.0
    return {**saved, "base_lrs": list(sched.base_lrs), "_last_lr": [b * factor for b in sched.base_lrs]}


class DataPosition(Part):
    """Where the data loader is (plait's token stream or your own samples: any loader with state_dict)."""

    def __init__(self, loader):
        self.loader = loader

    def state_dict(self) -> dict[str, Any]:
        return {"loader": self.loader.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loader.load_state_dict(state_dict["loader"])


class Counters(Part):
    """The run's step and token counters."""

    def __init__(self, state: TrainState):
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return {"train_state": asdict(self.state)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict["train_state"]
        self.state.step, self.state.tokens = saved["step"], saved["tokens"]


class Rng(Part):
    """This rank's CPU (and CUDA, where initialised) random generator states, under ``rng.rank_<r>``."""

    TENSORS = ("rng",)
    OPTIONAL = True

    def __init__(self, rank: int):
        self.rank = rank

    def state_dict(self) -> dict[str, Any]:
        return {"rng": {f"rank_{self.rank}": rng_state()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        rng = state_dict.get("rng", {}).get(f"rank_{self.rank}", {})
        if "cpu" in rng:
            torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])


def rng_state() -> dict[str, torch.Tensor]:
    out = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def run_state(t, *, loader, state: TrainState, rank: int) -> list[Part]:
    """Everything resumable of a run (`t`: its Trainable), in the order of plait.json's keys and of restoring."""
    return [
        ModelParts(t.parts),
        Counters(state),
        DataPosition(loader),
        Schedules(t.schedulers, t.optimizers),
        Optimizers(t.parts, t.optimizers),
        Rng(rank),
        *getattr(t, "extra_state", []),  # what a run's features add (DiLoCo's outer momentum)
    ]


def split(parts: list[Part]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the tensor entries, for DCP; the plain ones, for plait.json) of the parts, each in list order. Each
    part's state_dict() is asked once."""
    tensors: dict[str, Any] = {}
    plain: dict[str, Any] = {}
    for part in parts:
        for key, value in part.state_dict().items():
            (tensors if key in part.TENSORS else plain)[key] = value
    return tensors, plain
