"""Will rank R of an N-rank job fit? Run it and see, on the one device this machine has (`plait fit`).

One process stands in for rank R: a fake process group of N ranks (every collective is shaped as the real
job's and moves no data), the model at its real shape built by the runtime's own start-up path (each rank
materialises only its shards: `build_trainable`), with the config's optimizer, precision, activation
checkpointing, offload and compile settings, runs a few training steps on synthetic tokens. Measured: the
device's peak memory (the CUDA allocator's peak and reserved bytes; on the CPU, the live tensor bytes op by
op: plait.core.live_bytes), the model states, the activations one micro-batch saves for backward (saved-tensor
hooks), the host's resident memory, and the step time. Beside each, the planner's prediction for that rank
(plait.planner.cost): the analytic check every run gets before it starts, which this one checks exactly.

Values are not meaningful (collectives move nothing: gathered parameters and received activations hold what
the buffers held), and the step time has no communication in it: it is the rank's compute, shown beside the
planner's compute time on this device.
"""

from __future__ import annotations

import dataclasses
import io
import resource
import statistics
import time
from typing import Any

import torch

from plait.config import Config
from plait.core.errors import ConfigError, PlaitError
from plait.core.progress import Progress, phase

GiB = 2**30
SAY_EVERY = 5.0  # seconds between the lines that say a phase is still running (plait.core.progress)
PARTS = ("states", "buffers", "activations", "transient")  # the prediction's parts, shown beside the peak


@dataclasses.dataclass
class RankFit:
    """What `plait fit` found for one rank: bytes measured and predicted by part, seconds, and whether it fits."""

    rank: int
    world_size: int
    coordinates: dict[str, tuple[int, int]]  # mesh axis -> (this rank's index, degree), axes of degree > 1
    device: str
    capacity: int  # bytes: the GPU's memory, or the host memory available (CPU)
    measured: dict[str, float | None]
    predicted: dict[str, float]
    step_s: float | None
    compute_s: float  # the planner's compute + optimizer time for this layout on this device
    fits: bool
    note: str = ""  # why it does not fit (out of memory), or what was not measured

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def extreme_ranks(cfg: Config, world_size: int) -> list[int]:
    """The ranks whose memory differs: rank 0 (the first pipeline stage, the embedding, the first shard of
    every axis) and the last rank (the last stage with the output projection and the loss, the last expert
    group, the last and possibly shorter shard of every axis). Ranks between them hold the same or less."""
    return sorted({0, world_size - 1})


def fit_rank(cfg: Config, world_size: int, rank: int, steps: int = 3, *, quiet: bool = False) -> RankFit:
    """Run rank `rank` of a `world_size`-rank job in this process (it must have no process group yet): the
    runtime's build, `steps` training steps on synthetic tokens, then one micro-batch's forward measured for
    what it saves. Returns the measurement beside the planner's prediction. Its phases (measuring this
    device, building the model, each step with an ETA, the activations) are said on stderr unless `quiet`:
    at the shapes of a large job each can take minutes on a CPU."""
    from plait.core.hardware import device_memory_bytes, host_memory_bytes
    from plait.parallel.env import one_rank_of
    from plait.planner.cost import HOST_MEMORY_FRACTION, host_resident

    if steps < 1:
        raise ConfigError(f"--steps={steps} must be at least 1 (the first step also allocates the optimizer's states)")
    device, dims, bf16 = _layout(cfg, world_size, rank)
    if device.type == "cpu" and cfg.compile.enabled:
        raise ConfigError(
            "compile.enabled=true with plait fit on the CPU: the CPU's peak is counted op by op by a dispatch mode, "
            "which torch.compile does not trace through; set compile.enabled=false here, or run it on a GPU, where "
            "the CUDA allocator sees compiled code too"
        )
    out = io.StringIO() if quiet else None  # None: stderr
    with phase(f"rank {rank}: the planner's prediction (timing this device)", every=SAY_EVERY, stream=out):
        predicted, compute_s = _predict(cfg, world_size, dims, rank, bf16, device)
    capacity = device_memory_bytes(device) or host_memory_bytes("MemAvailable") or 0
    base: dict[str, Any] = dict(rank=rank, world_size=world_size, device=_device_name(device), capacity=capacity)
    if device.type == "cpu" and capacity and predicted["peak"] > capacity:
        # The kernel's OOM killer would end this process without a word; the GPU's allocator raises instead.
        note = f"not run: predicted {predicted['peak'] / GiB:.1f} GiB, {capacity / GiB:.1f} GiB available"
        return RankFit(coordinates={}, measured={}, predicted=predicted, step_s=None, compute_s=compute_s, fits=False,
                       note=note, **base)  # fmt: skip
    host_free = host_memory_bytes("MemAvailable")
    if device.type == "cuda" and host_free and host_resident(predicted["host"]) > HOST_MEMORY_FRACTION * host_free:
        # CPU offload's states live in host memory, where the OOM killer ends a process without a word
        note = (
            f"not run: CPU offload's states are predicted at {predicted['host'] / GiB:.1f} GiB of host memory "
            f"({host_resident(predicted['host']) / GiB:.1f} GiB resident), "
            f"over {HOST_MEMORY_FRACTION:.0%} of the {host_free / GiB:.1f} GiB available on this machine"
            + ("; optim.state_dtype=bf16 keeps 12 bytes a parameter instead of 16" if cfg.optim.state_dtype == "fp32"
               else "")
        )  # fmt: skip
        return RankFit(coordinates={}, measured={}, predicted=predicted, step_s=None, compute_s=compute_s, fits=False,
                       note=note, **base)  # fmt: skip
    with one_rank_of(dims, rank, device) as meshes:
        coordinates = _coordinates(meshes)
        try:
            measured, step_s = _run(cfg, meshes, device, dims, steps, Said(f"rank {rank}", out))
        except torch.OutOfMemoryError as e:
            first = str(e).splitlines()[0]
            return RankFit(coordinates=coordinates, measured={}, predicted=predicted, step_s=None,
                           compute_s=compute_s, fits=False, note=f"out of memory: {first}", **base)  # fmt: skip
    highest = max(measured["peak"] or 0, measured["build_peak"] or 0)
    fits = highest <= capacity if capacity else True
    note = "" if fits else f"peak {highest / GiB:.1f} GiB over the {capacity / GiB:.1f} GiB available"
    return RankFit(coordinates=coordinates, measured=measured, predicted=predicted, step_s=step_s,
                   compute_s=compute_s, fits=fits, note=note, **base)  # fmt: skip


def predict_rank(cfg: Config, world_size: int, rank: int, device: torch.device | None = None) -> dict[str, float]:
    """The planner's bytes for rank `rank` (the layout checked as the runtime checks it), without running it;
    on `device` (default: the config's, which must exist here): a GPU's figures are computed on any machine."""
    device, dims, bf16 = _layout(cfg, world_size, rank, device)
    return _predict(cfg, world_size, dims, rank, bf16, device, timed=False)[0]


def _layout(cfg: Config, world_size: int, rank: int, device: torch.device | None = None):
    """(device, ParallelDims, bf16) of rank `rank` of a `world_size`-rank job, its layout checked as the runtime
    checks it (ConfigError naming the setting)."""
    from plait.core.hardware import bf16_for, resolve_device, uses_bf16
    from plait.parallel import ParallelDims
    from plait.parallel.dims import validate_layout

    if not 0 <= rank < world_size:
        raise ConfigError(f"--rank={rank} is not a rank of a {world_size}-rank job; give 0 to {world_size - 1}")
    described = device is not None and device.type == "cuda" and not torch.cuda.is_available()  # not present
    device = device or resolve_device(cfg.run.device)
    dims = ParallelDims.from_config(cfg.parallel, world_size, cfg.model)
    validate_layout(cfg, dims)
    # a GPU described, not present: of the kinds plait plans for, all with native bf16
    bf16 = bf16_for(cfg.train.mixed_precision, True) if described else uses_bf16(cfg.train.mixed_precision, device)
    return device, dims, bf16


def _device_name(device: torch.device) -> str:
    from plait.core.hardware import device_info

    return device_info(device).name if device.type == "cuda" else "CPU"


def _coordinates(meshes) -> dict[str, tuple[int, int]]:
    mesh = meshes.world
    coordinate = mesh.get_coordinate() or []
    names = mesh.mesh_dim_names or ()
    return {n: (int(i), int(s)) for n, i, s in zip(names, coordinate, mesh.shape, strict=True) if s > 1}


def _predict(cfg: Config, world_size: int, dims, rank: int, bf16: bool, device: torch.device, timed: bool = True):
    """The planner's bytes for this rank by part ('peak': what the allocator hands out at once, 'total': with
    its slack and the device's reserve), and its compute + optimizer seconds on this machine's device."""
    from plait.planner.cluster import get_cluster, measure_local
    from plait.planner.cost import evaluate
    from plait.planner.preflight import layout_of, workload_of

    lay = layout_of(cfg, world_size)
    work = workload_of(cfg, bf16, device.type)
    here = dataclasses.replace(measure_local() if timed else get_cluster("h100"), devices_per_node=world_size)
    out = evaluate(work, here, lay)
    stage = (rank // (world_size // dims.pp)) if dims.pp > 1 else 0  # pp is the outermost mesh axis
    which = "last" if dims.pp > 1 and stage == dims.pp - 1 else "first"
    got = {k: float(out[f"mem_{k}_{which}"][0]) for k in (*PARTS, "peak", "total", "host")}
    if device.type == "cpu":  # one memory: what offload moves to the host is on this device too
        got["peak"] += float(out[f"mem_host_at_peak_{which}"][0])
    return got, float(out["t_compute"][0] + out["t_optimizer"][0])


def _synthetic(cfg: Config, dims, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch of random tokens (inputs, targets): global batch / data-parallel ranks sequences."""
    from plait.engine.precompile import synthetic_batch

    return synthetic_batch(cfg, cfg.train.global_batch_size // dims.dp, device)


@dataclasses.dataclass
class Said:
    """Where a rank's phases are said: `who` starts each line; `stream` None is stderr."""

    who: str
    stream: io.StringIO | None = None

    def phase(self, what: str):
        return phase(f"{self.who}: {what}", every=SAY_EVERY, stream=self.stream)

    def progress(self, what: str, total: int, unit: str) -> Progress:
        return Progress(f"{self.who}: {what}", total, unit=unit, every=SAY_EVERY, stream=self.stream)


def _run(
    cfg: Config, meshes, device: torch.device, dims, steps: int, said: Said
) -> tuple[dict[str, float | None], float]:
    from plait.core.live_bytes import LiveBytes
    from plait.engine.trainable import build_trainable

    live = LiveBytes(device) if device.type == "cpu" else None
    if live is not None:
        live.__enter__()
    else:
        torch.cuda.reset_peak_memory_stats(device)
    try:
        with said.phase("building the model (this rank's shards)"):
            t = build_trainable(cfg, device, meshes)
        # the build's own peak (initialisation draws blocks of rows: a fixed few MiB of temporaries) apart
        build_peak = live.peak if live is not None else torch.cuda.max_memory_allocated(device)
        if live is not None:
            live.reset_peak()
        else:
            torch.cuda.reset_peak_memory_stats(device)
        inputs, targets = _synthetic(cfg, dims, device)
        times = _steps(t, inputs, targets, device, steps, said)
        peak = live.peak if live is not None else torch.cuda.max_memory_allocated(device)
    finally:
        if live is not None:
            live.__exit__(None, None, None)
    measured: dict[str, float | None] = {
        "peak": float(peak),
        "build_peak": float(build_peak),
        "reserved": float(torch.cuda.max_memory_reserved(device)) if device.type == "cuda" else None,
        "host_rss": float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024),
        "states": float(_state_bytes(t, on=torch.device("cpu") if cfg.parallel.cpu_offload else device)),
        "activations": None if t.pipeline is not None else float(_activations(t, inputs, targets, cfg, device, said)),
    }
    step_s = statistics.median(times[1:]) if len(times) > 1 else times[0]
    return measured, step_s


def _steps(t, inputs, targets, device: torch.device, steps: int, said: Said) -> list[float]:
    """Each training step's seconds; a heartbeat during each, and the count with an ETA between them."""
    from plait.engine.trainer import train_step

    times = []
    with said.progress("training steps", steps, "steps") as bar:
        for i in range(steps):
            with said.phase(f"step {i + 1} of {steps}"):
                _sync(device)
                start = time.perf_counter()
                train_step(t, inputs, targets)
                _sync(device)
                times.append(time.perf_counter() - start)
            bar.advance()
    return times


def _activations(t, inputs, targets, cfg: Config, device: torch.device, said: Said) -> int:
    with said.phase("measuring one micro-batch's activations"):
        return _saved_bytes(t, inputs, targets, cfg, device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _state_bytes(t, on: torch.device) -> int:
    """Bytes of this rank's parameters, gradients (allocated like the parameters: they were freed by the step's
    zero_grad) and optimizer moments, on their device."""
    from plait.core.torch_private import local_tensor

    def nbytes(x: torch.Tensor) -> int:
        x = local_tensor(x)
        return x.numel() * x.element_size()

    params = sum(nbytes(p) for p in t.parameters())
    moments = sum(nbytes(v) for opt in t.optimizers for s in opt.state.values() for k, v in s.items() if k != "step")
    return 2 * params + moments


def _saved_bytes(t, inputs, targets, cfg: Config, device: torch.device) -> int:
    """What one micro-batch's forward saves for backward (the planner's activations), on the compute device."""
    from plait.core.hardware import uses_bf16
    from plait.parallel.activations import SavedBytes
    from plait.parallel.context import context_shard
    from plait.parallel.rules import num_micro_batches

    x, y = context_shard(t.meshes, inputs, targets)
    micro = num_micro_batches(cfg.train.micro_batch_size, x.shape[0])
    x, y = x.chunk(micro)[0], y.chunk(micro)[0]
    with t.loss_context(), t.autocast():
        with SavedBytes(t.model) as saved:
            loss = t.loss_fn(t.forward(x, y), y)
        loss.backward()
    for opt in t.optimizers:
        opt.zero_grad(set_to_none=True)
    elsewhere = sorted(str(d) for d in saved.devices if d.type != device.type)
    if elsewhere:
        named = "; ".join(f"{d}: e.g. a tensor of shape {saved.placed[torch.device(d)]}" for d in elsewhere)
        raise PlaitError(
            f"activations saved for backward on {', '.join(elsewhere)}, not on {device} ({named}): a tensor the "
            "forward reads is not on the compute device"
        )
    # The fused head computes the output weight's gradient in forward and keeps it for backward: the planner
    # counts it with the gradients (model states), not as an activation.
    if cfg.train.fused_head:  # in the gathered weight's dtype under FSDP (bf16: 2 bytes), else the fp32 parameter's
        size = 2 if t.fsdp and uses_bf16(cfg.train.mixed_precision, device) else 4
        return saved.total - cfg.model.vocab_size // t.meshes.dims.tp * cfg.model.dim * size
    return saved.total


def in_subprocess(request: dict, rank: int) -> RankFit:
    """One rank in a process of its own (a fake group and a peak are per process): plait.planner.fit_rank,
    with `request` its config ("config", "settings"), "world_size" and "steps"."""
    from plait.core.subcommand import rank_in_subprocess

    return RankFit(**rank_in_subprocess("plait.planner.fit_rank", request, rank))
