"""The fused output head (plait.model.head) against the plain one (logits, then F.cross_entropy), in one run.

For each shape: forward + backward of the head alone (hidden states (B, T, dim) -> summed loss), timed
(median of N after a warm-up) and measured for memory: the bytes autograd keeps from forward to backward
(plait.parallel.activations.SavedBytes) and, on CUDA, the allocator's peak over forward + backward (on the
CPU, the peak of the bytes alive as counted by a dispatch mode: every op's output storage while it lives).
Printed with the fused / plain ratios; also checks that both give the same loss and gradients (fp32).

    python bench/head.py                       # CPU: fp32, llama3-1b's vocabulary at small batch
    python bench/head.py --device cuda --dtype bf16 --tokens 8192 --dim 2048   # llama3-1b's head on a GPU
    python bench/head.py --json bench/results/head.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from plait.model import head
from plait.model.head import IGNORE_INDEX, chunk_tokens, linear_cross_entropy
from plait.parallel.activations import SavedBytes


class PeakAlive(TorchDispatchMode):
    """The peak of the bytes alive among the storages ops create inside the mode (a CPU stand-in for the CUDA
    allocator's peak)."""

    def __init__(self):
        super().__init__()
        self.refs: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                self.refs.setdefault(st.data_ptr(), (StorageWeakRef(st), st.nbytes()))
        self.refs = {k: v for k, v in self.refs.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(n for _, n in self.refs.values()))
        return out


def plain(h, w, y):
    return F.cross_entropy((h @ w.t()).flatten(0, 1).float(), y.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def compiled(h, w, y):
    return linear_cross_entropy(h, w, y, compiled=True)


def gradients(fn, h, w, y, autocast_dtype) -> tuple[torch.Tensor, torch.Tensor]:
    h.grad = w.grad = None
    with torch.autocast(h.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        loss = fn(h, w, y)
    loss.backward()
    return h.grad.clone(), w.grad.clone()


def relative_error(got, ref) -> float:
    """The larger of the two gradients' max-abs differences, each relative to the reference's max-abs."""
    return max(float((g - r).abs().max() / r.abs().max()) for g, r in zip(got, ref, strict=True))


def measure(fn, h, w, y, device, steps: int, autocast_dtype) -> dict:
    def step():
        h.grad = w.grad = None
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            loss = fn(h, w, y)
        loss.backward()
        return loss

    step()  # warm-up
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    h.grad = w.grad = None
    with SavedBytes() as saved, torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        kept = fn(h, w, y)
    del kept
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        peak = torch.cuda.max_memory_allocated() - base
    elif fn is compiled:  # torch.compile refuses to trace under a dispatch mode: no CPU peak for it
        peak = float("nan")
    else:
        with PeakAlive() as alive:
            step()
        peak = alive.peak
    return dict(time_s=statistics.median(times), saved_bytes=saved.total, peak_bytes=peak, loss=loss.item())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="bf16: autocast over fp32 weights")
    p.add_argument("--tokens", type=int, default=1024, help="B x T of one micro-batch")
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--vocab", type=int, default=128_256)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--compiled", action="store_true", help="also the fused head with its compiled element-wise work")
    p.add_argument("--json", type=Path)
    p.add_argument("--dry-run", action="store_true", help="check the arguments and stop")
    a = p.parse_args()
    if a.dry_run:
        print(f"bench/head.py {vars(a)}")
        return
    device = torch.device(a.device)
    torch.manual_seed(0)
    h = torch.randn(1, a.tokens, a.dim, device=device, requires_grad=True)
    w = (torch.randn(a.vocab, a.dim, device=device) / a.dim**0.5).requires_grad_()
    y = torch.randint(0, a.vocab, (1, a.tokens), device=device)
    dtype = torch.bfloat16 if a.dtype == "bf16" else None
    results = {
        "plain": measure(plain, h, w, y, device, a.steps, dtype),
        "fused": measure(linear_cross_entropy, h, w, y, device, a.steps, dtype),
    }
    if a.compiled:  # as training runs it with compile.enabled
        results["fused-compiled"] = measure(compiled, h, w, y, device, a.steps, dtype)
    # Same loss and gradients (the oracle): fp32 within 1e-5 here (larger shapes sum more terms than the test's);
    # under bf16 autocast each head's gradients against the fp32 plain head's (the fused ones must be no worse).
    ref = gradients(plain, h, w, y, None)
    err = relative_error(gradients(linear_cross_entropy, h, w, y, None), ref)
    bf16_err = {}
    if dtype is not None:
        heads = {"plain": plain, "fused": linear_cross_entropy} | ({"fused-compiled": compiled} if a.compiled else {})
        bf16_err = {name: relative_error(gradients(fn, h, w, y, dtype), ref) for name, fn in heads.items()}
    chunk = chunk_tokens(a.tokens, a.vocab)
    print(
        f"head: {a.tokens} tokens x dim {a.dim} -> vocab {a.vocab:,}, {a.dtype} on {device}; "
        f"fused chunks of {chunk} tokens"
    )
    print(f"{'':8} {'time ms':>9} {'kept MB':>9} {'peak MB':>9}")
    for name, r in results.items():
        print(f"{name:8} {r['time_s'] * 1e3:>9.1f} {r['saved_bytes'] / 1e6:>9.1f} {r['peak_bytes'] / 1e6:>9.1f}")
    f, pl = results["fused"], results["plain"]
    ratios = {k: f[k] / pl[k] for k in ("time_s", "saved_bytes", "peak_bytes")}
    print(f"{'fused/plain':8} {ratios['time_s']:>9.2f} {ratios['saved_bytes']:>9.3f} {ratios['peak_bytes']:>9.3f}")
    print(f"loss {pl['loss']:.6f} vs {f['loss']:.6f}; max relative gradient difference {err:.1e}")
    for name, e in bf16_err.items():
        print(f"{a.dtype} {name}: gradients {e:.1e} off the fp32 plain head's")
    print(f"weight gradient accumulated inside the matmul: {head.FUSED_ACCUMULATION}")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        record = dict(vars(a), json=str(a.json), chunk=chunk, results=results, ratios=ratios, grad_rel_err=err)
        record |= {"bf16_grad_rel_err": bf16_err, "fused_accumulation": head.FUSED_ACCUMULATION}
        a.json.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
