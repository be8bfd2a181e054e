"""One replica group of a fault-tolerant run, on torchft: the group's place in each step's quorum, the sums
across the groups alive at that step, and whether the step commits.

torchft's Manager does the membership: before each step every group asks the lighthouse for a quorum (the groups
alive now, and which of them are behind); a group that is behind (restarted, or new) heals from a live peer
before it steps (plait's safe transport, plait.parallel.replicas.transport: no pickle); a collective that fails
because a peer died marks the step as failed on the groups that saw it, and no group commits a step that one of
its own ranks could not finish. Communication plan: rank k of each group forms a reconfigurable gloo group with
rank k of every other group (torchft's ProcessGroupGloo, rebuilt at each new quorum); the gradients cross it once
a step (plait.engine.replicas); the quorum and commit votes are small RPCs to the lighthouse and to group rank
0's manager server.

The quorum is taken synchronously at the start of a step (use_async_quorum=False): the step's data depends on
the number of groups and this group's place among them, which must be known before the batch is read.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from plait.parallel.env import restart_count

QUORUM_TIMEOUT_S = 120  # a group waits this long for the lighthouse's quorum (a restarting peer takes ~10 s)
CONNECT_TIMEOUT_S = 60  # to the lighthouse and the managers: they are started before the groups


@dataclass(frozen=True)
class Membership:
    """This group's view of one step: the groups taking part and its own place among them (slot); which samples
    each takes is the run's ledger's (plait.engine.ledger)."""

    replicas: int
    slot: int
    step: int
    healed: bool  # this group took a peer's state at the start of this step


class ReplicaGroup:
    """torchft's Manager for this group's rank. load_state / save_state: the run's state for healing (the
    receiver's own state is the template the transport checks a peer's against)."""

    def __init__(
        self,
        *,
        replica_id: int,
        lighthouse: str,
        min_replicas: int,
        timeout_s: float,
        save_state: Callable[[], dict[str, Any]],
        load_state: Callable[[dict[str, Any]], None],
    ) -> None:
        from plait.parallel.replicas.lighthouse import require_torchft

        require_torchft()
        from torchft import Manager, ProcessGroupGloo

        if os.environ.get("LOGLEVEL", "").upper() not in ("INFO", "DEBUG"):
            # torchft logs a peer's failure as a traceback per collective; plait says it in one line per step
            logging.getLogger("torchft").setLevel(logging.CRITICAL)

        from plait.parallel.replicas.transport import SafeTransport

        self.replica_id = replica_id
        self._healed = False
        self._joined = False  # whether this process has joined a quorum yet
        self._load = load_state
        timeout = timedelta(seconds=timeout_s)
        rank = dist.get_rank() if dist.is_initialized() else 0
        size = dist.get_world_size() if dist.is_initialized() else 1
        host, port = _group_store()
        # What a peer's payload must look like: this group's own state in the Manager's wrapping (its one
        # state function is registered under "default").
        self.transport = SafeTransport(
            timeout=timeout, template=lambda: {"user": {"default": save_state()}, "torchft": self.manager.state_dict()}
        )
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout),
            load_state_dict=self._heal,
            state_dict=save_state,
            min_replica_size=min_replicas,
            use_async_quorum=False,
            timeout=timeout,
            quorum_timeout=timedelta(seconds=QUORUM_TIMEOUT_S),
            connect_timeout=timedelta(seconds=CONNECT_TIMEOUT_S),
            rank=rank,
            world_size=size,
            store_addr=host,
            store_port=port,
            lighthouse_addr=lighthouse,
            replica_id=f"replica_{replica_id}",
            checkpoint_transport=self.transport,
            init_sync=False,  # every group initialises the same weights from run.seed
        )

    def _heal(self, state: dict[str, Any]) -> None:
        self._load(state)
        self._healed = True

    def restore(self, step: int, batches_committed: int) -> None:
        """The counters of a checkpoint this group resumed from (its peers, if ahead, heal it at the next step;
        torchft compares steps, and counts the group batches committed, which plait's ledger no longer reads)."""
        self.manager.load_state_dict({"step": step, "batches_committed": batches_committed})

    def start_step(self, wait_for: int = 0) -> Membership:
        """Join this step's quorum (healing from a peer where this group is behind). The first quorum of a
        launch (fresh or resumed) waits (up to QUORUM_TIMEOUT_S) until `wait_for` groups are in it: a group that
        started first must not train alone while the others form a quorum of their own (neither would be behind
        the other, so neither would heal: two runs, not one)."""
        self._healed = False
        deadline = time.monotonic() + QUORUM_TIMEOUT_S
        self.manager.start_quorum()
        launched = restart_count() == 0 and not self._joined  # a group restarted alone heals instead
        self._joined = True
        while (
            launched and not self._healed and self.manager.num_participants() < wait_for and time.monotonic() < deadline
        ):  # fmt: skip
            time.sleep(0.2)
            self.manager.start_quorum()
        slot = self.manager.participating_rank()
        return Membership(
            replicas=self.manager.num_participants(),
            slot=0 if slot is None else slot,
            step=self.manager.current_step(),
            healed=self._healed,
        )

    def sum(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` in place over the groups of this step (rank k of each). After a peer's failure the
        values are undefined and the step will not commit (torchft records the error)."""
        from torch.distributed import ReduceOp

        self.manager.allreduce(tensor, reduce_op=ReduceOp.SUM).wait()

    def commit(self) -> bool:
        """Whether this step counts: every rank of this group finished it and enough groups took part."""
        return self.manager.should_commit()

    @property
    def error(self) -> str:
        """Why this step failed on this group ("" if it has not)."""
        e = self.manager.errored()
        return "" if e is None else str(e.original_exception)

    def close(self) -> None:
        self.manager.shutdown(wait=False)


def _group_store() -> tuple[str, int]:
    """A TCP store for torchft's use inside this group: group rank 0 hosts it on a free port, the others learn
    where over the group's own process group (one small broadcast, once)."""
    host = socket.gethostname() if dist.is_initialized() and dist.get_world_size() > 1 else "127.0.0.1"
    if not dist.is_initialized() or dist.get_world_size() == 1:
        store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        _STORES.append(store)  # the store lives as long as the process
        return host, store.port
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        _STORES.append(store)
        box = [(host, store.port)]
    dist.broadcast_object_list(box, src=0)
    return box[0]


_STORES: list[Any] = []
