"""Which replica groups a run has (plait.engine.replicas): one alone, synchronous fault-tolerant groups, or
DiLoCo's (plait.engine.diloco), after the rules of plait.parallel.rules say the settings can run."""

from __future__ import annotations

from plait.config import Config
from plait.core.errors import ConfigError
from plait.engine.checkpoint.state import TrainState
from plait.engine.diloco import LowCommunication
from plait.engine.replicas import FaultTolerant, Replicas
from plait.parallel import DistEnv, Meshes
from plait.parallel.rules import diloco_problem, replicas_problem


def build_replicas(cfg: Config, env: DistEnv, meshes: Meshes, t, loader, state: TrainState, own_data: bool) -> Replicas:
    """This run's replica groups: fault-tolerant where parallel.fault_tolerant says so, else one alone."""
    p = cfg.parallel
    problem = replicas_problem(
        p.fault_tolerant, meshes.dims.dp_replicate, own_data, bool(cfg.data.sources),
        cfg.guard.nonfinite_policy == "rollback", p.min_replicas,
        p.lighthouse,
    ) or diloco_problem(
        p.fault_tolerant, p.diloco_sync_every, cfg.checkpoint.every_steps, cfg.train.steps, p.diloco_outer_lr,
        p.diloco_outer_momentum,
    )  # fmt: skip
    if problem:
        raise ConfigError(problem)
    if not p.fault_tolerant:
        return Replicas()
    if p.diloco_sync_every > 1:
        return LowCommunication(cfg, env, meshes, t, loader, state)
    return FaultTolerant(cfg, env, meshes, t, loader, state)
