"""Muon's Newton-Schulz on one device, for a preset's matrices: how long plait's orthogonalisation of a whole
step's updates takes, against its floor (the iteration's FLOPs at the device's measured matrix rate).

    python bench/muon_ns.py [--preset llama3-1b] [--device cuda] [--repeat 10] [--json FILE] [--dry-run]

Two versions of the same arithmetic, on the preset's Muon matrices (plait.engine.muon.takes_muon, their shapes
from the model built on the meta device), fp32 updates as the optimizer holds them:
- `plait`: plait.parallel.orthogonal.orthogonalise_all, as one process runs it (each matrix on its own, each
  update dropped as it comes, as the optimizer applies it; before 2026-11-30 every update was kept to the end);
- `stacked`: the matrices of one shape stacked and iterated as one batch (one bmm per product), all kept.
The iteration is in bf16 on a GPU (torch.optim.Muon's) and fp32 on a CPU, as `optim.muon_ns_dtype=auto`.
The matrix rate is a square bf16 (GPU) or fp32 (CPU) product of the preset's width's largest matrix shape.
FLOPs per iteration of an A x B matrix, A <= B: 4 A^2 B + 2 A^3 (two products with the A x A Gram matrix
and one A x A square). Prints a short table; --json writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def median_s(fn, device: torch.device, repeat: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def muon_shapes(preset: str) -> list[tuple[int, ...]]:
    from plait.config import load_config
    from plait.engine.muon import takes_muon
    from plait.model.llama import Transformer

    args = load_config(None, [f"model.preset={preset}"]).model
    with torch.device("meta"):
        model = Transformer(args)
    return [tuple(p.shape) for name, p in model.named_parameters() if takes_muon(name, p)]


def ns_flops(shape: tuple[int, ...], steps: int) -> float:
    *batch, a, b = shape
    a, b = min(a, b), max(a, b)
    n = 1
    for d in batch:
        n *= d
    return n * steps * (4 * a * a * b + 2 * a**3)


def matmul_rate(n: int, dtype: torch.dtype, device: torch.device, repeat: int) -> float:
    x = torch.randn(n, n, device=device, dtype=dtype)
    y = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / median_s(lambda: x @ y, device, repeat)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama3-1b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--dry-run", action="store_true", help="count the matrices and FLOPs and stop")
    a = ap.parse_args()

    from functools import partial

    from plait.engine.muon import NS_COEFFICIENTS, NS_EPS
    from plait.parallel.orthogonal import newton_schulz, orthogonalise_all

    steps = 5  # torch.optim.Muon's ns_steps, plait's default optim.muon_ns_steps
    shapes = muon_shapes(a.preset)
    flops = sum(ns_flops(s, steps) for s in shapes)
    print(f"{a.preset}: {len(shapes)} Muon matrices, {sum(torch.Size(s).numel() for s in shapes) / 1e6:.1f}M "
          f"parameters, {flops / 1e12:.2f} TFLOP of Newton-Schulz a step")  # fmt: skip
    if a.dry_run:
        return 0
    device = torch.device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ns = partial(newton_schulz, steps=steps, coefficients=NS_COEFFICIENTS, eps=NS_EPS, dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    updates = [torch.randn(s, device=device, generator=gen) for s in shapes]

    def plait_path():  # each update used as it comes (the optimizer applies it), none kept
        for _ in orthogonalise_all(updates, updates.__getitem__, ns):
            pass

    def plait_kept():
        out: list = [None] * len(updates)
        for i, u in orthogonalise_all(updates, updates.__getitem__, ns):
            out[i] = u
        return out

    by_shape: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for i, s in enumerate(shapes):
        by_shape[s].append(i)

    def stacked():
        out: list = [None] * len(updates)
        for members in by_shape.values():
            done = ns(torch.stack([updates[i] for i in members]))
            for i, d in zip(members, done.unbind(0), strict=True):
                out[i] = d
        return out

    # the same function: the stacked version equals plait's within bf16 rounding
    ref, other = plait_kept(), stacked()
    err = max(((r.float() - o.float()).norm() / r.float().norm()).item() for r, o in zip(ref, other, strict=True))
    width = max(max(s[-2:]) for s in shapes)
    rate = matmul_rate(min(width, 8192), dtype, device, a.repeat)
    rec = {
        "preset": a.preset,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "dtype": str(dtype),
        "matrices": len(shapes),
        "ns_tflop": flops / 1e12,
        "matmul_tflops": rate / 1e12,
        "floor_s": flops / rate,
        "plait_s": median_s(plait_path, device, a.repeat),
        "stacked_s": median_s(stacked, device, a.repeat),
        "stacked_vs_plait_rel_err": err,
    }
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        plait_path()
        rec["plait_transient_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
        torch.cuda.reset_peak_memory_stats()
        stacked()
        rec["stacked_transient_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    print(f"{'version':<8} {'ms':>8} {'TFLOP/s':>8} {'x floor':>8}")
    print(f"{'floor':<8} {1e3 * rec['floor_s']:>8.1f} {rec['matmul_tflops']:>8.0f} {1.0:>8.2f}")
    for v in ("plait", "stacked"):
        s = rec[f"{v}_s"]
        print(f"{v:<8} {1e3 * s:>8.1f} {flops / s / 1e12:>8.0f} {s / rec['floor_s']:>8.2f}")
    print(f"stacked against plait's: relative difference {err:.1e} ({dtype})")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(rec, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
