"""Fault injection for resilience tests, as one callback, attached only where the environment names it:
PLAIT_CALLBACKS=plait.features.faults:from_environment (the test suite sets it; plait.api reads no fault
variable) and a PLAIT_FAULT_* variable is set. Production runs carry none of it.

- PLAIT_FAULT_KILL=RANK:STEP[,RANK:STEP...] kills a rank (hard exit, as a lost machine would) when it is
  about to run STEP; the i-th entry fires in elastic attempt i (the first run is attempt 0), so one run can
  lose several ranks in turn and still finish.
- PLAIT_FAULT_NAN=STEP[:COUNT] makes the loss NaN (on all ranks) in COUNT step executions from STEP on,
  default 1; PLAIT_FAULT_HANG=RANK:STEP hangs that rank in forward at STEP; PLAIT_FAULT_SLOW_RANK=RANK:SECONDS
  delays that rank by SECONDS every step (and in the health check's arithmetic). NAN and HANG act in an
  elastic group's first attempt only, as KILL does.
- PLAIT_FAULT_BAD_RANK=R makes rank R's arithmetic wrong in the health check (plait.features.health).
- PLAIT_FAULT_SAVE_CRASH=STEP ends the main rank (as a lost machine would) after STEP's shards and DCP metadata
  are written and before the checkpoint is published.
- Fault-tolerant runs (parallel.fault_tolerant): PLAIT_FAULT_REPLICA=ID confines the faults above to replica group
  ID. PLAIT_FAULT_REPLICA_KILLS=ID:STEP[,ID:STEP...] kills (SIGKILL) group ID's rank 0 at its first step from STEP on; a
  group's entries fire in its elastic attempts in turn. PLAIT_FAULT_BAD_REPLICA=ID:MODE[:SIZE][@STEP] makes group
  ID's gradient contribution bad from STEP on (default 1): MODE 'scale' (times SIZE, default 100), 'noise' (plus
  Gaussian noise of SIZE times its norm, default 10), 'flip' (sign-flipped, times SIZE, default 1) or 'nan'.

Production code knows none of this: the faults go in through the hooks the components offer
(plait.features.health.COMPUTE_FAULTS, the model's forward hooks), or by wrapping a method of the one object a
run hands over (the checkpointer's publisher: its `publish`, on that instance only).
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch

from plait.core.errors import ConfigError
from plait.engine.callbacks import Callback, RunState
from plait.parallel.env import restart_count


def injected(name: str) -> tuple[int, float | None] | None:
    """A fault-injection variable, 'A' or 'A:B', as (int(A), float(B) or None); None when unset."""
    spec = os.environ.get(name, "").strip()
    if not spec:
        return None
    head, _, tail = spec.partition(":")
    try:
        return int(head), (float(tail) if tail else None)
    except ValueError:
        raise ConfigError(f"{name}={spec!r} must look like RANK or RANK:VALUE (e.g. 1:0.5)") from None


def parse_fault_kills(spec: str) -> list[tuple[int, int]]:
    try:
        kills = [tuple(int(x) for x in item.split(":")) for item in spec.split(",")]
    except ValueError:
        kills = []
    if not kills or any(len(k) != 2 or min(k) < 0 for k in kills):
        raise ConfigError(f"PLAIT_FAULT_KILL={spec!r}: expected RANK:STEP[,RANK:STEP...], e.g. '1:5,0:9'")
    return kills  # type: ignore[return-value]


def from_environment() -> list[Callback]:
    """The Faults callback where a PLAIT_FAULT_* variable asks for one, else none: the factory the test suite
    names in PLAIT_CALLBACKS (plait.api.callbacks_from_environment), so plait itself never reads them."""
    if not any(k.startswith("PLAIT_FAULT_") and v.strip() for k, v in os.environ.items()):
        return []
    return [Faults()]


class Faults(Callback):
    """The injected faults of this rank; inert when no variable is set. Give it before plait.features.guards' callback,
    so an injected delay counts as this rank's own time between steps, as a slow machine's would."""

    def __init__(self, rank: int | None = None):
        """rank: this process's (None: the trainer's, at on_setup)."""
        self.nan_armed = self.hang_armed = False
        self._hooks: list = []
        if rank is not None:
            self._configure(rank)

    def on_setup(self, run: RunState) -> None:
        if not hasattr(self, "rank"):
            p = run.cfg.parallel
            self._configure(run.env.rank, run.env.world_size, p.replica_id if p.fault_tolerant else None)
        install_health_faults()  # the health check runs next (plait.api.default_callbacks' order)

    def _configure(self, rank: int, world_size: int | None = None, replica: int | None = None) -> None:
        self.rank = rank
        only = os.environ.get("PLAIT_FAULT_REPLICA", "").strip()
        ours = not only or replica is None or only == str(replica)  # else the faults are another group's
        first_attempt = restart_count() == 0
        nan, hang, slow = injected("PLAIT_FAULT_NAN"), injected("PLAIT_FAULT_HANG"), injected("PLAIT_FAULT_SLOW_RANK")
        if not ours:
            nan = hang = slow = None
        self.nan_step, self.nan_left = (nan[0], int(nan[1] or 1)) if nan and first_attempt else (0, 0)
        self.hang_step = int(hang[1] or 0) if hang and first_attempt and hang[0] == rank else 0
        self.slow_s = (slow[1] or 1.0) if slow and slow[0] == rank else 0.0
        spec = os.environ.get("PLAIT_FAULT_KILL")
        kills = parse_fault_kills(spec) if spec and ours else []
        if world_size is not None and (beyond := [r for r, _ in kills if r >= world_size]):
            raise ConfigError(f"PLAIT_FAULT_KILL names rank {beyond[0]}, but the run has {world_size} ranks")
        attempt = restart_count()
        self.kill_step = kills[attempt][1] if attempt < len(kills) and kills[attempt][0] == rank else 0
        self.kill_from = 0  # a replica group's kill: at its first step from here on (healing skips steps)
        if replica is not None and rank == 0 and (spec := os.environ.get("PLAIT_FAULT_REPLICA_KILLS", "").strip()):
            mine = [step for r, step in parse_fault_kills(spec) if r == replica]
            self.kill_from = mine[attempt] if attempt < len(mine) else 0

    def install(self, parts: list[torch.nn.Module]) -> None:
        """Forward hooks on the model parts, only when a NaN or hang is to be injected."""
        if self.nan_left or self.hang_step:
            self._hooks = [part.register_forward_hook(self._hook) for part in parts]

    def on_start(self, run: RunState) -> None:
        self.install(run.t.parts)
        crash = os.environ.get("PLAIT_FAULT_SAVE_CRASH", "").strip()
        if crash:
            crash_before_publish(run.checkpointer.publisher, crash)
        bad = os.environ.get("PLAIT_FAULT_BAD_REPLICA", "").strip()
        if bad and run.cfg.parallel.fault_tolerant:
            replica, corrupt = bad_replica(bad)
            if replica == run.cfg.parallel.replica_id:
                hooks = run.replicas.contribution_hooks  # type: ignore[attr-defined]
                hooks.append(lambda flat: corrupt(flat, run.state.step + 1))

    def before_step(self, run: RunState, step: int) -> None:
        if step == self.kill_step or (self.kill_from and step >= self.kill_from):
            print(f"plait: fault injection: killing rank {self.rank} at step {step}", file=sys.stderr, flush=True)
            if self.kill_from:  # a replica group's worker: SIGKILL, as the OOM killer or a lost node ends it
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(137)
        if self.slow_s:
            time.sleep(self.slow_s)
        self.nan_armed = self.nan_left > 0 and step >= self.nan_step
        self.hang_armed = step == self.hang_step

    def should_step(self, run: RunState, loss, grad_norm) -> None:
        """After forward/backward: evaluation forwards are not touched."""
        if self.nan_armed:
            self.nan_left -= 1
        self.nan_armed = self.hang_armed = False

    def close(self, run: RunState) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _hook(self, module, args, output):
        if self.hang_armed:
            print(f"plait: fault injection: rank {self.rank} hangs in forward", file=sys.stderr, flush=True)
            _injected_hang()
        if self.nan_armed and isinstance(output, torch.Tensor):
            return output * float("nan")
        return output


BAD_MODES = {"scale": 100.0, "noise": 10.0, "flip": 1.0, "nan": 0.0}  # each mode's default SIZE


def bad_replica(spec: str):
    """PLAIT_FAULT_BAD_REPLICA=ID:MODE[:SIZE][@STEP] as (ID, corrupt(flat, step)): the change to the group's
    flattened gradient (this rank's shard of it) from STEP on."""
    head, _, start = spec.partition("@")
    fields = head.split(":")
    try:
        replica, mode = int(fields[0]), fields[1]
        size = float(fields[2]) if len(fields) > 2 else BAD_MODES[mode]
        first = int(start) if start else 1
    except (ValueError, IndexError, KeyError):
        raise ConfigError(
            f"PLAIT_FAULT_BAD_REPLICA={spec!r}: expected ID:MODE[:SIZE][@STEP] with MODE one of {', '.join(BAD_MODES)}"
        ) from None
    noise = torch.Generator().manual_seed(1234 + replica)

    def corrupt(flat: torch.Tensor, step: int) -> None:
        if step < first:
            return
        if mode == "scale":
            flat.mul_(size)
        elif mode == "flip":
            flat.mul_(-size)
        elif mode == "nan":
            flat[0] = float("nan")
        else:
            scale = size * float(flat.norm()) / max(flat.numel(), 1) ** 0.5
            flat.add_(torch.randn(flat.shape, generator=noise).to(flat.device) * scale)

    return replica, corrupt


def crash_before_publish(publisher, at: str) -> None:
    """Make this publisher (plait.engine.checkpoint.publisher.Publisher) end the process before it publishes
    step `at`: its `publish` is wrapped on this instance, nothing else is changed."""
    publish = publisher.publish

    def crashing(step: int, meta: dict, target) -> None:
        if str(step) == at:
            print(f"plait: fault injection: crashing before publishing step {step}", file=sys.stderr, flush=True)
            os._exit(137)
        publish(step, meta, target)

    publisher.publish = crashing


def install_health_faults() -> None:
    """PLAIT_FAULT_BAD_RANK and PLAIT_FAULT_SLOW_RANK in the health check's matmul (`plait doctor` and the check
    before a run), once per process."""
    from plait.features import health

    bad, slow = injected("PLAIT_FAULT_BAD_RANK"), injected("PLAIT_FAULT_SLOW_RANK")
    if (bad is None and slow is None) or _health_fault in health.COMPUTE_FAULTS:
        return
    health.COMPUTE_FAULTS.append(_health_fault)


def _health_fault(moment: str, rank: int, c: torch.Tensor) -> None:
    bad, slow = injected("PLAIT_FAULT_BAD_RANK"), injected("PLAIT_FAULT_SLOW_RANK")
    if moment == "timed" and slow is not None and slow[0] == rank:
        time.sleep(slow[1] or 1.0)
    if moment == "result" and bad is not None and bad[0] == rank:
        c[c.shape[0] // 2, c.shape[1] // 3] += c.abs().max()  # one wrong element, as a faulty unit would produce


def _injected_hang() -> None:
    while True:
        time.sleep(0.5)
