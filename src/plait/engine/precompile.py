"""Compiling a job ahead of time (`plait compile`): fill its compile cache before the job starts, so that its
ranks load every graph instead of compiling it.

One process stands in for rank R of the N-rank job, as `plait fit` does (plait.planner.fit): a fake process
group of N ranks, the model at its real shape with this rank's shards (`build_trainable`), the config's
precision, activation checkpointing and compile settings. It runs what compiles in the job: one training step
on synthetic tokens (forward and backward of every compiled block) and, where the job evaluates
(eval.every_steps > 0), one validation forward (no_grad and eval mode: graphs of their own). The compile
monitor the trainer uses (plait.engine.compile_cache.CompileMonitor) then signs and publishes them into
compile.cache_dir, a directory or an s3:// prefix shared by the job's nodes; the job's ranks check each file
against that signature before torch reads it (plait.core.trusted_dir).

Ranks with the same shapes compile the same graphs (data-parallel ranks; tensor-parallel ranks' graphs name
the same groups): rank 0 covers them. Pipeline stages differ: `--ranks stages` runs the first rank of each.
"""

from __future__ import annotations

import dataclasses
import os
import time

import torch

from plait.config import Config
from plait.core.errors import ConfigError


@dataclasses.dataclass
class Precompiled:
    rank: int
    world_size: int
    graphs: int  # compilations (Dynamo frames) the step and the evaluation made
    misses: int  # of their Inductor graphs, those not found in the cache: compiled here
    artifacts: int  # distinct cache artifacts the published mega-cache holds
    loaded: int  # artifacts found in the cache before (a second run compiles nothing new)
    seconds: float
    store: str


def synthetic_batch(cfg: Config, local: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """`local` sequences of random tokens (inputs, targets) shaped as the loader gives them: a retrieval model's
    inputs carry each chunk's k neighbours of 2c tokens after the tokens (plait.model.retrieval)."""
    tokens = torch.randint(0, cfg.model.vocab_size, (local, cfg.data.seq_len + 1), generator=torch.Generator())
    tokens = tokens.to(device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    m = cfg.model
    if m.retrieval_ids:
        width = cfg.data.seq_len // m.retrieval_chunk * m.retrieval_k * 2 * m.retrieval_chunk
        neighbours = torch.randint(0, m.vocab_size, (local, width), generator=torch.Generator().manual_seed(1))
        inputs = torch.cat([inputs, neighbours.to(device)], dim=1)
    # contiguous, as the loader gives them: torch 2.11's pipeline stage checks its input's strides
    return inputs.contiguous(), targets.contiguous()


def stage_ranks(cfg: Config, world_size: int) -> list[int]:
    """The first rank of each pipeline stage (pp is the outermost mesh axis): the ranks whose graphs differ."""
    pp = max(cfg.parallel.pp_degree, 1)
    return [stage * (world_size // pp) for stage in range(pp)]


def precompile(cfg: Config, world_size: int, rank: int = 0) -> Precompiled:
    """Compile rank `rank` of a `world_size`-rank job here (this process must have no process group yet) and
    publish its graphs into compile.cache_dir."""
    from plait.core.hardware import resolve_device, threads_per_rank
    from plait.engine.compile_cache import CompileMonitor, cache_location
    from plait.engine.trainable import build_trainable
    from plait.engine.trainer import train_step
    from plait.engine.validation import evaluate
    from plait.parallel import ParallelDims
    from plait.parallel.dims import validate_layout
    from plait.parallel.env import one_rank_of

    if not cfg.compile.enabled:
        raise ConfigError("plait compile compiles a job that compiles: set compile.enabled=true")
    if not 0 <= rank < world_size:
        raise ConfigError(f"--rank={rank} is not a rank of a {world_size}-rank job; give 0 to {world_size - 1}")
    device = resolve_device(cfg.run.device)
    dims = ParallelDims.from_config(cfg.parallel, world_size, cfg.model)
    validate_layout(cfg, dims)
    if not os.environ.get("OMP_NUM_THREADS"):  # a rank's threads, as the launcher gives them (part of the key)
        local = min(world_size, torch.cuda.device_count()) if device.type == "cuda" else world_size
        torch.set_num_threads(threads_per_rank(local))
    started = time.perf_counter()
    with one_rank_of(dims, rank, device) as meshes:
        monitor = CompileMonitor.start(cfg, device, is_main=True)  # publishes what it compiled, signed
        t = build_trainable(cfg, device, meshes)
        inputs, targets = synthetic_batch(cfg, cfg.train.global_batch_size // dims.dp, device)
        train_step(t, inputs, targets)
        monitor.check(1)
        if cfg.eval.every_steps > 0:  # the validation loader's batches: the same local batch, whole
            evaluate(t, [(inputs, targets)], 1)
            monitor.phase_done("evaluation")
    misses = monitor.cache_hits()["fxgraph_cache_miss"]
    return Precompiled(rank, world_size, monitor.compiles, misses, monitor.saved_artifacts, monitor.loaded_artifacts,
                       time.perf_counter() - started, str(cache_location(cfg)))  # fmt: skip
