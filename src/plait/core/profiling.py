"""Where a step's time goes: a few steps under torch's profiler, summarised by kind of kernel.

`profile_steps(step, n, device, out_dir)` runs `step()` n times under `torch.profiler`, writes the profiler's
own table (`profile_table.txt`, sorted by self device time on an accelerator, else by self CPU time) and its
Chrome trace (`trace.json.gz`, open in https://ui.perfetto.dev), and returns a summary: device-busy time per
step against the wall time (what is left is the device waiting for the host: launches, synchronisations,
Python), kernels launched per step, and the device time by kind of kernel (matrix products, attention,
compiled Triton code, the optimizer's multi-tensor kernels, collectives, copies, other eager kernels).
"""

from __future__ import annotations

import gzip
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity

# The first pattern found in a kernel's (lower-cased) name decides its kind: compiled code first (Inductor names
# its kernels after the ops they fuse, "_to_copy" and "mm" included).
KINDS = (
    ("triton (compiled)", ("triton",)),
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn")),
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "wgmma", "matmul")),
    ("multi-tensor (optimizer, clipping)", ("multi_tensor", "foreach", "adam")),
    ("collectives", ("nccl",)),
    ("copies and casts", ("memcpy", "memset", "copy_kernel")),
)


def kind_of(kernel: str) -> str:
    name = kernel.lower()
    return next((kind for kind, patterns in KINDS if any(p in name for p in patterns)), "other eager")


def _self_device_us(evt) -> float:
    return float(getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0) or 0)


def profile_steps(step: Callable[[], object], n: int, device: torch.device, out_dir: Path) -> dict:
    on_device = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_device else [])
    out_dir.mkdir(parents=True, exist_ok=True)

    def sync():
        if on_device:
            torch.cuda.synchronize(device)

    sync()
    with torch.profiler.profile(activities=activities) as prof:
        started = time.perf_counter()
        for _ in range(n):
            step()
        sync()
        wall = time.perf_counter() - started
    averages = prof.key_averages()
    sort = "self_device_time_total" if on_device else "self_cpu_time_total"
    (out_dir / "profile_table.txt").write_text(averages.table(sort_by=sort, row_limit=60, max_name_column_width=90))
    trace = out_dir / "trace.json"
    prof.export_chrome_trace(str(trace))
    with trace.open("rb") as src, gzip.open(out_dir / "trace.json.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    trace.unlink()

    summary = {"steps": n, "wall_per_step_s": wall / n, "files": ["profile_table.txt", "trace.json.gz"]}
    if not on_device:
        top = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:10]
        summary["top_cpu_ops_s_per_step"] = {e.key: e.self_cpu_time_total / 1e6 / n for e in top}
        return summary
    kernels = [  # the device's own work; a user annotation's range (the optimizer's step) spans kernels counted here
        e
        for e in averages
        if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
    ]
    by_kind: dict[str, float] = {}
    for e in kernels:
        by_kind[kind_of(e.key)] = by_kind.get(kind_of(e.key), 0.0) + _self_device_us(e) / 1e6 / n
    busy = sum(by_kind.values())
    summary |= {
        "device_busy_per_step_s": busy,
        "device_idle_share": max(0.0, 1 - busy / (wall / n)) if wall else 0.0,
        "kernels_per_step": sum(e.count for e in kernels) / n,
        "device_s_per_step_by_kind": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
        "top_kernels_s_per_step": {
            e.key[:120]: _self_device_us(e) / 1e6 / n for e in sorted(kernels, key=_self_device_us, reverse=True)[:15]
        },
    }
    return summary


def describe(summary: dict) -> str:
    """One line of what profile_steps found: on a device, busy vs wall, idle share and time by kind of kernel;
    on a CPU, the ops that took the time."""
    wall, n = summary["wall_per_step_s"], summary["steps"]
    if "device_s_per_step_by_kind" not in summary:
        ops = list(summary["top_cpu_ops_s_per_step"].items())[:5]
        return f"profile ({n} steps, {wall * 1e3:,.1f} ms a step), most CPU time: " + ", ".join(
            f"{k} {v * 1e3:,.1f} ms" for k, v in ops
        )
    return (
        f"profile ({n} steps, {summary['kernels_per_step']:,.0f} kernels a step): device busy "
        f"{summary['device_busy_per_step_s'] * 1e3:,.1f} of {wall * 1e3:,.1f} ms a step, idle "
        f"{100 * summary['device_idle_share']:.1f}%; "
        + ", ".join(f"{k} {v * 1e3:,.1f} ms" for k, v in summary["device_s_per_step_by_kind"].items())
    )


AREAS = (  # (name, a part of the source path): what a sampled stack passes through
    ("dynamo", "torch/_dynamo/"),
    ("aot_autograd", "torch/_functorch/"),
    ("inductor", "torch/_inductor/"),
    ("inductor: autotune", "select_algorithm"),
    ("inductor: async compile wait", "async_compile"),
    ("triton", "triton/"),
    ("autograd engine", "torch/autograd/"),
    ("cuda", "torch/cuda/"),
    ("distributed", "torch/distributed/"),
    ("plait", "plait/"),
)


class StackSampler:
    """Where a long stretch of host time goes (the first step's compilation and set-up): the calling thread's
    Python stack every `interval_s`, counted under its innermost `depth` frames (file:function) and under every
    AREA its whole stack passes through (a sample in Inductor's code generation called from AOTAutograd counts
    for both). Each sample is weighted by the wall time since the one before: native code that holds the GIL
    keeps the sampler thread waiting, and the stack it then sees is the one that made that native call, so
    those seconds land where they were spent (counting samples instead missed most of a compiled first step:
    docs/measurements.md, "profiling: samples weighted by wall time").
    Not faulthandler's GIL-free watchdog: it reads frames that the running thread frees (Dynamo makes
    and drops code objects) and crashed every compiled first step on a CPU. `top()` gives seconds per stack,
    `areas()` seconds per area."""

    def __init__(self, interval_s: float = 0.25, depth: int = 4):
        import threading

        self.interval_s, self.depth = interval_s, depth
        self.seconds: dict[str, float] = {}
        self.area_seconds: dict[str, float] = {}
        self.sampled_s = 0.0
        self.samples = 0
        self._target = threading.get_ident()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="plait-stack-sampler", daemon=True)

    def __enter__(self) -> StackSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import sys
        import time

        last = time.perf_counter()
        while not self._stop.wait(self.interval_s):
            frame = sys._current_frames().get(self._target)
            now = time.perf_counter()
            frames = []
            while frame is not None:
                frames.append((frame.f_code.co_filename, frame.f_code.co_name))
                frame = frame.f_back
            self._count(frames, now - last)
            last = now

    def _count(self, frames: list[tuple[str, str]], seconds: float) -> None:
        """frames: (path, function), innermost first, standing for `seconds` of wall time."""
        if not frames:
            return
        key = " <- ".join(f"{Path(path).name}:{func}" for path, func in frames[: self.depth])
        self.seconds[key] = self.seconds.get(key, 0.0) + seconds
        for area in {area for area, part in AREAS for path, _ in frames if part in path.replace("\\", "/")}:
            self.area_seconds[area] = self.area_seconds.get(area, 0.0) + seconds
        self.sampled_s += seconds
        self.samples += 1

    def areas(self) -> dict[str, float]:
        ranked = sorted(self.area_seconds.items(), key=lambda kv: -kv[1])
        return {"sampled": self.sampled_s} | dict(ranked)

    def top(self, n: int = 15) -> dict[str, float]:
        return dict(sorted(self.seconds.items(), key=lambda kv: -kv[1])[:n])
