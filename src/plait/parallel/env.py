"""Process-group set-up from the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR...)."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from plait.core.hardware import resolve_device

_GROUPS: dict[str, dist.ProcessGroup] = {}


def register_group(group: dist.ProcessGroup) -> str:
    """The group's name, under which `registered_group` finds it again: plait's torch ops (the ring attention,
    the experts' all-to-all) take a group by name, as a custom op's arguments must be plain values."""
    _GROUPS[group.group_name] = group
    return group.group_name


def registered_group(name: str) -> dist.ProcessGroup:
    return _GROUPS[name]


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device_spec: str, timeout_s: int) -> DistEnv:
    """Join the process group torchrun (or `plait train --nproc`) set up; a lone process joins none.

    NCCL on CUDA, gloo on the CPU. After an elastic restart torchrun hands the new workers the same
    TCPStore, whose keys from the failed attempt make gloo connect to dead peers (upstream issue 135712):
    each attempt therefore works under its own key prefix.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(device_spec, local_rank)
    if world == 1:
        init_single_process(device, timeout_s)
        return DistEnv(0, 1, 0, device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        store, rank, world = next(dist.rendezvous("env://"))
        attempt = restart_count()
        _keep_excepthook()
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            store=dist.PrefixStore(f"plait_attempt_{attempt}", store),
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout_s),
        )
    return DistEnv(dist.get_rank(), dist.get_world_size(), local_rank, device)


RESTART_COUNT_ENV = "PLAIT_RESTART_COUNT"
"""Set by `plait train --nproc` for its workers: how often it restarted the group (also: a launcher runs them)."""


def restart_count() -> int:
    """How often this worker group was restarted: by `plait train --nproc` (PLAIT_RESTART_COUNT, set by its
    launcher, which restarts the group itself) or by torchrun's elastic agent (TORCHELASTIC_RESTART_COUNT)."""
    return int(os.environ.get(RESTART_COUNT_ENV) or os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)


def init_single_process(device: torch.device, timeout_s: int = 300) -> None:
    """A lone process is a group of one: the same mesh, FSDP2 (CPU offload at dp = 1) and DTensor code run
    on it as on many ranks. An in-memory store: nothing listens on the network."""
    if dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    _keep_excepthook()
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=timeout_s),
    )


@contextlib.contextmanager
def one_rank_of(dims, rank: int, device: torch.device) -> Iterator:
    """While active, this process stands in for rank `rank` of a job of `dims` (a ParallelDims): a fake process
    group of its world size (torch_private.init_fake_process_group: real shapes and shards, no values moved)
    and that rank's Meshes. `plait fit` measures a rank this way, `plait compile` compiles one. The process
    must have no process group yet; the fake one is destroyed on leaving."""
    from plait.core.torch_private import init_fake_process_group
    from plait.parallel.dims import Meshes

    if device.type == "cuda":
        torch.cuda.set_device(device)
    _keep_excepthook()
    init_fake_process_group(dims.world_size, rank)
    try:
        yield Meshes.build(dims, device.type)
    finally:
        shutdown()


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    if _EXCEPTHOOK:
        sys.excepthook = _EXCEPTHOOK.pop()


# torch's init_process_group wraps sys.excepthook to prefix every line of a traceback with "[rankN]: ", and
# destroy_process_group never unwraps it: a process that trains many times (a notebook, a test suite, the
# Python API) would print "[rank0]: " once more per run. plait puts the hook it found back when it leaves.
_EXCEPTHOOK: list = []


def _keep_excepthook() -> None:
    """Called just before plait creates a process group: the hook now is the one to put back (an entry left by
    a group someone else destroyed is stale, and replaced)."""
    _EXCEPTHOOK[:] = [sys.excepthook]


def heartbeat_store(timeout_s: float = 30.0):
    """A store client of its own for the hang watchdog's heartbeats (a second client of the job's TCPStore,
    so the watchdog thread never shares a socket with the training thread), or None where the job has no
    such store (one process, a fake group). Raises if the store cannot be reached."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not (addr and port and dist.is_initialized() and dist.get_world_size() > 1):
        return None
    store = dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))
    return dist.PrefixStore(f"plait_attempt_{restart_count()}/heartbeat", store)
