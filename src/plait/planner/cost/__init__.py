"""The planner's cost model: memory per rank and step time of a parallel layout, as closed formulas.

Every function takes numpy arrays with one element per layout, so the search prices ~10^6 layouts at once.
The formulas follow what plait actually runs (``plait.parallel``): FSDP2 with bf16 compute copies and fp32
gradient reduction, tensor parallel with sequence parallel (torchtitan's plan), activation checkpointing per
block, torch.distributed.pipelining schedules, AdamW. docs/planner.md derives each term; the tests check the
FLOPs, the activation bytes and the sharded state bytes against torch itself.

Notation: T tokens in a micro-batch, h = dim, H = n_heads, kv = n_kv_heads * head_dim, F = SwiGLU width,
V = vocab, L = n_layers, s = seq_len, e = bytes per activation element (2 for bf16, 4 for fp32),
m micro-batches per step, p = pp degree, v = virtual stages per pipeline rank, c = cp degree (context
parallel: a rank holds s / c tokens of each sequence, so T = micro-batch x s / c).
"""

from __future__ import annotations

import numpy as np

from plait.planner.cluster import Cluster, GiB
from plait.planner.cost.activations import (
    EMBED_ACTIVATION_BYTES,
    head_activation_bytes,
    head_transient_bytes,
    layer_activation_bytes,
    moe_mlp_bytes,
)
from plait.planner.cost.counts import (
    block_numel,
    embed_params,
    head_flops_per_token,
    head_params,
    layer_flops_per_token,
    layer_params,
    local_numel,
    matmul_params,
    moe_params,
    sharded_numel,
    train_flops_per_token,
)
from plait.planner.cost.layouts import AC_MODES, SCHEDULES, Columns, Layouts, Workload
from plait.planner.cost.memory import (
    ALLOCATOR_OVERHEAD,
    HOST_MEMORY_FRACTION,
    MEMORY_FRACTION,
    RESERVED_GIB,
    host_resident,
    rank_memory,
)
from plait.planner.cost.pipeline import (
    ZERO_BUBBLE_LAST_MARGIN,
    held_chunks,
    peak_activations,
    split_stages,
    zero_bubble_residue,
)
from plait.planner.cost.time import (
    GEMM_KNEE,
    SELECTIVE_RECOMPUTE,
    Links,
    a2a_bytes,
    allreduce_time,
    optimizer_bytes_per_param,
    rank_time,
    ring_bytes,
    ring_time,
    step_time,
)

__all__ = [
    "AC_MODES",
    "ALLOCATOR_OVERHEAD",
    "EMBED_ACTIVATION_BYTES",
    "GEMM_KNEE",
    "optimizer_bytes_per_param",
    "HOST_MEMORY_FRACTION",
    "MEMORY_FRACTION",
    "RESERVED_GIB",
    "SCHEDULES",
    "SELECTIVE_RECOMPUTE",
    "ZERO_BUBBLE_LAST_MARGIN",
    "Layouts",
    "Workload",
    "a2a_bytes",
    "allreduce_time",
    "block_numel",
    "embed_params",
    "evaluate",
    "head_activation_bytes",
    "head_flops_per_token",
    "head_params",
    "head_transient_bytes",
    "host_resident",
    "held_chunks",
    "layer_activation_bytes",
    "layer_flops_per_token",
    "layer_params",
    "local_numel",
    "matmul_params",
    "moe_mlp_bytes",
    "moe_params",
    "peak_activations",
    "ring_bytes",
    "ring_time",
    "sharded_numel",
    "split_stages",
    "train_flops_per_token",
    "zero_bubble_residue",
]  # fmt: skip


def evaluate(work: Workload, cluster: Cluster, lay: Layouts) -> dict[str, np.ndarray]:
    """Memory (bytes, worst rank) and step time (s) with their parts, MFU and tokens/s for each layout: the
    first and the last pipeline rank are modelled (the embedding's and the output projection's), the worse
    of the two counts."""
    c = Columns.of(work, lay)
    out: dict[str, np.ndarray] = {"micro_batches": c.m}
    mem = {name: rank_memory(work, lay, c, name) for name in ("first", "last")}
    for name in ("first", "last"):  # per pipeline rank, for the comparison with measured memory (plait fit)
        for key in ("states", "buffers", "activations", "transient", "peak", "total", "host", "host_at_peak"):
            out[f"mem_{key}_{name}"] = mem[name][key]
    worst_first = mem["first"]["total"] >= mem["last"]["total"]
    for key in ("states", "buffers", "activations", "transient", "peak", "allocator", "total", "host"):
        out[f"mem_{key}"] = np.where(worst_first, mem["first"][key], mem["last"][key])
    out["fits_host"] = (
        host_resident(out["mem_host"]) * cluster.devices_per_node
        <= HOST_MEMORY_FRACTION * cluster.host_memory_gib * GiB
    )
    out["fits"] = (out["mem_total"] <= MEMORY_FRACTION * cluster.memory_gib * GiB) & out["fits_host"]
    links = Links.of(cluster, c)
    out["tp_cross_node"] = links.tp_spans
    per_rank = {name: rank_time(work, cluster, lay, c, links, rank) for name, rank in mem.items()}
    out.update(step_time(work, cluster, lay, c, per_rank))
    return out
