"""DiLoCo (Douillard et al. 2023): a fault-tolerant run whose groups communicate once a round, not every step
(parallel.diloco_sync_every = H). Each group takes H steps of its own optimizer on its own samples; at the
round's end the groups average their weights' change over the round (the pseudo-gradient: weights at the
round's start minus now, checked like a gradient: plait.parallel.replicas.contributions), every group goes
back to the round's start, and an outer Nesterov SGD step (parallel.diloco_outer_lr, _momentum) applies the
average. Traffic between groups: one allreduce of the weights' size per round instead of one of the
gradients' size per step, so H times less (replicas/sent_mb in the metrics counts it).

A round is the commit unit, as a step is for synchronous groups (plait.engine.replicas): its quorum is taken at
its start (healing a group that is behind, and placing each group's samples), and if a group fails during it,
no group commits it: the weights go back to the round's start and its samples are trained by the next round.
The inner optimizers' state and the LR schedules keep the failed round's steps (as torchft's DiLoCo does).

Why not torchft's own DiLoCo class: it takes the quorum at a round's end (after the samples were read, so the
round's data cannot follow the membership), and it averages without a place to check the contributions first.
plait uses torchft's Manager for the quorum, healing and commit, as the synchronous mode does.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from plait.config import Config
from plait.engine.checkpoint.state import Part, TrainState
from plait.engine.metrics import info
from plait.engine.replicas import FaultTolerant, flatten, local_tensor, unflatten_into
from plait.parallel import DistEnv, Meshes


class OuterOptimizer(Part):
    """DiLoCo's outer Nesterov momentum, one buffer per weight (``outer.<i>``, the i-th trained parameter): in
    each checkpoint, and part of what a joining group heals from. A checkpoint without it (another kind of run)
    leaves it fresh."""

    TENSORS = ("outer",)
    OPTIONAL = True

    def __init__(self, outer: torch.optim.SGD, params: list[torch.nn.Parameter]):
        self.outer, self.params = outer, params

    def state_dict(self) -> dict[str, Any]:
        buffers = [self.outer.state.get(p, {}).get("momentum_buffer") for p in self.params]
        return {"outer": {str(i): b if b is not None else torch.zeros_like(p) for i, (b, p) in
                          enumerate(zip(buffers, self.params, strict=True))}}  # fmt: skip

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "outer" not in state_dict:
            return
        for i, p in enumerate(self.params):
            self.outer.state[p]["momentum_buffer"] = state_dict["outer"][str(i)]


class LowCommunication(FaultTolerant):
    """This group's part in a DiLoCo run (see the module docstring)."""

    def __init__(self, cfg: Config, env: DistEnv, meshes: Meshes, t, loader, state: TrainState) -> None:
        self.params = [p for p in t.parameters() if p.requires_grad]
        p = cfg.parallel
        m = p.diloco_outer_momentum  # 0: plain averaging of the weights' change (local SGD's)
        self.outer = torch.optim.SGD(self.params, lr=p.diloco_outer_lr, momentum=m, nesterov=m > 0)
        super().__init__(cfg, env, meshes, t, loader, state)
        outer = OuterOptimizer(self.outer, self.params)
        self.parts.append(outer)  # healed from a peer...
        t.extra_state.append(outer)  # ...and checkpointed
        self.local_step = 0  # steps taken in this round
        self.start: list[torch.Tensor] = []  # this rank's shards of the weights at the round's start
        self.rounds_failed = 0

    def start_step(self) -> None:
        if self.local_step == 0:
            self.join()  # the round's quorum (a heal replaces the weights: the round starts from them)
            self.start = [local_tensor(p.detach()).clone() for p in self.params]

    def mean_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss  # between averagings each group reports its own

    def average_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Inside a round each group steps on its own gradients."""

    def commit(self) -> bool:
        return True  # an inner step always counts; the round commits (or not) in after_update

    def after_update(self) -> None:
        self.local_step += 1
        if self.local_step < self.round:
            return
        self.local_step = 0
        now = [local_tensor(p.detach()) for p in self.params]
        delta = flatten(self.start) - flatten(now)  # the pseudo-gradient: how far this group moved in the round
        self.average(delta)
        committed = self.group.commit()
        with torch.no_grad():
            for p, s in zip(self.params, self.start, strict=True):
                local_tensor(p.data).copy_(s)  # every group back to the round's start...
        if committed:
            self.settle()
            grads = [torch.empty_like(s) for s in self.start]
            unflatten_into(delta, grads)
            for p, g in zip(self.params, grads, strict=True):
                p.grad = _placed_like(g, p)
            self.outer.step()  # ...then the same outer step on each
            self.outer.zero_grad(set_to_none=True)
            return
        self.failed += 1
        self.rounds_failed += 1
        self.place()  # the round's share again (the next round's quorum may place it elsewhere)
        if self.env.is_main:
            info(
                f"replica {self.group.replica_id}: the round ending at step {self.state.step + 1} was not committed "
                f"({self.group.error.splitlines()[0][:160] if self.group.error else 'a group could not finish it'}); "
                "its weights are undone and its samples go to the next round"
            )

    def record(self) -> dict[str, Any]:
        out = super().record()
        out["rounds_failed"] = self.rounds_failed
        return out


def _placed_like(local: torch.Tensor, param: torch.nn.Parameter) -> torch.Tensor:
    if isinstance(param, DTensor):
        return DTensor.from_local(
            local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
        )
    return local.to(param.dtype)
