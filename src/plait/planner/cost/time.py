"""Step time: compute at a GEMM-size-dependent efficiency, tensor/context/expert-parallel and pipeline
communication, FSDP communication not hidden by compute, the pipeline bubble and the optimizer step."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from plait.model.args import ModelArgs
from plait.planner.cluster import Cluster
from plait.planner.cost import muon
from plait.planner.cost.counts import (
    block_numel,
    head_flops_per_token,
    layer_flops_per_token,
    matmul_params,
    train_flops_per_token,
)
from plait.planner.cost.layouts import (
    FULL_AC,
    INTERLEAVED,
    NO_AC,
    NO_PIPELINE,
    ONE_F_ONE_B,
    SELECTIVE_AC,
    Columns,
    Layouts,
    Workload,
)

SELECTIVE_RECOMPUTE = 0.15
"""Selective AC recomputes only element-wise work (norms, rotary, SwiGLU gating): memory-bound, taken as
this fraction of a layer's forward time."""

GEMM_KNEE = 128
"""A GEMM dimension d runs at d / (d + GEMM_KNEE) of the large-GEMM efficiency (skinny GEMMs are slower)."""


def optimizer_bytes_per_param(moment_bytes: int) -> int:
    """AdamW step traffic per parameter. fp32 moments, one fused pass: read the fp32 param, grad and both
    moments, write the param and both moments (28 bytes). bf16 moments (plait.engine.bf16_adamw), chunk by
    chunk: both moments up to fp32 (12), the fused pass over the copies (28), each copy stochastically rounded
    back (add the noise, mask, cast: 2 x 26), 92 bytes in all."""
    return 28 if moment_bytes == 4 else 92


# ---------------------------------------------------------------------------------------------- comm


def spans_nodes(inner, size, per_node):
    """Whether the ranks of one mesh-axis group sit on more than one node. Axes are laid out innermost
    first as tp, dp_shard, dp_replicate, pp (plait.parallel.dims), so a group of `size` ranks, `inner`
    apart, fits in a node iff inner x size <= devices per node."""
    return (size > 1) & (inner * size > per_node)


def link(cluster: Cluster, spans):
    bw = np.where(spans, cluster.inter_bw, cluster.intra_bw)
    lat = np.where(spans, cluster.inter_latency, cluster.intra_latency)
    return bw, lat


def ring_time(nbytes, n, bw, lat, count=1):
    """`count` all-gathers or reduce-scatters moving nbytes in all (full, unsharded sizes) over n ranks:
    ring algorithm, alpha-beta: (n-1)/n x bytes / bandwidth + (n-1) hops x latency per collective."""
    return np.where(n > 1, (n - 1) / n * nbytes / bw + count * (n - 1) * lat, 0.0)


def allreduce_time(nbytes, n, bw, lat, count=1):
    """All-reduce: the ring's bandwidth term 2(n-1)/n x bytes / bandwidth, with a tree's 2 log2(n) hops of
    latency per collective (NCCL switches to trees at scale, where the ring's 2(n-1) hops would dominate)."""
    hops = 2 * np.ceil(np.log2(np.maximum(n, 1)))
    return np.where(n > 1, 2 * (n - 1) / n * nbytes / bw + count * hops * lat, 0.0)


def ring_bytes(a: ModelArgs, e: int, T, tp, cp, full_ac=False) -> tuple[np.ndarray, np.ndarray]:
    """Bytes one rank sends per layer and micro-batch in the ring attention of context parallelism
    (plait.parallel.context), forward and backward: the keys and values (2 T kv / tp elements of e bytes) make
    c - 1 hops forward, and again in backward with their fp32 gradients, which make c hops (the last brings
    them home). Full AC recomputes the forward in backward: its hops once more. Zero at c = 1."""
    cp = np.asarray(cp)
    kv = 2 * T * a.n_kv_heads * a.head_dim / np.asarray(tp)
    fwd = (cp - 1) * kv * e
    bwd = (cp - 1) * kv * e + cp * kv * 4 + np.where(full_ac, fwd, 0)
    return np.where(cp > 1, fwd, 0.0), np.where(cp > 1, bwd, 0.0)


def a2a_bytes(a: ModelArgs, e: int, T, ep) -> np.ndarray:
    """Bytes one rank sends in one all-to-all of expert parallelism (plait.parallel.experts), dispatch or
    combine, for T tokens in an MoE block: the k routed copies of each token, h elements of e bytes, of which
    (ep - 1) / ep leave the rank when routing is balanced (the planner's assumption; bench/comm.py counts
    the real routing). The counts exchanged before them: E int64s, (ep - 1) / ep of them sent."""
    ep = np.asarray(ep)
    return (ep - 1) / ep * (a.moe_top_k * T * a.dim * e + 8 * a.moe_experts)


@dataclass
class Links:
    """Each parallel axis's bandwidth and latency, by whether its groups span nodes (ranks ordered tp, cp,
    dp_shard, dp_replicate, pp from the innermost)."""

    tp_spans: np.ndarray
    tp: tuple
    cp: tuple
    shard: tuple
    rep: tuple
    pp: tuple
    moe: tuple  # MoE FSDP groups and ep groups: consecutive ranks
    ep: tuple

    @classmethod
    def of(cls, cluster: Cluster, c: Columns) -> Links:
        G = cluster.devices_per_node
        tp_spans = spans_nodes(1, c.tp, G)
        return cls(
            tp_spans,
            link(cluster, tp_spans),
            link(cluster, spans_nodes(c.tp, c.cp, G)),
            link(cluster, spans_nodes(c.tp * c.cp, c.shard, G)),
            link(cluster, spans_nodes(c.tp * c.cp * c.shard, c.rep, G)),
            link(cluster, spans_nodes(c.tp * c.cp * c.dp, c.pp, G)),
            link(cluster, spans_nodes(1, c.fsdp_shard * c.whole_tp, G)),
            link(cluster, spans_nodes(1, c.ep, G)),
        )


def rank_time(work: Workload, cluster: Cluster, lay: Layouts, c: Columns, links: Links, rank: dict) -> dict:
    """One pipeline rank's time per micro-batch by part (compute, TP, CP, EP, pipeline sends), with the F / B / W
    shares zero bubble schedules, its exposed FSDP communication per step, and its optimizer step."""
    a, s, e, T, tp = work.model, work.seq_len, work.act_bytes, c.T, c.tp
    layers = rank["layers"]
    local_width = a.dim / tp
    eff = cluster.efficiency * (T / (T + GEMM_KNEE)) * (local_width / (local_width + GEMM_KNEE))
    rate = cluster.peak_flops * eff
    full = lay.ac == FULL_AC
    recompute = np.where(full, 1.0, np.where(lay.ac == SELECTIVE_AC, SELECTIVE_RECOMPUTE, 0.0))
    c_layer = layer_flops_per_token(a, s)
    w_layer = 2 * matmul_params(a)  # weight-gradient FLOPs per token (the rest of backward is input-grad)
    head = head_flops_per_token(a) * (c.single | rank["has_output"])
    # RETRO's encoder and cross-attention (no pipeline: every rank runs them), split by tp as the blocks are
    retro, retro_w = a.retrieval_flops_per_token(), a.retrieval_flops_per_token(weights_only=True)
    fwd = T * (layers * c_layer + head + retro) / tp
    wgt = T * (layers * w_layer + head + retro_w) / tp
    bwd_in = 2 * fwd - wgt + recompute * T * layers * c_layer / tp
    compute = (fwd + bwd_in + wgt) / rate
    tp_time = _tp_time(a, e, T, tp, links, layers, lay.ac)
    pp_bw, pp_lat = links.pp
    p2p = np.where(c.pp > 1, 2 * c.v * (T * a.dim * e / tp / pp_bw + pp_lat), 0.0)  # each TP rank: its shard
    cp_time = _cp_time(a, e, T, s, c, links, layers, rate, full)
    ep_time = np.zeros(np.shape(compute))
    if a.n_moe_layers:
        ep_time = _ep_time(a, e, T, c, links, layers, full)
    t_mb = compute + tp_time + p2p + cp_time + ep_time
    # F / B / W shares of a micro-batch (communication spread pro rata) for the zero-bubble schedule.
    total_flops = fwd + bwd_in + wgt
    f_t, b_t, w_t = (t_mb * x / total_flops for x in (fwd, bwd_in, wgt))
    fsdp_exposed, gathers = _fsdp_exposed(work, lay, c, links, rank, f_t, b_t + w_t)
    return dict(
        sharded=rank["sharded"] * np.ones(np.shape(compute)),
        compute=compute,
        tp=tp_time,
        cp=cp_time,
        ep=ep_time,
        p2p=p2p,
        t_mb=t_mb,
        zb=np.maximum(f_t + b_t - w_t, 0),
        fsdp=np.where(c.fsdp, fsdp_exposed, 0.0),
        optimizer=_optimizer_time(cluster, lay, rank["sharded"], gathers, optimizer_bytes_per_param(work.moment_bytes))
        + (_muon_time(work, cluster, c, links, layers) if work.muon else 0.0),
    )


def _muon_time(work: Workload, cluster: Cluster, c: Columns, links: Links, layers):
    """Muon's Newton-Schulz, its exchange and its element-wise pass beside AdamW's (cost.muon), on the device
    (never offloaded: rules.optimizer_problem)."""
    block_s = block_numel(work.model, c.tp, c.fsdp_shard, c.ep)[0]
    split = np.where(c.fsdp, c.fsdp_shard, 1) * c.tp
    rate = cluster.peak_flops * cluster.efficiency
    return muon.step_seconds(work.model, layers, block_s, split, rate, links.shard, cluster.hbm_bw)


def _tp_time(a: ModelArgs, e: int, T, tp, links: Links, layers, ac):
    """Tensor and sequence parallel communication per micro-batch: per block and pass an all-gather and a
    reduce-scatter of (T, dim) for each of its halves (an MoE block: the attention's only), and the all-gathers
    a recomputed block repeats. RETRO under TP: the encoder's blocks as the decoder's, over 2k neighbour tokens
    per token, its output gathered; per cross-attending block a gather and a reduce-scatter each way; the
    embedding all-reduced."""
    extra_collectives = np.where(ac > NO_AC, 3, 0)  # recomputing a block repeats its SP all-gathers
    moe_share = a.n_moe_layers / a.n_layers
    sp_share = 1 - moe_share / 2  # an MoE block has the attention's SP collectives only
    tp_bw, tp_lat = links.tp
    coll = ring_time(T * a.dim * e, tp, tp_bw, tp_lat)  # one SP all-gather or reduce-scatter
    tp_time = layers * sp_share * (8 + extra_collectives) * coll
    if a.retrieval_ids:
        n = 2 * a.retrieval_k
        enc = a.retrieval_encoder_layers * 8 * ring_time(n * T * a.dim * e, tp, tp_bw, tp_lat) + ring_time(
            n * T * a.dim * e, tp, tp_bw, tp_lat
        )
        tp_time = tp_time + enc + len(a.retrieval_ids) * (4 + extra_collectives) * coll
        tp_time = tp_time + 2 * ring_time((1 + n) * T * a.dim * e, tp, tp_bw, tp_lat)
    return tp_time


def _cp_time(a: ModelArgs, e: int, T, s: int, c: Columns, links: Links, layers, rate, full):
    """Ring attention, per layer: each of the c - 1 hops travels while one block computes (1/c of this rank's
    attention, whose forward is 4 h s FLOPs per token, backward twice that), so only what a hop takes beyond
    its block is exposed; in backward the gradients of the previous step's keys travel alongside, and their
    last hop home is exposed whole. Full AC runs the forward ring twice."""
    tp, cp = c.tp, c.cp
    cp_bw, cp_lat = links.cp
    kv_local = a.n_kv_heads * a.head_dim / tp
    kv_hop, grad_hop = 2 * T * kv_local * e / cp_bw + cp_lat, 2 * T * kv_local * 4 / cp_bw + cp_lat
    block = 4 * a.dim * s * T / tp / rate / cp
    ring_fwd = (cp - 1) * np.maximum(kv_hop - block, 0)
    ring_bwd = (cp - 1) * np.maximum(kv_hop + grad_hop - 2 * block, 0) + grad_hop
    return np.where(cp > 1, layers * (ring_fwd * np.where(full, 2, 1) + ring_bwd), 0.0)


def _ep_time(a: ModelArgs, e: int, T, c: Columns, links: Links, layers, full):
    """Expert parallelism, per MoE block and pass: the routed copies (k per token) go to their experts and
    back, (ep - 1) / ep of them to other ranks, plus an exchange of the counts; backward the same for the
    gradients; full AC dispatches the forward again. On the critical path: nothing hides it."""
    moe_share = a.n_moe_layers / a.n_layers
    ep_bw, ep_lat = links.ep
    a2a = 2 * (a2a_bytes(a, e, T / c.moe_tp, c.ep) / ep_bw + 2 * ep_lat)
    return np.where(c.ep > 1, layers * moe_share * a2a * (2 + full), 0.0)


def _fsdp_exposed(work: Workload, lay: Layouts, c: Columns, links: Links, rank: dict, f_t, bwd_t) -> tuple:
    """(FSDP communication not hidden by compute per step, the all-gathers of each parameter per step).

    Forward all-gathers hide behind the forward of their micro-batch, backward ones (after
    reshard-after-forward) and the gradient reduce-scatter (+ the HSDP all-reduce across replicas, on the last
    micro-batch only: accumulation skips the sync) behind its backward. The first group's gather and the last
    group's reduction cannot overlap anything. Each FSDP group over its own ranks: dense parts over
    fsdp_shard, MoE router and shared expert over fsdp_shard x tp, experts over fsdp_shard x tp / ep
    (plait.parallel.fsdp._shard_moe)."""
    e, layers, mf = work.act_bytes, rank["layers"], c.m.astype(np.float64)
    block_u = block_numel(work.model, c.tp, c.fsdp_shard, c.ep)[1]
    groups = layers + 1
    ag, rs, ar = 0.0, 0.0, 0.0
    (sh_bw, sh_lat), (mo_bw, mo_lat), (rp_bw, rp_lat) = links.shard, links.moe, links.rep
    for numel, n, bw, lat in (
        (layers * block_u["dense"] + rank["root_unsharded"], c.fsdp_shard, sh_bw, sh_lat),
        (layers * block_u["moe"], c.fsdp_shard * c.whole_tp, mo_bw, mo_lat),
        (layers * block_u["experts"], c.fsdp_shard * c.whole_tp // c.ep, mo_bw, mo_lat),
    ):
        if not np.any(numel):  # no such group anywhere (a dense model's MoE groups): no collective, no latency
            continue
        count = np.where(numel > 0, groups, 0)  # a group without parameters runs no collective
        ag = ag + ring_time(e * numel, n, bw, lat, count)
        rs = rs + ring_time(4.0 * numel, n, bw, lat, count)
        ar = ar + allreduce_time(4.0 * numel / n, c.rep, rp_bw, rp_lat, count)
    bwd_ag = np.where(lay.reshard & c.single, ag, 0.0)
    fwd_gathers = np.where(c.single, mf, 1.0)  # a pipeline keeps weights gathered after the first
    # With fsdp_reduce_every_micro_batch every micro-batch's backward also reduces (and its last group's
    # reduction is exposed each time).
    early = np.where(lay.sync_each, bwd_ag + rs + ar, bwd_ag)
    exposed = (
        fwd_gathers * np.maximum(ag - f_t, 0)
        + np.maximum(mf - 1, 0) * (np.maximum(early - bwd_t, 0) + lay.sync_each * (rs + ar) / groups)
        + np.maximum(bwd_ag + rs + ar - bwd_t, 0)
        + (ag + rs + ar) / groups
    )
    return exposed, fwd_gathers + np.where(c.single, mf * lay.reshard + lay.sync_each * np.maximum(mf - 1, 0), 0)


def _optimizer_time(cluster: Cluster, lay: Layouts, sharded, gathers, per_param: int):
    """The optimizer step: bound by device memory bandwidth, or with CPU offload by the host's, plus moving the
    shards over PCIe for each FSDP gather (and the gradients back)."""
    return np.where(
        lay.offload,
        per_param * sharded * cluster.devices_per_node / cluster.host_bw
        + (gathers + 1) * 4.0 * sharded / cluster.pcie_bw,
        per_param * sharded / cluster.hbm_bw,
    )


def replica_time(work: Workload, cluster: Cluster, sharded):
    """Fault-tolerant groups' averaging per step (plait.engine.replicas): each rank all-reduces its fp32
    gradient shard (`sharded` parameters) with its peers of the other groups, over the nodes' network, after
    backward (not hidden by compute); DiLoCo does it once per `sync_every` steps, so its share per step is that
    much smaller. The contribution check's few floats per group are left out."""
    n = work.replica_groups
    if n <= 1:
        return np.zeros(np.shape(sharded))
    bw, lat = cluster.inter_bw, cluster.inter_latency
    return allreduce_time(4.0 * sharded, n, bw, lat) / max(work.sync_every, 1)


def step_time(work: Workload, cluster: Cluster, lay: Layouts, c: Columns, per_rank: dict) -> dict:
    """The step: the slower pipeline rank's micro-batches, the schedule's bubble, exposed FSDP communication
    and the optimizer; tokens/s and MFU from it."""
    mf = c.m.astype(np.float64)
    slow = per_rank["first"]["t_mb"] >= per_rank["last"]["t_mb"]
    pick = {k: np.where(slow, per_rank["first"][k], per_rank["last"][k]) for k in per_rank["first"]}
    t_mb, pp, v = pick["t_mb"], c.pp, c.v
    bubble = np.select(
        [lay.schedule == NO_PIPELINE, lay.schedule <= ONE_F_ONE_B, lay.schedule == INTERLEAVED],
        [0.0, (pp - 1) * t_mb, (pp - 1) / v * t_mb],
        (pp - 1) * pick["zb"] / v,  # zero bubble: what of F + B the W passes do not fill
    )
    fsdp_time = np.maximum(per_rank["first"]["fsdp"], per_rank["last"]["fsdp"])
    opt_time = np.maximum(per_rank["first"]["optimizer"], per_rank["last"]["optimizer"])
    sharded = np.maximum(per_rank["first"]["sharded"], per_rank["last"]["sharded"])
    replicas_time = replica_time(work, cluster, sharded)
    step = mf * t_mb + bubble + fsdp_time + opt_time + replicas_time
    world = c.dp * c.cp * c.tp * pp
    tokens = work.tokens
    return dict(
        t_compute=mf * pick["compute"],
        t_tp=mf * pick["tp"],
        t_cp=mf * pick["cp"],
        t_ep=mf * pick["ep"],
        t_p2p=mf * pick["p2p"],
        t_bubble=bubble,
        t_fsdp=fsdp_time,
        t_optimizer=opt_time,
        t_replicas=replicas_time,
        step_time=step,
        tokens_per_s=tokens / step,
        mfu=train_flops_per_token(work.model, work.seq_len) * tokens / (step * world * cluster.peak_flops),
    )
