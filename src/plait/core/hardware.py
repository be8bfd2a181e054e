"""What the device is and what it can do: resolution of 'auto', peak FLOP/s for MFU, memory in use."""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from functools import cache

import torch

from plait.core.errors import ConfigError

# Dense (no sparsity) peak FLOP/s per device, bf16 tensor cores for GPUs. Substrings of the CUDA device name,
# most specific first. Sources: NVIDIA data sheets (SXM parts).
GPU_PEAK_BF16: list[tuple[str, float]] = [
    ("GB200", 2.5e15),
    ("B200", 2.25e15),
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("A10G", 70e12),
    ("L4", 121e12),
    ("V100", 125e12),  # fp16 tensor cores; V100 has no bf16
]


@dataclass(frozen=True)
class DeviceInfo:
    device: torch.device
    name: str
    peak_flops: float  # dense peak for the training dtype, per device
    peak_source: str  # where the peak comes from, shown next to MFU
    bf16_native: bool


def resolve_device(spec: str, local_rank: int = 0) -> torch.device:
    """'auto' -> this rank's GPU if CUDA is present, else the CPU."""
    if spec == "auto":
        return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(spec)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"run.device={spec!r} but no CUDA device is visible; use run.device=cpu or auto")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank)
    return device


@cache
def device_info(device: torch.device) -> DeviceInfo:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peak in GPU_PEAK_BF16:
            if key in name:
                return DeviceInfo(device, name, peak, f"{key} dense bf16 data sheet", True)
        # Unknown GPU: a rough figure from SM count so MFU is at least in the right range.
        props = torch.cuda.get_device_properties(device)
        peak = props.multi_processor_count * 1024 * 2 * 1.5e9
        return DeviceInfo(device, name, peak, "estimated from SM count", torch.cuda.is_bf16_supported())
    peak, why = _cpu_peak_fp32()
    return DeviceInfo(device, _cpu_name(), peak, why, False)


def uses_bf16(mixed_precision: str, device: torch.device) -> bool:
    """train.mixed_precision resolved on a device: 'bf16' always, 'auto' where the device has native bf16,
    'fp32' never. The one place runtime, benchmark and planner decide the compute precision."""
    return bf16_for(mixed_precision, device_info(device).bf16_native)


def bf16_for(mixed_precision: str, bf16_native: bool) -> bool:
    """uses_bf16's rule, for a device described rather than present (the memory check's machine)."""
    return mixed_precision == "bf16" or (mixed_precision == "auto" and bf16_native)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "CPU"


CPU_FLOPS_PER_CYCLE = (  # (a /proc/cpuinfo flag, fp32 FLOPs a core can issue a cycle, the name), best first
    ("avx512f", 64, "AVX-512: two 16-wide FMA units"),
    ("fma", 32, "AVX2: two 8-wide FMA units"),
    ("avx", 16, "AVX: 8-wide add + multiply"),
    ("sve", 32, "SVE"),
    ("asimd", 16, "NEON: four 4-wide FMA units"),
)


def _cpu_peak_fp32() -> tuple[float, str]:
    """cores x clock x fp32 FLOPs a cycle, the width read from the CPU's flags (an upper bound: a part with
    one FMA unit does half). The clock is the highest the kernel reports (cpufreq's maximum, else the
    current 'cpu MHz'). Counting AVX2's width on an AVX-512 part would put MFU above 100%. A VM without
    cpufreq shows its base clock, so a large matmul at a turbo clock can beat the figure; a training step's
    smaller matmuls stay far below it (docs/measurements.md, "hardware: the CPU's peak")."""
    first: dict[str, str] = {}  # the first core's lines
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                first.setdefault(key.strip(), value)
    except OSError:
        pass
    flags = set((first.get("flags") or first.get("Features") or "").split())
    try:
        mhz = float(first.get("cpu MHz", 2500.0))
    except ValueError:
        mhz = 2500.0
    try:
        with open("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq") as f:
            mhz = max(mhz, int(f.read()) / 1000)
    except (OSError, ValueError):
        pass
    return cpu_peak(flags, mhz, torch.get_num_threads())


def cpu_peak(flags: set[str], mhz: float, cores: int) -> tuple[float, str]:
    """fp32 FLOP/s of `cores` cores at `mhz` with the widest vector unit among `flags`, and how it was found."""
    per_cycle, isa = next(((n, name) for flag, n, name in CPU_FLOPS_PER_CYCLE if flag in flags), (32, "assumed"))
    why = f"estimated fp32 peak: {cores} core(s) x {mhz / 1000:.2f} GHz x {per_cycle} FLOPs/cycle ({isa})"
    return cores * mhz * 1e6 * per_cycle, why


def memory_stats(device: torch.device) -> dict[str, float]:
    """Peak memory in GiB: allocator peak on CUDA, the process's peak resident set on the CPU."""
    if device.type == "cuda":
        return {
            "mem_peak_gib": torch.cuda.max_memory_allocated(device) / 2**30,
            "mem_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30,
        }
    return {"mem_peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30}


def host_memory_bytes(field: str = "MemAvailable") -> int | None:
    """This machine's memory from /proc/meminfo: 'MemAvailable' (what new processes can take without swapping)
    or 'MemTotal'; None where the kernel does not say (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def device_memory_bytes(device: torch.device) -> int | None:
    """A GPU's total memory (the properties: no CUDA context is made for it); None for the CPU."""
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def threads_per_rank(local_ranks: int) -> int:
    """CPU threads of each of a node's `local_ranks` processes (OMP_NUM_THREADS where the launcher sets it): the
    cores shared out. Inductor keys compiled CPU code on it, so `plait compile` takes the same."""
    return max(1, (os.cpu_count() or 1) // max(local_ranks, 1))
