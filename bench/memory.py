"""Activation memory of plait's block against Megatron's (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", Table 2), per token and layer, in bf16.

For tensor parallelism t ∈ {1, 2, 8} with sequence parallelism (a fake process group of t ranks in one
process: shapes and placements are real, collectives do nothing) and each activation checkpointing mode,
plait's own runtime (`build_trainable`: the real TP/SP plan and recompute units) runs one forward pass and
`plait.parallel.activations.SavedBytes` counts what the blocks keep for backward (saved-tensor hooks plus
selective recompute's cache; parameters excluded). Next to it: Korthikanti's per-layer formulas, in bytes
per token (divide by s·b):

    no recompute, TP + SP:         h (34 + 5 a s / h) / t
    selective recompute, TP + SP:  34 h / t
    full recompute:                2 h / t   (the block input: 2 h with TP only, sharded with SP)

SwiGLU adjustment. The 34 counts a GeLU MLP of width 4h: its input (2h), the GeLU input (8h) and output (8h)
and a dropout mask (h): 19h. A SwiGLU MLP of width F (Llama's F = 8h/3, the same parameters as 4h GeLU)
keeps, done as Megatron-Core does (fused SwiGLU keeping its 2F-wide input, the down projection its F-wide
input): 2h + 4F + 2F. So Megatron's selective term for this block is (34 - 19 + 2 + 6 F/h) h / t = (17 + 6 F/h)
h / t, and the no-dropout Llama block has no masks (-2h): we compare with the adjusted term and also print
the raw 34. Criterion (issue "real size"): with SP and selective recompute plait <= 1.15x Megatron's term.

The baseline in the same run ("selective, one region"): the whole block as one selective region, as plait
recomputed before the recompute units (and still does at tp = 1, where it keeps less).

    python bench/memory.py                  # h 3072, 24 heads of 128 (a 175B-like head size), F = 8h/3, s 1024
    python bench/memory.py --json bench/results/memory.json
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path

MODES = ("none", "selective", "full")


def one_tp(tp: int, dim: int, heads: int, kv_heads: int, ffn: int, seq: int, layers: int) -> list[dict]:
    import importlib

    import torch

    plan = importlib.import_module("plait.parallel.activation_checkpoint")  # the module, whose _units_pay is swapped

    from plait.config import load_config
    from plait.core.torch_private import init_fake_process_group
    from plait.engine.trainable import build_trainable
    from plait.parallel import Meshes, ParallelDims
    from plait.parallel.activations import SavedBytes

    init_fake_process_group(tp)
    rows = []
    units_pay = plan._units_pay
    for ac in (*MODES, "selective, one region"):
        plan._units_pay = units_pay if ac in MODES else lambda block, tp: False  # the baseline: no recompute units
        overrides = [
            f"model.dim={dim}", f"model.n_heads={heads}", f"model.n_kv_heads={kv_heads}", f"model.ffn_hidden_dim={ffn}",
            f"model.n_layers={layers}", f"model.max_seq_len={seq}", "model.vocab_size=1024", f"data.seq_len={seq}",
            "run.device=cpu", "train.global_batch_size=1", f"parallel.tp_degree={tp}",
            f"parallel.activation_checkpoint={ac.split(',')[0]}", "compile.enabled=false",
        ]  # fmt: skip
        cfg = load_config(None, overrides)
        dims = ParallelDims.from_config(cfg.parallel, tp)
        t = build_trainable(cfg, torch.device("cpu"), Meshes.build(dims, "cpu"))
        t.model.to(torch.bfloat16)  # bf16 weights and activations, as Korthikanti counts (2 bytes)
        x = torch.randint(0, 1024, (1, seq))
        with t.loss_context(), SavedBytes(t.model) as saved:
            t.model(x)
        per_token_layer = saved.per_block / saved.blocks / seq
        rows.append(dict(tp=tp, ac=ac, bytes_per_token_layer=per_token_layer))
        del t
    return rows


def megatron(h: int, a: int, s: int, f: int, tp: int, ac: str) -> tuple[float, float]:
    """(raw, SwiGLU-adjusted) bytes per token per layer of Korthikanti's Table 2, TP + SP."""
    ac = ac.split(",")[0]
    adjust = -19 + 2 + 6 * f / h - 2  # GeLU MLP and dropout masks out, SwiGLU (Megatron-Core's way) in
    if ac == "none":
        return h * (34 + 5 * a * s / h) / tp, h * (34 + adjust + 5 * a * s / h) / tp
    if ac == "selective":
        return 34 * h / tp, (34 + adjust) * h / tp
    return 2 * h / tp, 2 * h / tp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dim", type=int, default=3072)
    ap.add_argument("--heads", type=int, default=24)
    ap.add_argument("--kv-heads", type=int, default=24)
    ap.add_argument("--ffn", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tp", default="1,2,8")
    ap.add_argument("--json", default="bench/results/memory.json")
    a = ap.parse_args()
    rows = []
    for tp in (int(v) for v in a.tp.split(",")):
        code = (
            f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import memory; "
            f"print(json.dumps(memory.one_tp({tp}, {a.dim}, {a.heads}, {a.kv_heads}, {a.ffn}, {a.seq}, {a.layers})))"
        )
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(done.stderr[-3000:])
        rows += json.loads(done.stdout.strip().splitlines()[-1])
    shape = f"h {a.dim}, {a.heads} heads ({a.kv_heads} kv), F {a.ffn}, s {a.seq}"
    print(f"plait block, {shape}, bf16: bytes kept for backward per token per layer")
    print(f"{'tp':>3} {'AC':<22} {'plait':>9} {'Megatron':>9} {'adjusted':>9} {'plait/adj':>9} {'plait/raw':>9}")
    for r in rows:
        raw, adj = megatron(a.dim, a.heads, a.seq, a.ffn, r["tp"], r["ac"])
        r.update(megatron=raw, megatron_swiglu=adj, ratio=r["bytes_per_token_layer"] / adj)
        r["ratio_raw"] = r["bytes_per_token_layer"] / raw
        print(
            f"{r['tp']:>3} {r['ac']:<22} {r['bytes_per_token_layer']:>9.0f} {raw:>9.0f} {adj:>9.0f} "
            f"{r['ratio']:>9.2f} {r['ratio_raw']:>9.2f}"
        )
    out = dict(machine=platform.processor() or platform.machine(), shape=vars(a), rows=rows)
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
