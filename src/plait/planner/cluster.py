"""Clusters the planner plans for: device memory and speed, links inside and between nodes.

Presets are data-sheet figures turned into *achievable* numbers (the planner predicts time, so it needs what
NCCL and cuBLAS deliver, not the marketing peak): bandwidths are NCCL bus bandwidths per device, one
direction; `efficiency` is the fraction of the dense bf16 peak a large transformer step sustains in its
matmuls and the memory-bound work between them (before any communication or pipeline bubble).
``measure_local()`` builds the profile of this machine from a short matmul and copy benchmark.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from plait.core.errors import ConfigError

GiB = 2**30


@dataclass(frozen=True)
class Cluster:
    name: str
    nodes: int
    devices_per_node: int
    memory_gib: float
    """Device memory as the driver reports it (torch.cuda.mem_get_info total), GiB."""
    peak_flops: float
    """Dense bf16 peak per device (the MFU denominator), FLOP/s."""
    efficiency: float
    """Achieved fraction of peak on the model's compute with large GEMMs (smaller GEMMs get less: cost/time.py)."""
    intra_bw: float
    """Per-device collective bandwidth inside a node (NVLink / NeuronLink), bytes/s."""
    inter_bw: float
    """Per-device collective bandwidth between nodes (one NIC per device), bytes/s."""
    intra_latency: float
    """Per-hop latency of a collective inside a node, s (the alpha of the alpha-beta model)."""
    inter_latency: float
    """Per-hop latency of a collective between nodes, s."""
    hbm_bw: float
    """Device memory bandwidth, bytes/s (the optimizer step is bound by it)."""
    host_memory_gib: float
    """CPU memory per node, GiB (CPU offload keeps model states there)."""
    host_bw: float
    """CPU memory bandwidth per node, bytes/s (the offloaded optimizer step is bound by it)."""
    pcie_bw: float
    """Host <-> device bandwidth per device, bytes/s (CPU offload moves shards over it)."""

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    def describe(self) -> str:
        return (
            f"{self.name}: {self.nodes} x {self.devices_per_node} devices, {self.memory_gib:g} GiB, "
            f"{self.peak_flops / 1e12:g} TFLOP/s peak x {self.efficiency:g} efficiency, links "
            f"{self.intra_bw / 1e9:g} GB/s intra / {self.inter_bw / 1e9:g} GB/s inter"
        )


# Sources: NVIDIA DGX A100 / H100 / H200 and AWS trn1.32xlarge data sheets; bus bandwidths from published
# nccl-tests results (all-reduce busbw ~230 GB/s on NVLink3, ~360 GB/s on NVLink4; ~90% of line rate over
# 200/400 Gb/s InfiniBand per GPU). Efficiencies: the fraction of peak that single-node FSDP runs of
# Llama-size models sustain (torchtitan reports ~58% MFU on A100, 39% on power-capped H100).
PRESETS: dict[str, Cluster] = {
    "a100": Cluster(
        name="a100",
        nodes=1,
        devices_per_node=8,
        memory_gib=80.0,
        peak_flops=312e12,
        efficiency=0.65,
        intra_bw=230e9,
        inter_bw=22e9,
        intra_latency=5e-6,
        inter_latency=12e-6,
        hbm_bw=2.0e12,
        host_memory_gib=1024,
        host_bw=200e9,
        pcie_bw=24e9,
    ),
    "h100": Cluster(
        name="h100",
        nodes=1,
        devices_per_node=8,
        memory_gib=79.6,
        peak_flops=989e12,
        efficiency=0.55,
        intra_bw=360e9,
        inter_bw=45e9,
        intra_latency=4e-6,
        inter_latency=10e-6,
        hbm_bw=3.35e12,
        host_memory_gib=2048,
        host_bw=300e9,
        pcie_bw=48e9,
    ),
    "h200": Cluster(
        name="h200",
        nodes=1,
        devices_per_node=8,
        memory_gib=140.4,
        peak_flops=989e12,
        efficiency=0.58,
        intra_bw=360e9,
        inter_bw=45e9,
        intra_latency=4e-6,
        inter_latency=10e-6,
        hbm_bw=4.8e12,
        host_memory_gib=2048,
        host_bw=300e9,
        pcie_bw=48e9,
    ),
    # trn1.32xlarge: 16 Trainium chips (32 GiB, 190 TFLOP/s bf16 each), NeuronLink ring, 800 Gb/s EFA.
    "trn1": Cluster(
        name="trn1",
        nodes=1,
        devices_per_node=16,
        memory_gib=32.0,
        peak_flops=190e12,
        efficiency=0.45,
        intra_bw=100e9,
        inter_bw=5.5e9,
        intra_latency=8e-6,
        inter_latency=20e-6,
        hbm_bw=0.82e12,
        host_memory_gib=512,
        host_bw=150e9,
        pcie_bw=16e9,
    ),
}


def get_cluster(name: str, **overrides) -> Cluster:
    """A preset (or 'local': measured now) with fields replaced by the non-None overrides."""
    if name == "local":
        base = measure_local()
    elif name in PRESETS:
        base = PRESETS[name]
    else:
        raise ConfigError(f"--cluster={name!r} is not a preset; choose one of {', '.join([*PRESETS, 'local'])}")
    changes = {k: v for k, v in overrides.items() if v is not None}
    for key, value in changes.items():
        if key != "name" and not value > 0:
            raise ConfigError(f"cluster setting {key}={value} must be positive")
    return dataclasses.replace(base, **changes)


def measure_local(seconds: float = 0.3) -> Cluster:
    """This machine as a one-node cluster: a timed matmul gives the achieved FLOP/s (as efficiency against
    the device's peak from plait.core.hardware), a timed copy the memory bandwidth; one device per node."""
    import torch

    from plait.core.hardware import device_info, resolve_device

    device = resolve_device("auto")
    info = device_info(device)
    dtype = torch.bfloat16 if info.bf16_native else torch.float32
    n = 4096 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    flops = _rate(lambda: a @ b, 2 * n**3, seconds, device)
    src = torch.empty(64 * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    copy_bw = _rate(lambda: dst.copy_(src), 2 * src.numel() * 4, seconds, device)
    if device.type == "cuda":
        memory = torch.cuda.mem_get_info(device)[1] / GiB
        host = _host_memory_gib()
    else:
        memory = host = _host_memory_gib()
    peak = max(info.peak_flops, flops)
    return Cluster(
        name=f"local ({info.name})",
        nodes=1,
        devices_per_node=1,
        memory_gib=round(memory, 1),
        peak_flops=peak,
        efficiency=round(flops / peak, 3),
        intra_bw=copy_bw,
        inter_bw=copy_bw,
        intra_latency=5e-6,
        inter_latency=5e-6,
        hbm_bw=copy_bw,
        host_memory_gib=round(host, 1),
        host_bw=copy_bw if device.type == "cpu" else 50e9,
        pcie_bw=copy_bw if device.type == "cpu" else 25e9,
    )


def _rate(fn, work: float, seconds: float, device) -> float:
    """work / time of fn, after one warm-up call, repeated for about `seconds`."""
    import torch

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        sync()
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return work * calls / elapsed


def _host_memory_gib() -> float:
    from plait.core.hardware import host_memory_bytes

    total = host_memory_bytes("MemTotal")
    return total / GiB if total else 16.0
