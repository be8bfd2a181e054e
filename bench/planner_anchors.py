"""Published training runs next to `plait plan`: the table in docs/planner.md ("Anchors").

For each run the planner is given the model, cluster, sequence length and global batch, and
- restricted to the published parallel degrees (dp total, tp, pp), picks the rest (dp split, schedule, v,
  micro-batch, activation checkpointing, offload) and reports its memory, tokens/s per device and MFU;
- unrestricted, reports its own best layout for the same cluster and batch.
Nothing here is fitted to these rows: the cluster presets' efficiencies apply (A100 0.65, H100 0.55).

Batch sizes and sequence lengths are the published ones where stated; where a source gives only a per-rank
batch the global batch is that times dp (noted in the row). Runs on 96 GB H100 (torchtitan's power-capped
parts) use memory_gib=96.

    python bench/planner_anchors.py [--json bench/results/planner_anchors.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from plait.core.errors import ConfigError
from plait.model import ModelArgs, preset_args
from plait.planner import Workload, get_cluster, plan
from plait.planner.search import layout_name

# Megatron-LM's 1T model (Narayanan et al. 2021, Table 1) in Llama shape: h 25,600, 128 layers, 160 heads (MHA),
# SwiGLU width 68,352 (a block is ~12 h^2 like Megatron's 4h MLP), vocabulary 51,200: 1.01T parameters.
T1 = ModelArgs(
    dim=25600, n_layers=128, n_heads=160, n_kv_heads=160, vocab_size=51200, ffn_hidden_dim=68352, max_seq_len=2048
)


@dataclass
class Anchor:
    name: str
    published: str
    model: ModelArgs
    cluster: str
    nodes: int
    seq_len: int
    batch: int  # sequences per step
    dp: int
    tp: int
    pp: int
    memory_gib: float | None = None
    cp: int = 1


ANCHORS = [
    Anchor("torchtitan 8B FSDP 8, 8 H100 (96 GB), bs 2, sel. AC", "5,762 tok/s/GPU, 82.4 GiB",
           preset_args("llama3-8b"), "h100", 1, 8192, 16, 8, 1, 1, 96),
    Anchor("torchtitan 8B FSDP 128, 128 H100 (96 GB), bs 2, sel. AC", "5,605 tok/s/GPU, 67.0 GiB",
           preset_args("llama3-8b"), "h100", 16, 8192, 256, 128, 1, 1, 96),
    Anchor("torchtitan 8B FSDP 64, 64 A100, bs 1, sel. op AC", "2,973 tok/s/GPU, 58.2% MFU",
           preset_args("llama3-8b"), "a100", 8, 8192, 64, 64, 1, 1),
    Anchor("torchtitan 70B FSDP 64, 64 A100, bs 1, full AC", "331 tok/s/GPU, 51.7% MFU",
           preset_args("llama3-70b"), "a100", 8, 8192, 64, 64, 1, 1),
    Anchor("torchtitan 70B FSDP 32 x TP 8, 256 H100 (96 GB), bs 16, Float8", "829 tok/s/GPU (Float8)",
           preset_args("llama3-70b"), "h100", 32, 8192, 512, 32, 8, 1, 96),
    Anchor("torchtitan 405B FSDP 8 x TP 8 x PP 8, 512 H100 (96 GB), bs 8, Float8",
           "100 (1F1B), 128 (interleaved) tok/s/GPU (Float8)",
           preset_args("llama3-405b"), "h100", 64, 8192, 64, 8, 8, 8, 96),
    Anchor("Meta Llama 3 405B, 8,192 H100, tp 8 pp 16 dp 64, 16M tokens", "430 TFLOP/s, 43% MFU",
           preset_args("llama3-405b"), "h100", 1024, 8192, 2048, 64, 8, 16),
    Anchor("Meta Llama 3 405B, 16,384 H100, tp 8 pp 16 dp 128, 16M tokens", "400 TFLOP/s, 41% MFU",
           preset_args("llama3-405b"), "h100", 2048, 8192, 2048, 128, 8, 16),
    Anchor("Meta Llama 3 405B long context, 16,384 H100, tp 8 cp 16 pp 16 dp 8, seq 131,072, 16M tokens",
           "380 TFLOP/s, 38% MFU", preset_args("llama3-405b"), "h100", 2048, 131072, 128, 8, 8, 16, cp=16),
    Anchor("Megatron-LM 1T, 3,072 A100, tp 8 pp 64 dp 6, seq 2048, batch 3072",
           "163 TFLOP/s incl. recompute (~39% MFU)",
           T1, "a100", 384, 2048, 3072, 6, 8, 64),
]  # fmt: skip


def evaluate_anchor(a: Anchor) -> dict:
    cluster = get_cluster(a.cluster, nodes=a.nodes, memory_gib=a.memory_gib)
    row: dict = {"run": a.name, "published": a.published}
    try:
        result = plan(Workload(a.model, a.seq_len, a.batch), cluster, hints=False)
    except ConfigError as e:
        return {**row, "error": str(e).splitlines()[0]}
    lay, met = result.layouts, result.metrics
    devices = cluster.world_size
    same = (lay.tp == a.tp) & (lay.pp == a.pp) & (lay.dp_replicate * lay.dp_shard == a.dp) & (lay.cp == a.cp)
    fitting = np.nonzero(same & met["fits"])[0]
    if len(fitting):
        rec = result.record(int(fitting[np.argmin(met["step_time"][fitting])]))
        row["published_degrees"] = {
            "layout": layout_name(rec),
            "mem_gib": rec["mem_total_gib"],
            "tokens_per_s_per_device": rec["tokens_per_s"] / devices,
            "mfu": rec["mfu"],
        }
    else:
        leanest = np.nonzero(same)[0]
        need = float(met["mem_total"][leanest].min()) / 2**30 if len(leanest) else float("nan")
        row["published_degrees"] = {"layout": "does not fit", "mem_gib": need}
    best = result.record(result.best)
    row["planner_best"] = {"layout": layout_name(best), "mfu": best["mfu"], "mem_gib": best["mem_total_gib"]}
    return row


def markdown(rows: list[dict]) -> str:
    out = [
        "| run | published | planner, published degrees | GiB/rank | tok/s/GPU | MFU | planner's own best |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['run']} | {r['published']} | {r['error']} | | | | |")
            continue
        p, b = r["published_degrees"], r["planner_best"]
        if p["layout"] == "does not fit":
            cells = f"does not fit: {p['mem_gib']:.1f} GiB predicted | | | "
        else:
            cells = f"{p['layout']} | {p['mem_gib']:.1f} | {p['tokens_per_s_per_device']:,.0f} | {p['mfu']:.1%} "
        out.append(f"| {r['run']} | {r['published']} | {cells}| {b['layout']}: {b['mfu']:.1%} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="bench/results/planner_anchors.json", help="Where to write the rows.")
    args = parser.parse_args(argv)
    rows = [evaluate_anchor(a) for a in ANCHORS]
    print(markdown(rows))
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"\nwrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
