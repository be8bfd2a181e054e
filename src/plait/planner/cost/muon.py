"""What Muon (optim.name = "muon", plait.engine.muon) changes in a rank's memory and its optimizer step.

Memory: the blocks' matrices keep one fp32 momentum buffer instead of AdamW's two moments (4 bytes a parameter
instead of 8; norms, routers and the embedding and head keep AdamW's: muon_numel counts the matrices alone),
and while the step runs, the whole matrices each rank orthogonalises are alive beside the states
(plait.parallel.orthogonal: the stack it receives, the iteration's working copies, the stack it sends back, and
the next round's arriving one), at most TRANSIENT_MATRICES of the largest.

Time: the Newton-Schulz FLOPs of each matrix, once per shard group (each rank orthogonalises 1/N of the dense
matrices its FSDP x TP group splits, and the whole experts it holds), at the cluster's matmul rate; the
exchange, 2 (N - 1) / N of the rank's Muon bytes over the shard group's link (there and back); and the
element-wise passes (62 bytes a parameter, ELEMENTWISE_BYTES; AdamW's fused one is 28).
"""

from __future__ import annotations

import numpy as np

from plait.model.args import ModelArgs
from plait.planner.cost.counts import distinct, layer_params, moe_params, sharded_numel

NS_STEPS = 5
"""torch.optim.Muon's Newton-Schulz iterations (optim.muon_ns_steps' default)."""
TRANSIENT_MATRICES = 6
"""Whole fp32 matrices alive on a rank during the step where matrices are split (its round's stack in and
out, the iteration's copy and two m x m products, the next round's stack arriving); 3 where none is."""
ELEMENTWISE_BYTES = 62
"""Muon's element-wise traffic per parameter, pass by pass as plait.engine.muon and
plait.parallel.orthogonal.newton_schulz make it (fp32 states, bf16 iterations): the buffer's lerp (read it and
the gradient, write it: 12) and Nesterov's (12); the update to bf16 (6), its norm (2) and the division by it
(4); the result back to fp32 (6); the weight decay (8) and the update's addition (12). Counted as one pass (20)
it planned Muon's step well short of a GPU's (docs/measurements.md, "Muon: element-wise passes counted one by
one"; tests/parallel/test_muon.py holds the plan to that card's records)."""


def _ns_flops(m: float, n: float, steps: int) -> float:
    """One m x n matrix: each iteration forms X X^T (2 m^2 n), its polynomial (2 m^3) and the product (2 m^2 n)."""
    lo, hi = min(m, n), max(m, n)
    return steps * (4 * lo * lo * hi + 2 * lo**3)


def block_ns_flops(a: ModelArgs, steps: int = NS_STEPS) -> tuple[float, float]:
    """(dense matrices', experts') Newton-Schulz FLOPs for one average block. A weighted part (a dense MLP in
    a model mixing MoE blocks) counts by its share of the blocks."""
    dense = 0.0
    for rows, cols, how in layer_params(a):
        if how >= 0 and cols >= 1:
            dense += _ns_flops(rows, cols, steps)
    _, experts = moe_params(a)
    share = a.n_moe_layers / a.n_layers
    per_expert = 0.0
    if experts:
        h, fe = a.dim, a.expert_hidden_dim
        per_expert = 3 * _ns_flops(fe, h, steps) * share
    return dense, per_expert * a.moe_experts


def largest_matrix(a: ModelArgs) -> float:
    """Elements of the largest matrix Muon orthogonalises whole (a block's, or one expert's)."""
    sizes = [rows * cols for rows, cols, how in layer_params(a) if how >= 0]
    if a.moe_experts:
        sizes.append(a.expert_hidden_dim * a.dim)
    return max(sizes)


def muon_numel(a: ModelArgs, tp, fsdp_shard, ep):
    """Elements of one average block's Muon matrices each rank holds (plait.engine.muon.takes_muon): the
    attention's and the dense MLP's (TP-split, sharded over fsdp_shard), the shared expert's and the routed
    experts' (sharded as cost.counts.block_numel shards them); not the norms nor the router."""
    (tp, fsdp_shard, ep), inverse = distinct(tp, fsdp_shard, ep)
    matrices = [p for p in layer_params(a) if p[2] >= 0]
    moe_tp = tp if a.moe_experts or a.qk_norm else 1
    share, h = a.n_moe_layers / a.n_layers, a.dim
    shared = a.expert_hidden_dim * a.moe_shared_experts
    whole = [(shared, h * share, -1), (shared, h * share, -1), (h, shared * share, -1)] if shared and share else []
    _, experts = moe_params(a)
    total = (
        sharded_numel(matrices, tp, fsdp_shard)
        + sharded_numel(whole, 1, fsdp_shard * moe_tp)
        + sharded_numel(experts, ep, fsdp_shard * moe_tp // ep)
    )
    return total if inverse is None else np.asarray(total)[inverse]


def state_saving(moment_bytes: int, muon_numel):
    """Bytes Muon's one buffer saves against AdamW's two moments over `muon_numel` parameters."""
    return (2 * moment_bytes - 4) * muon_numel


def transient_bytes(a: ModelArgs, split) -> np.ndarray:
    """The whole matrices alive on a rank while Muon steps (split: whether FSDP or TP splits the matrices)."""
    return np.where(split, TRANSIENT_MATRICES, 3) * 4.0 * largest_matrix(a)


def step_seconds(a: ModelArgs, layers, block_sharded: dict, split_group, rate, link: tuple, bw) -> np.ndarray:
    """Muon's part of the optimizer step on one rank: Newton-Schulz at `rate` FLOP/s, the exchange over `link`
    (bandwidth, latency), the element-wise pass at memory bandwidth `bw`; minus AdamW's pass over the same
    parameters (the caller counts every parameter as AdamW's)."""
    dense_f, experts_f = block_ns_flops(a)
    _, experts = moe_params(a)
    total_experts = sum(r * c for r, c, _ in experts)
    held = block_sharded["experts"] / total_experts if total_experts else 0.0  # the share of experts on this rank
    ns = layers * (dense_f / split_group + experts_f * held) / rate
    bw_link, lat = link
    dense_bytes = 4.0 * layers * block_sharded["dense"]
    exchange = np.where(split_group > 1, 2 * (split_group - 1) / split_group * dense_bytes / bw_link + 2 * lat, 0.0)
    muon_numel = layers * (block_sharded["dense"] + block_sharded["experts"])
    elementwise = (ELEMENTWISE_BYTES - 28) * muon_numel / bw
    return ns + exchange + elementwise
