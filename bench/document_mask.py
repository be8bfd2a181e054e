"""What document masking costs in attention: forward + backward of one attention layer over packed documents,
the way plait's model runs it on the device, against plain causal attention in the same run.

Sides: `causal` (SDPA is_causal: flash attention, the unmasked baseline), `masked` (SDPA with the (B, 1, T, T)
document mask: what the CPU runs), `flex` (flex_attention with the documents' block mask, compiled: what
CUDA runs; block mask built each iteration, as each forward builds it). Documents have lengths drawn
around --doc-len. Prints each side's median milliseconds and its ratio to `causal`; writes them to --json.

    python bench/document_mask.py                       # CPU: causal and masked
    python bench/document_mask.py --device cuda         # CUDA: the three, bf16
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from plait.model.llama import _flex, document_block_mask, document_ids, document_mask


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--doc-len", type=int, default=512, help="mean document length (tokens)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json", default="bench/results/document_mask.json")
    p.add_argument("--dry-run", action="store_true", help="check the arguments and say what would run")
    a = p.parse_args()
    if a.dry_run:
        print(f"would time causal, masked{' and flex' if a.device.startswith('cuda') else ''} attention on {a.device}")
        return 0
    device = torch.device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cpu":  # a CPU run is small: 2 cores
        a.batch, a.seq, a.heads, a.kv_heads = min(a.batch, 2), min(a.seq, 1024), min(a.heads, 8), min(a.kv_heads, 2)
    gen = torch.Generator().manual_seed(0)
    eos = (torch.rand(a.batch, a.seq, generator=gen) < 1 / a.doc_len).to(device)
    docs = document_ids(eos.long(), 1)
    rep = a.heads // a.kv_heads

    def tensors():
        shapes = [(a.batch, h, a.seq, a.head_dim) for h in (a.heads, a.kv_heads, a.kv_heads)]
        return [torch.randn(s, device=device, dtype=dtype, requires_grad=True) for s in shapes]

    def causal(q, k, v):
        return F.scaled_dot_product_attention(
            q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True
        )

    def masked(q, k, v):
        mask = document_mask(docs, 0)
        return F.scaled_dot_product_attention(
            q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=mask
        )

    def flex(q, k, v):
        return _flex(q, k, v, document_block_mask(docs, 0), rep > 1)

    sides = {"causal": causal, "masked": masked}
    if device.type == "cuda":
        sides["flex"] = flex
    q, k, v = tensors()
    grad = torch.randn_like(q)
    results = {}
    for name, fn in sides.items():
        times = []
        for i in range(a.iters + 2):  # two warm-up iterations (compilation for flex)
            sync(device)
            start = time.perf_counter()
            fn(q, k, v).backward(grad)
            sync(device)
            if i >= 2:
                times.append((time.perf_counter() - start) * 1e3)
        results[name] = statistics.median(times)
    base = results["causal"]
    docs_per_row = float((docs[:, -1] + 1).float().mean())
    print(f"attention fwd+bwd, {device}, B={a.batch} T={a.seq} heads {a.heads}/{a.kv_heads} x {a.head_dim}, "
          f"{docs_per_row:.1f} documents per row")  # fmt: skip
    for name, ms in results.items():
        print(f"  {name:7s} {ms:9.2f} ms   x{ms / base:.2f} of causal")
    out = Path(a.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = dict(device=str(device), dtype=str(dtype), batch=a.batch, seq=a.seq, heads=a.heads, kv_heads=a.kv_heads,
                  head_dim=a.head_dim, documents_per_row=docs_per_row, median_ms=results,
                  ratio_to_causal={n: ms / base for n, ms in results.items()})  # fmt: skip
    if device.type == "cuda":
        record["gpu"] = torch.cuda.get_device_name()
    out.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
