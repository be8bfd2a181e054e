"""Will this run fit? Asked before any worker starts, of the planner's memory model.

The model is the one `plait plan` ranks layouts with, checked against the runtime's measured memory
(tests/parallel/test_plan_vs_runtime.py): parameters, gradients and AdamW states as sharded by this layout, gathered
parameters and communication buffers, activations as the schedule keeps them, the head's transients, the
allocator's slack and the device's reserve. A run predicted over its devices' memory (on the CPU: over what
the machine has available for its processes) would end in an out-of-memory error or the kernel's OOM killer,
minutes in on a large model and with no message; it is refused now (exit 2), with the settings that would
bring it under, each with its own prediction. Within 10% of the limit, a warning.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

from plait.config import Config
from plait.core.errors import ConfigError
from plait.planner.cost.memory import MEMORY_FRACTION

GiB = 2**30
CPU_PROCESS_GIB = 0.5
"""A CPU worker's own memory before its model: the interpreter, torch, plait, the tokenizer, the data loader
and collective buffers. Measured (2-core x86-64, torch 2.13): the memory available fell 0.92 GiB for 4
processes that had imported plait's training modules (0.23 GiB each; the shared libraries count once), and
`plait train --model.preset=debug` peaks at 0.62 GiB resident (those libraries included). Stands in for the
planner's GPU reserve (CUDA context, NCCL, cuBLAS workspaces), which a CPU process does not have."""


def workload_of(cfg: Config, bf16: bool, device: str = "cuda"):
    """This config's workload for the planner's cost model (shapes, batch, precision, head, optimizer states)."""
    from plait.planner.cost import Workload

    p = cfg.parallel
    return Workload(cfg.model, cfg.data.seq_len, cfg.train.global_batch_size, "bf16" if bf16 else "fp32",
                    cfg.train.fused_head, device, 2 if cfg.optim.state_dtype == "bf16" else 4,
                    cfg.compile.enabled, cfg.finetune.lora_rank, cfg.optim.name == "muon",
                    max(p.start_replicas, 2) if p.fault_tolerant else 1, max(p.diloco_sync_every, 1))  # fmt: skip


def layout_of(cfg: Config, world_size: int):
    """This config's parallel layout as the planner's one-row Layouts (degrees resolved, and the layout checked,
    as the runtime does)."""
    from plait.parallel.dims import ParallelDims, validate_layout
    from plait.parallel.rules import num_micro_batches
    from plait.planner.cost import Layouts

    p = cfg.parallel
    dims = ParallelDims.from_config(p, world_size, cfg.model)
    validate_layout(cfg, dims)
    local_batch = cfg.train.global_batch_size // (dims.dp_replicate * dims.dp_shard)
    virtual = p.pp_virtual_stages if dims.pp > 1 else 1
    micro = num_micro_batches(cfg.train.micro_batch_size, local_batch, dims.pp * virtual)
    return Layouts.single(
        dp_replicate=dims.dp_replicate,
        dp_shard=dims.dp_shard,
        tp=dims.tp,
        pp=dims.pp,
        virtual=virtual,
        schedule=p.pp_schedule if dims.pp > 1 else "none",
        micro_batch=max(1, local_batch // micro),
        ac=p.activation_checkpoint,
        offload=p.cpu_offload,
        reshard=p.fsdp_reshard_after_forward,
        sync_each=p.fsdp_reduce_every_micro_batch,
        cp=dims.cp,
        ep=dims.ep,
    )


def predict(cfg: Config, world_size: int, local_size: int, bf16: bool, layout=None, device: str = "cuda") -> dict:
    """Predicted bytes per device (worst rank) with its parts, and host bytes per process (CPU offload), for
    this config's layout (or `layout`, its Layouts already made), computing on `device` (a device type)."""
    from plait.planner.cluster import get_cluster
    from plait.planner.cost import evaluate

    lay = layout if layout is not None else layout_of(cfg, world_size)
    work = workload_of(cfg, bf16, device)
    nodes = max(1, world_size // local_size)
    out = evaluate(work, get_cluster("h100", nodes=nodes, devices_per_node=world_size // nodes), lay)
    return {k.removeprefix("mem_"): float(v[0]) for k, v in out.items() if k.startswith("mem_")}


def planned_gib(cfg: Config, world_size: int = 1) -> dict[str, float]:
    """The planner's memory for this run on this machine's device, in GiB: 'allocated' (the step's peak: what
    the CUDA allocator's peak counts) and 'total' (with the allocator's slack and the device reserve).
    `plait bench` prints it beside the measured peak."""
    from plait.core.hardware import resolve_device, uses_bf16

    device = resolve_device(cfg.run.device)
    m = predict(cfg, world_size, world_size, uses_bf16(cfg.train.mixed_precision, device), device=device.type)
    return {"allocated_gib": m["peak"] / GiB, "total_gib": m["total"] / GiB}


PARTS = ("states", "buffers", "activations", "transient")
"""The prediction's parts, each at its largest; the peak is the largest moment of the step, not their sum
(plait.planner.cost.memory.rank_memory)."""

# the settings tried, alone and together, when a run does not fit (each combination only where its layout is valid)
REMEDIES = [
    ("parallel", "activation_checkpoint", "full"),
    ("train", "micro_batch_size", 1),
    ("parallel", "fsdp_reduce_every_micro_batch", True),  # no unsharded fp32 gradients held between micro-batches
    ("parallel", "cpu_offload", True),
    ("optim", "state_dtype", "bf16"),  # 12 bytes a parameter of states instead of 16
]


def _with(cfg: Config, settings) -> Config:
    """cfg with the (section, key, value) settings applied."""
    for section, key, value in settings:
        cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **{key: value})})
    return cfg


@dataclasses.dataclass(frozen=True)
class Machine:
    """What the run's processes on this node have: per-GPU memory (None: they run on the CPU, which then
    holds everything) and the host memory available (None: unknown)."""

    device_bytes: int | None
    host_bytes: int | None
    name: str = "CPU"
    bf16_native: bool = False

    @classmethod
    def here(cls, cfg: Config) -> Machine:
        from plait.core.hardware import device_info, device_memory_bytes, host_memory_bytes, resolve_device

        device = resolve_device(cfg.run.device)
        info = device_info(device)
        name = info.name if device.type == "cuda" else "CPU"
        return cls(device_memory_bytes(device), host_memory_bytes("MemAvailable"), name, info.bf16_native)


def check_memory(cfg: Config, world_size: int, local_size: int, machine: Machine | None = None) -> str | None:
    """Refuse (ConfigError) a run predicted not to fit this machine; return a line to print for one that
    nearly does (or that the model cannot judge), else None. run.memory_check=false skips it."""
    if not cfg.run.memory_check:
        return None
    if cfg.finetune.lora_rank > 0:
        return "memory: not predicted for LoRA fine-tuning (the planner counts AdamW states for every weight)"
    from plait.core.hardware import bf16_for

    machine = machine or Machine.here(cfg)
    if machine.device_bytes is None and machine.host_bytes is None:
        return "memory: not checked (this system does not say how much memory is available)"
    bf16 = bf16_for(cfg.train.mixed_precision, machine.bf16_native)
    over = functools.partial(_over, world_size=world_size, local_size=local_size, machine=machine, bf16=bf16)
    share, needs, limits, m = over(cfg, layout_of(cfg, world_size))
    detail = ", ".join(f"{k} {m[k] / GiB:.1f}" for k in PARTS)
    said = f"predicted {needs}, {limits} (per process: {detail} GiB)"
    if share > 1:
        advice = _advice(cfg, world_size, over, on_gpu=machine.device_bytes is not None)
        raise ConfigError(f"this run will not fit: {said}; {advice}; or run.memory_check=false to start anyway")
    if share > MEMORY_FRACTION:
        return (
            f"memory: {said}: close to the limit, an out-of-memory error is likely; `plait fit` runs one rank of "
            f"this job here and measures it (plait fit CONFIG --world-size {world_size})"
        )
    return None


def _over(
    cfg: Config, layout, *, world_size: int, local_size: int, machine: Machine, bf16: bool
) -> tuple[float, str, str, dict]:
    """The largest share of a limit the run needs, what it needs, of what, and the prediction."""
    from plait.planner.cost import HOST_MEMORY_FRACTION, RESERVED_GIB, host_resident

    on_gpu, host = machine.device_bytes is not None, machine.host_bytes
    procs = f"{local_size} process{'es' if local_size > 1 else ''}"
    m = predict(cfg, world_size, local_size, bf16, layout, "cuda" if on_gpu else "cpu")
    if not on_gpu:  # device and host are one memory, shared by the local processes
        assert host is not None  # noqa: S101  # without a device, the host's memory is known (checked before)
        need = local_size * (m["total"] - RESERVED_GIB * GiB + CPU_PROCESS_GIB * GiB + m["host"])
        return need / host, f"{need / GiB:.1f} GiB for {procs}", f"{host / GiB:.1f} GiB available", m
    device_bytes = machine.device_bytes
    assert device_bytes is not None  # noqa: S101  # on_gpu
    needs = f"{m['total'] / GiB:.1f} GiB per device"
    limits = f"{device_bytes / GiB:.1f} GiB on {machine.name}"
    share = m["total"] / device_bytes
    if host is not None and m["host"] > 0:  # CPU offload: the states of every local process in host memory
        need = local_size * host_resident(m["host"])
        limits += (
            f"; {need / GiB:.1f} GiB of host memory for {procs} (offloaded states {m['host'] / GiB:.1f} GiB a "
            f"process), {host / GiB:.1f} GiB available (offloaded ranks may take {HOST_MEMORY_FRACTION:.0%}: the "
            "host's OOM killer ends a process without a word)"
        )
        share = max(share, need / (HOST_MEMORY_FRACTION * host))
    return share, needs, limits, m


def _advice(cfg: Config, world_size: int, over, on_gpu: bool) -> str:
    """What brings a run that does not fit under the limit: up to three of the smallest sets of REMEDIES that
    do (each with what it then needs), or where none does, what else would."""
    remedies = [r for r in REMEDIES if getattr(getattr(cfg, r[0]), r[1]) != r[2]]
    fits: list[tuple[set[str], str]] = []
    for n in range(1, len(remedies) + 1):
        for combo in itertools.combinations(remedies, n):
            settings = {f"{section}.{key}={str(value).lower()}" for section, key, value in combo}
            if any(smaller <= settings for smaller, _ in fits):
                continue  # a part of it fits already
            changed = _with(cfg, combo)
            try:
                layout = layout_of(changed, world_size)
            except ConfigError:
                continue  # not a valid layout here (reducing every micro-batch without FSDP, say)
            got, got_needs, _, _ = over(changed, layout)
            if got <= MEMORY_FRACTION:
                fits.append((settings, got_needs))
    if fits:
        return "it fits with " + " or ".join(f"{' '.join(sorted(s))} ({need})" for s, need in fits[:3])
    if on_gpu:
        return (
            "neither full activation checkpointing, micro-batches of 1 (reduced after each), CPU offload nor "
            "bf16 AdamW moments, alone or together, brings it under: "
            "more GPUs with FSDP (`plait plan` chooses a layout)"
        )
    return (
        "neither full activation checkpointing nor micro-batches of 1, alone or together, brings it under, "
        "and more processes "
        "share the same memory: a smaller model, or GPUs (`plait plan` chooses a layout)"
    )
