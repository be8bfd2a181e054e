"""The replica groups of a run as the training step sees them: one group alone (every run that is not
fault-tolerant: nothing to join, sum or vote on, and every step commits), or one group of a fault-tolerant run
(parallel.fault_tolerant, on torchft: plait.parallel.replicas.group).

A fault-tolerant step, on every rank of every group alive at it:
1. start_step: join the step's quorum; a group that is behind heals from a live peer first (the same state a
   checkpoint holds: model, optimizer, schedules, counters; plait.engine.checkpoint.state), and the loader is
   placed at this group's share: the samples of a run form one stream, each group takes one share of
   global_batch_size of them per step, from the queue of shares left out earlier first, then from the frontier
   (plait.engine.ledger). A step that does not commit moves nothing, so its samples are trained by the next step
   that does, and a share the check left out goes back in the queue: no sample is trained twice or dropped,
   whoever comes, goes or is left out.
2. mean_loss and average_gradients: the loss and the gradients averaged over the groups (the gradients after
   the contribution check, plait.parallel.replicas.contributions, which leaves an offending group out, by name).
   Clipping and the guards then see the same values on every group, so every group takes the same update.
3. commit: the optimizer steps only where torchft says the step counts on every rank of the group.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from plait.config import Config
from plait.core.errors import PlaitError
from plait.engine.checkpoint.find import list_checkpoints, step_of
from plait.engine.checkpoint.state import Counters, ModelParts, Optimizers, Part, Schedules, TrainState
from plait.engine.ledger import SampleLedger, Share
from plait.engine.metrics import info
from plait.parallel import DistEnv, Meshes
from plait.parallel.env import restart_count
from plait.parallel.replicas.contributions import ContributionCheck


class Replicas:
    """One group alone: nothing to join, sum or vote on; every step commits."""

    verdict: Any = None  # the last step's contribution verdict (fault-tolerant runs with the check on)

    def start_step(self) -> None:
        """Join the step (a group alone has nothing to join)."""

    def mean_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def average_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Average the gradients over the groups (a group alone has only its own)."""

    def commit(self) -> bool:
        return True

    def after_update(self) -> None:
        """After the optimizer's step (DiLoCo: at a round's end, the groups' outer step)."""

    def record(self) -> dict[str, Any]:
        """What the last committed step's metrics say of the groups ({}: nothing for a group alone)."""
        return {}

    def close(self) -> None:
        pass


class FaultTolerant(Replicas):
    """This group's part in a fault-tolerant run (see the module docstring)."""

    def __init__(self, cfg: Config, env: DistEnv, meshes: Meshes, t, loader, state: TrainState) -> None:
        from plait.parallel.replicas.group import ReplicaGroup

        p = cfg.parallel
        self.cfg, self.env, self.meshes, self.loader, self.state = cfg, env, meshes, loader, state
        self.parts: list[Part] = [ModelParts(t.parts), Counters(state), Schedules(t.schedulers, t.optimizers),
                                  Optimizers(t.parts, t.optimizers)]  # fmt: skip
        self.check = ContributionCheck() if p.contribution_check else None
        self.contribution_hooks: list[Callable[[torch.Tensor], None]] = []  # what a group sends may be changed
        self.group = ReplicaGroup(
            replica_id=p.replica_id, lighthouse=p.lighthouse, min_replicas=p.min_replicas,
            timeout_s=p.timeout_s, save_state=self._save, load_state=self._load,
        )  # fmt: skip
        self.batch = cfg.train.global_batch_size  # each group's batch: samples per group per step
        self.round = max(p.diloco_sync_every, 1)  # steps between two averagings (DiLoCo: engine.diloco)
        self.ledger = SampleLedger(self.batch * self.round)  # the samples each step takes; healed and...
        t.extra_state.append(self.ledger)  # ...checkpointed
        self.shares: list[Share] = []  # this step's (round's) share of each slot
        self.first = 0  # the frontier at this step's start: its fresh block's first sample
        self.left_out: set[int] = set()  # the slots whose shares the last settled step put back in the queue
        self.restored = False  # the counters of the checkpoint the run resumed (at the first join)
        self.groups = 0
        self.failed = 0  # attempts of steps that did not commit, so far
        self.sent = 0.0  # bytes this rank sent to the other groups (a ring allreduce: 2 (n-1)/n of each buffer)
        self.membership: Any = None

    def start_step(self) -> None:
        self.join()

    def join(self) -> None:
        """This step's (or DiLoCo round's) quorum, and the loader placed at this group's samples: the round
        takes `groups x round x batch` samples from the committed frontier, this group every groups-th batch."""
        if not self.restored and restart_count() > 0 and (done := finished_elsewhere(self.cfg)):
            raise RunFinishedElsewhere(done)  # restarted after the others ended: nothing is left to train
        if not self.restored:  # the run's own checkpoint, if it resumed one: checkpoints fall at a round's end
            if not self.ledger.loaded:  # a fresh run, or a checkpoint of another kind of run: from its position
                self.ledger.frontier = self.loader.state_dict()["samples_consumed"]
            self.group.restore(self.state.step // self.round, self.ledger.frontier // self.ledger.share_samples)
            self.restored = True
        began = time.perf_counter()
        m = self.membership = self.group.start_step(wait_for=self.cfg.parallel.start_replicas)
        if m.healed and self.env.is_main:
            info(
                f"replica {self.group.replica_id}: healed from a live peer at step {m.step} "
                f"({time.perf_counter() - began:.1f} s, no checkpoint read)"
            )
        if m.replicas != self.groups and self.env.is_main:
            info(f"replica {self.group.replica_id}: {m.replicas} group(s) step together from step {m.step + 1}")
        self.groups = m.replicas
        self.first, self.shares, self.left_out = self.ledger.frontier, self.ledger.assign(m.replicas), set()
        self.place()

    def place(self) -> None:
        """The loader at the start of this group's share of the step (or round)."""
        mine, dp = self.shares[self.membership.slot], self.meshes.dims.dp
        self.loader.place(
            mine.cursor, dp_rank=mine.index * dp + self.meshes.dp_rank, dp_degree=mine.count * dp,
            global_batch_size=mine.count * self.batch,
        )  # fmt: skip

    def mean_loss(self, loss: torch.Tensor) -> torch.Tensor:
        total = loss.detach().reshape(1).float().clone()
        self._sum(total)
        return (total / max(self.membership.replicas, 1)).reshape(())

    def average_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """One flat buffer of this rank's gradient shards crosses the groups (one allreduce); the check, where
        on, adds a few floats per group before it and, on a step with an offender, one more allreduce."""
        grads = [local_tensor(p.grad) for p in params if p.grad is not None]
        if grads:
            unflatten_into(self.average(flatten(grads)), grads)

    def average(self, flat: torch.Tensor) -> torch.Tensor:
        """This group's contribution (flat, fp32) replaced by the groups' average, after the check where on."""
        for hook in self.contribution_hooks:
            hook(flat)
        m = self.membership
        if self.check is None:
            self._sum(flat)
            flat /= m.replicas
            return flat
        said = self.verdict.summary() if self.verdict is not None else ""
        self.verdict = self.check.average(
            flat, slot=m.slot, slots=m.replicas, replica_id=self.group.replica_id,
            group_sum=self._group_sum, replica_sum=self._sum,
        )  # fmt: skip
        shown = self.verdict.excluded or self.verdict.clipped
        if shown and self.verdict.summary() != said and self.env.is_main:
            info(f"replica {self.group.replica_id}, step {self.state.step + 1}: {self.verdict.summary()}")
        return flat

    def _sum(self, t: torch.Tensor) -> None:
        n = max(self.membership.replicas, 1)
        self.sent += t.numel() * t.element_size() * 2 * (n - 1) / n
        self.group.sum(t)

    def _group_sum(self, t: torch.Tensor) -> None:
        if self.env.world_size > 1:
            dist.all_reduce(t)

    def commit(self) -> bool:
        committed = self.group.commit()
        if committed:
            self.settle()
        else:
            self.failed += 1
            if self.env.is_main:
                why = self.group.error.splitlines()[0][:200] if self.group.error else "a group could not finish it"
                info(f"replica {self.group.replica_id}: step {self.membership.step + 1} not committed ({why}); retried")
        return committed

    def settle(self) -> None:
        """A committed step (round) in the ledger: the left-out groups' shares back in the queue."""
        self.left_out = self.verdict.excluded_slots if self.verdict is not None else set()
        self.ledger.settle(self.shares, self.left_out)

    def record(self) -> dict[str, Any]:
        """The committed step's groups and samples: enough to replay it (tests/parallel/test_replicas.py). Its
        fresh block: `samples` from `first_sample`; `retrained`: samples of queued shares it took; `requeued`:
        its samples the check left out (back in the queue); `pending`: samples in the queue after it."""
        m, v, share = self.membership, self.verdict, self.ledger.share_samples
        retrained = sum(1 for s in self.shares if s.cursor < self.first)
        left_out = len(self.left_out)  # (DiLoCo: 0 until the round's end settles it)
        out = {
            "groups": m.replicas, "slot": m.slot, "first_sample": self.first,
            "samples": (m.replicas - retrained) * share, "retrained": retrained * share, "requeued": left_out * share,
            "trained": (m.replicas - left_out) * share, "pending": self.ledger.pending(),
            "failed_attempts": self.failed, "healed": int(m.healed), "sent_mb": self.sent / 2**20,
        }  # fmt: skip
        if v is not None:
            out.update(
                admitted=v.admitted, excluded=",".join(map(str, sorted(v.excluded))),
                clipped=",".join(map(str, sorted(v.clipped))),
            )  # fmt: skip
        return out

    def close(self) -> None:
        self.group.close()

    def _save(self) -> dict[str, Any]:
        """The state a peer heals from: each part's entries, tensors as this rank's local shards."""
        out: dict[str, Any] = {}
        for part in self.parts:
            out.update(_tree(part.state_dict(), local_tensor))
        if self.check is not None:
            out["contributions"] = json.dumps(self.check.state_dict())  # a string: its keys vary with offenders
        out["samples"] = self.ledger.dumps()  # a string too: the queue's length varies
        return out

    def _load(self, received: dict[str, Any]) -> None:
        """A peer's state (already checked against this group's own by the transport) into the run. Its two JSON
        strings (the check's history and the ledger) are parsed and checked first: a malformed one is refused
        (HealRefused, naming the field) before anything changes."""
        from plait.parallel.replicas import HealRefused

        ledger, check = SampleLedger(self.ledger.share_samples), None
        try:
            ledger.loads(received["samples"])
            if self.check is not None:
                check = ContributionCheck()
                check.load_state_dict(json.loads(received["contributions"]))
        except ValueError as e:  # (a JSON syntax error is one too)
            raise HealRefused("", "user/default/" + ("contributions" if ledger.loaded else "samples"), str(e)) from None
        live: dict[str, Any] = {}
        for part in self.parts:
            live.update(part.state_dict())
        placed = _placed(received, live)
        for part in self.parts:
            part.load_state_dict(placed)
        if check is not None:
            self.check = check
        self.ledger.load_state_dict(ledger.state_dict())


class RunFinishedElsewhere(PlaitError):
    """A group restarted after its peers finished the run: it ends at once, successfully (exit 0), naming
    the group that holds the result, instead of training the whole run again alone."""

    exit_code = 0


def finished_elsewhere(cfg: Config) -> str:
    """Where a sibling group (<run>/replica_<j>, as `plait train --replicas` and `plait launch slurm --replicas`
    lay them out) has a checkpoint at train.steps: the run is over ("" if none has)."""
    here = cfg.run_dir
    for sibling in sorted(here.parent.glob("replica_*")):
        if sibling == here or not (sibling / "checkpoints").is_dir():
            continue
        found = list_checkpoints(sibling / "checkpoints")
        if found and step_of(found[-1]) >= cfg.train.steps:
            return (
                f"replica {cfg.parallel.replica_id}: the run finished while this group was restarting "
                f"({found[-1]} is step {step_of(found[-1])} of {cfg.train.steps}); nothing left to train"
            )
    return ""


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1).float() for t in tensors])


def unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """flat's values back into the tensors it was made of (flatten), in place."""
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def local_tensor(x: Any) -> Any:
    if isinstance(x, DTensor):
        return x.to_local().detach()
    return x.detach() if isinstance(x, torch.Tensor) else x


def _tree(x: Any, leaf: Callable[[Any], Any]) -> Any:
    if isinstance(x, dict):
        return {k: _tree(v, leaf) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_tree(v, leaf) for v in x]
    return leaf(x)


def _placed(received: Any, live: Any) -> Any:
    """The received tree with each tensor placed as this rank's live one is (a DTensor's local shard wrapped in
    its mesh and placements again, on its device)."""
    if isinstance(live, dict):
        return {k: _placed(received[k], v) for k, v in live.items()}
    if isinstance(live, list | tuple):
        return type(live)(_placed(r, v) for r, v in zip(received, live, strict=True))
    if isinstance(live, DTensor):
        local = received.to(live.device)
        return DTensor.from_local(
            local, live.device_mesh, live.placements, run_check=False, shape=live.shape, stride=live.stride()
        )
    if isinstance(live, torch.Tensor):
        return received.to(live.device)
    return received
