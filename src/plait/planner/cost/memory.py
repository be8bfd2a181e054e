"""Memory per rank: model states, gathered parameters, gradient buffers, activations kept for backward (per
activation-checkpointing mode, through the pipeline schedule's in-flight micro-batches), transient memory and
the allocator's slack. The bytes per token come from plait.planner.cost.activations, the schedule's moments
from plait.planner.cost.pipeline; this module adds up a rank's peak (rank_memory)."""

from __future__ import annotations

from typing import overload

import numpy as np

from plait.model.args import ModelArgs
from plait.planner.cluster import GiB
from plait.planner.cost import muon
from plait.planner.cost.activations import (
    EMBED_ACTIVATION_BYTES,
    head_activation_bytes,
    head_transient_bytes,
    layer_activation_bytes,
    retrieval_activation_bytes,
)
from plait.planner.cost.counts import (
    block_numel,
    distinct,
    embed_params,
    encoder_params,
    head_params,
    local_numel,
    retrieval_snapshot_bytes,
    sharded_numel,
)
from plait.planner.cost.layouts import (
    FULL_AC,
    GPIPE,
    NO_AC,
    ONE_F_ONE_B,
    ZERO_BUBBLE,
    Columns,
    Layouts,
    Workload,
)
from plait.planner.cost.pipeline import (
    ZERO_BUBBLE_LAST_MARGIN,
    peak_activations,
    split_stages,
    zero_bubble_residue,
)

ALLOCATOR_OVERHEAD = 0.10
"""Caching-allocator slack (fragmentation, rounding to blocks) as a fraction of the dynamic memory."""

RESERVED_GIB = 2.0
"""Per-device memory the model never sees: CUDA context, NCCL channels and cuBLAS workspaces."""

MEMORY_FRACTION = 0.95
"""The share of a device's memory a job may be predicted to use: the one rule of `plait plan` (which layouts
fit) and of the launch's preflight (above it: a warning; a remedy must bring a run under it). The prediction
already holds the allocator's slack (ALLOCATOR_OVERHEAD) and the CUDA context (RESERVED_GIB); the 5% left is
the model's own error (within 5% of measured activations). Meta's Llama 3 405B layout is predicted at 94.9% of
an H100: it fits, as it ran. (`plait fit` measures a rank's real peak and compares it with the whole device.)"""

HOST_MEMORY_FRACTION = 0.9
"""The share of a node's host memory the CPU-offloaded ranks may take, their resident memory with their states
(host_resident; the OS, the data loaders and the page cache keep the rest)."""

OFFLOAD_HOST_OVERHEAD = 0.15
"""What a CPU-offloaded rank's process holds in host memory beyond its states, as a share of them (pinned
staging, CUDA's host side, the interpreter and libraries). Measured with `plait fit` on one H200 (torch 2.11):
llama3-8b at 16 blocks, fp32 moments, RSS 76.1 GiB over 67.7 of states (+12.4%); the whole llama3-8b with
bf16 moments, RSS 101.9 GiB over 89.75 (+13.5%)."""


@overload
def host_resident(offloaded_states: float) -> float: ...
@overload
def host_resident(offloaded_states: np.ndarray) -> np.ndarray: ...
def host_resident(offloaded_states: float | np.ndarray) -> float | np.ndarray:
    """Host bytes a CPU-offloaded rank's process is predicted to hold: its states and OFFLOAD_HOST_OVERHEAD."""
    return offloaded_states * (1 + OFFLOAD_HOST_OVERHEAD)


def rank_memory(work: Workload, lay: Layouts, c: Columns, name: str) -> dict[str, np.ndarray]:
    """The first pipeline rank's (it holds the embedding) or the last's (the output projection) memory, by part."""
    a, e, fused = work.model, work.act_bytes, work.fused_head
    tp, pp, v, T = c.tp, c.pp, c.v, c.T
    is_first = name == "first"
    split = split_stages(a, work.seq_len, pp, v)
    layers, edge = (split[0], split[2]) if is_first else (split[1], split[3])
    block_s, block_u = block_numel(a, tp, c.fsdp_shard, c.ep)
    layer_s, layer_u = sum(block_s.values()), sum(block_u.values())
    (root_s, root_u), emb_u, head_u, enc_u = _root_numels(a, c, is_first)
    has_head, has_embed = c.single | (not is_first), c.single | is_first
    sharded = layers * layer_s + root_s
    unsharded = layers * layer_u + root_u
    full, no_grads = 8.0 + 2 * work.moment_bytes, 4.0 + 2 * work.moment_bytes  # fp32 param (+ grad) + 2 moments
    muon_s = muon.muon_numel(a, tp, c.fsdp_shard, c.ep) if work.muon else 0.0
    saving = muon.state_saving(work.moment_bytes, layers * muon_s)  # one buffer, not two
    states = np.where(lay.offload, 0.0, full * sharded - saving)
    params_f, params_b = _gathered_bytes(a, c, e, unsharded, (layer_u, emb_u, head_u, enc_u), fused)
    piped = pp > 1
    accumulated, grads_buf = _gradient_buffers(c, e, unsharded, layer_u, np.where(has_head, head_u, emb_u), piped)
    tp_buf = np.where(tp > 1, 2 * T * a.dim * e, 0.0)
    hand_off = T * a.dim * e / tp  # sequence shards under TP
    pp_buf = _receive_buffers(lay, pp, v, is_first, hand_off)
    stage_grads = _pipeline_grads(c, lay, e, (layer_s, layer_u), (root_s, root_u), head_u, emb_u)
    at = _activations(work, lay, c, (layers, edge), rank_last=not is_first, hand_off=hand_off, stage_grads=stage_grads)
    ids = np.where(has_embed, c.m * T * EMBED_ACTIVATION_BYTES, 0)  # the token ids of all micro-batches
    acts_f, acts_b = at["acts_f"] + ids, at["acts_b"] + ids
    transient_f, transient_b = _transient(work, lay, c, has_head)
    # The peak (the allocator's high-water mark, measured by `plait fit`): the larger of two moments with every
    # activation alive, the end of the last micro-batch's forward (the head's) and the start of its backward,
    # each with what it gathers and works in; or the optimizer's step, with all the states. The states at the
    # first two hold no gradients (zero_grad frees them: the step's are made in backward and freed after the
    # optimizer) unless they outlive a micro-batch: reduced after each one, or without FSDP. In a pipeline,
    # those of the stages whose backward has begun by the schedule's peak (_activations).
    kept_grads = (c.m > 1) & (lay.sync_each | ~c.fsdp) & ~piped
    states_at_peak = np.where(lay.offload, 0.0, np.where(kept_grads, full, no_grads) * sharded - saving)
    at_forward_end = params_f + accumulated + transient_f + acts_f + at["grads_f"]
    dynamic = np.maximum(at_forward_end, params_b + grads_buf + transient_b + acts_b + at["grads_b"]) + tp_buf + pp_buf
    stepping = muon.transient_bytes(a, c.fsdp | (tp > 1)) if work.muon else 0.0  # the matrices orthogonalised
    snapshots = np.where(has_head, retrieval_snapshot_bytes(a), 0.0)  # model buffers, held all the time
    peak = np.maximum(states_at_peak + dynamic, states + np.where(lay.offload, 0.0, stepping)) + snapshots
    acts = np.maximum(acts_f, acts_b)
    buffers = np.maximum(params_f, params_b) + grads_buf + tp_buf + pp_buf + snapshots  # (a pipeline's grads: states)
    return dict(
        states=states,
        buffers=buffers,
        activations=acts,
        transient=np.maximum(transient_f, transient_b),
        peak=peak,
        allocator=dynamic * ALLOCATOR_OVERHEAD + RESERVED_GIB * GiB,
        total=peak + dynamic * ALLOCATOR_OVERHEAD + RESERVED_GIB * GiB,
        host=np.where(lay.offload, full * sharded - saving, 0.0),
        host_at_peak=np.where(lay.offload, np.where(kept_grads | piped, full, no_grads) * sharded - saving, 0.0),
        sharded=sharded,
        unsharded=unsharded,
        layers=layers,
        root_unsharded=root_u,
        has_output=not is_first,  # the last rank holds the output projection (without a pipeline, both do)
    )


def _gathered_bytes(a: ModelArgs, c: Columns, e: int, unsharded, numels, fused: bool):
    """Bytes of the parameters a rank holds gathered at the end of forward and at the start of backward:
    (forward, backward). With FSDP: all of them when held (a pipeline, or no resharding after forward), else
    what those two moments hold (_resharding_gathered). Without FSDP, bf16 autocast makes a bf16 copy of every
    fp32 weight it multiplies, held to backward (autocast's cache; MoE experts cast theirs for grouped_mm,
    which saves them). numels: the unsharded elements of a layer, the embedding, the head, RETRO's encoder."""
    layer_u, emb_u, head_u, enc_u = numels
    gathered_f, gathered_b = (
        np.where(c.held, unsharded, g + enc_u) for g in _resharding_gathered(a, c.tp, layer_u, emb_u, head_u, fused)
    )
    casts = np.where(e < 4, e * unsharded, 0.0)
    params_f, params_b = (np.where(c.fsdp, e * g, casts) for g in (gathered_f, gathered_b))
    return params_f, params_b


def _gradient_buffers(c: Columns, e: int, unsharded, layer_u, edge_u, piped):
    """(the fp32 gradients FSDP accumulates unsharded between micro-batches, the gradient buffers at the peak)
    without a pipeline (in one, per stage: _pipeline_grads): the accumulated ones, else the unsharded ones at
    the start of backward, before their reduce-scatter: two blocks' and the output projection's (edge_u: the
    embedding's on the first rank, which come at the end of backward, when the activations are gone)."""
    accumulated = np.where(c.fsdp & c.accumulate & ~piped, 4.0 * unsharded, 0.0)
    fresh = e * (2 * layer_u + edge_u)
    grads_buf = np.where(c.fsdp & ~piped, np.where(c.accumulate, accumulated, fresh), 0.0)
    return accumulated, grads_buf


def _receive_buffers(lay: Layouts, pp, v, is_first: bool, hand_off):
    """Pipeline receive buffers, which live only while their micro-batch does (plait.core.torch_private.
    bounded_receive_stage): a received activation is the stage's input, saved by its first block (an
    activation: _activations); what is not saved is one buffer per direction the rank receives in (activations
    into every stage but the first, gradients into every stage but the last: 2 v - 1 of the rank's v stages),
    and with GPipe / 1F1B a second gradient buffer, the previous one, which the schedule holds until it posts
    the next receive. hand_off: the bytes of one (a sequence shard under TP)."""
    single_stage = (lay.schedule == GPIPE) | (lay.schedule == ONE_F_ONE_B)
    return np.where(pp > 1, (2 * v - 1 + (single_stage & is_first)) * hand_off, 0.0)


def _root_numels(a: ModelArgs, c: Columns, is_first: bool):
    """((sharded, unsharded) elements of the root unit, unsharded ones of the embedding, the head and RETRO's
    neighbour encoder). The root: the rank's embedding or head (both without a pipeline), and the encoder (no
    pipeline: refused), with the embedding it reads from."""
    (tp, shard), inverse = distinct(c.tp, c.fsdp_shard)  # computed per distinct degrees, then spread

    def spread(x):
        return np.asarray(x)[inverse] if inverse is not None and np.ndim(x) else x

    (emb_s, emb_u), (head_s, head_u), (enc_s, enc_u) = (
        (spread(sharded_numel(params, tp, shard)), spread(local_numel(params, tp)))
        for params in (embed_params(a), head_params(a), encoder_params(a))
    )
    near, far = ((emb_s, emb_u), (head_s, head_u)) if is_first else ((head_s, head_u), (emb_s, emb_u))
    root = tuple(near[i] + np.where(c.single, far[i], 0) + (enc_s, enc_u)[i] for i in (0, 1))
    return root, emb_u, head_u, enc_u


def _pipeline_grads(c: Columns, lay: Layouts, e: int, layer, root, head_u, emb_u) -> dict[str, np.ndarray]:
    """A pipeline stage's gradients (fp32), which exist from its first backward on: unsharded while FSDP
    accumulates them (no-sync: on the device, offload or not), else sharded (with offload in host memory);
    per layer ('layer') and of the stage's embedding or head ('root'). Fresh ones: at a backward's start,
    where FSDP reduces after each micro-batch, the unsharded gradients of two blocks ('start') and of the
    output projection ('start_head') before their reduction; at the end of a later backward the embedding's
    ('end_embed'), made whole and then added to the kept one. layer, root: (sharded, unsharded) numels."""
    grad_of = np.where(lay.offload, 0.0, 4.0)
    unsharded_grads, reduced_each = c.fsdp & ~lay.sync_each, c.fsdp & lay.sync_each
    return dict(
        layer=np.where(unsharded_grads, 4.0 * layer[1], grad_of * layer[0]),
        root=np.where(unsharded_grads, 4.0 * root[1], grad_of * root[0]),
        start=np.where(reduced_each, e * 2 * layer[1], 0.0),
        start_head=np.where(reduced_each, e * head_u, 0.0),
        end_embed=np.where(c.fsdp, e, grad_of) * emb_u,
    )


def _resharding_gathered(a: ModelArgs, tp, layer_u, emb_u, head_u, fused: bool):
    """Gathered parameters where blocks reshard after forward (no pipeline), at the end of forward and at the
    start of backward: (forward, backward). Forward, at the fused head's peak: the output projection with the
    last block (the output is freed before backward); backward: the current and the prefetched block. Untied,
    the embedding is a unit of its own gathered for its forward only
    (plait.parallel.fsdp._shard_embedding_and_head); tied, it stays gathered with the root."""
    if a.tie_embeddings:
        both = 2 * layer_u + emb_u + head_u
        return both, both
    out_u = local_numel([(a.vocab_size, a.dim, 0)], tp)
    # At the head's peak: the last block (kept gathered for backward: plait.parallel.fsdp.apply_fsdp),
    # FSDP2's buffer of its latest all-gather (held until the next one), and the output (measured by plait fit).
    if fused:
        return 2 * layer_u + out_u + a.dim, 2 * layer_u + a.dim
    return 2 * layer_u + out_u + a.dim, 2 * layer_u + out_u + a.dim


def _activations(work: Workload, lay: Layouts, c: Columns, layers, *, rank_last: bool, hand_off, stage_grads):
    """Activations kept for backward at the rank's peaks, at the end of a forward and in a backward
    (peak_activations' keys): one micro-batch without a pipeline, else the schedule's peak over the
    micro-batches each of this rank's v stages holds; and the gradients that exist then in a pipeline (0
    without one). layers: (the rank's, those of its edge stage: the model's first or last); stage_grads:
    gradient bytes, kept (per layer, of the rank's embedding or head) and fresh (see rank_memory)."""
    a, e, fused, T, v = work.model, work.act_bytes, work.fused_head, c.T, c.v
    layers, edge = layers
    per_layer = layer_activation_bytes(a, e, c.tp, lay.ac, c.cp, c.ep) * T
    # The rank's stages but its edge one split the rest of its layers evenly (split_layers balances them)
    others = np.where(v > 1, (layers - edge) / np.maximum(v - 1, 1), edge)
    # One micro-batch of one of this rank's v stages: its layers, its input (received, except on the first
    # stage), and its output until the backward: the stage that sends keeps it, the final stage keeps its
    # logits (the schedule's stage output) and the loss's activations. The last stage's output: the logits
    # (B, T, V / tp); with the fused head the micro-batch's loss, and the output weight's gradient it computed
    # in forward (in the gathered weight's dtype), kept per micro-batch in flight until that micro-batch's
    # backward.
    head_grad = a.vocab_size / c.tp * a.dim * np.where(c.fsdp, e, 4)
    head = head_activation_bytes(a, e, c.tp, fused) * T + (head_grad if fused else T * a.vocab_size / c.tp * e)

    grads = {k: np.broadcast_to(x, c.pp.shape) for k, x in stage_grads.items()}
    tps = np.broadcast_to(c.tp, c.pp.shape)

    def stage_units(idx) -> np.ndarray:
        """(5, 2, layouts): stage_bytes' five units of the rank's edge stage and of each of its other local
        stages (peak_activations), for the layouts idx."""
        g = {k: x[idx] for k, x in grads.items()}
        n, n_edge, tp, t, received = others[idx], edge[idx], tps[idx], T[idx], hand_off[idx]
        full = lay.ac[idx] == FULL_AC  # full AC: the zero-bubble residue is recomputed, not kept
        zero = np.zeros(len(idx))

        def residue(n_layers, has_head):  # zero bubble: a stage that received its input keeps it as long
            return np.where(full, 0, zero_bubble_residue(a, e, tp, n_layers, has_head, fused) * t + received)

        # (the layers' bytes already count the stage input, which the first block's norm saves)
        other = [n * per_layer[idx] + received, residue(n, False), n * g["layer"], g["start"], zero]
        if rank_last:  # its edge stage is the model's last: the head's
            edge_units = [n_edge * per_layer[idx] + head[idx], residue(n_edge, True), n_edge * g["layer"] + g["root"],
                          g["start"] + g["start_head"], zero]  # fmt: skip
        else:  # its edge stage is the model's first: the embedding's, with no input received
            edge_units = [n_edge * per_layer[idx] + received, zero, n_edge * g["layer"] + g["root"], g["start"],
                          g["end_embed"]]  # fmt: skip
        return np.stack([np.stack(edge_units), np.stack(other)], axis=1)

    piped = peak_activations(lay.schedule, c.pp, v, c.m, rank_last, stage_units)
    single = (
        layers * per_layer
        + (head_activation_bytes(a, e, c.tp, fused) + retrieval_activation_bytes(a, e, c.tp, lay.ac)) * T
    )  # (one rank: all, and the head)
    out = {k: np.where(c.single, single if k.startswith("acts") else 0.0, x) for k, x in piped.items()}
    if rank_last:
        for k in ("acts_f", "acts_b"):
            out[k] = np.where(lay.schedule == ZERO_BUBBLE, out[k] * ZERO_BUBBLE_LAST_MARGIN, out[k])
    return out


def _transient(work: Workload, lay: Layouts, c: Columns, has_head):
    """Memory that lives only inside one block's (or the head's) work: (at the end of forward, at the start of
    backward). The fused head does all its work in forward (plait.model.head); the plain head's logits, their
    fp32 copy and their gradient are counted at both moments."""
    a, e, T = work.model, work.act_bytes, c.T
    a_none = layer_activation_bytes(a, e, c.tp, NO_AC, c.cp, c.ep)
    kv_local = a.n_kv_heads * a.head_dim / c.tp  # the keys (and values) one rank's attention holds per token
    head = np.where(has_head, head_transient_bytes(a, e, c.tp, T, work.fused_head, work.device), 0.0)
    if work.fused_head:  # in a pipeline the micro-batch's weight gradient is counted with its activations
        head = head - np.where(has_head & (c.pp > 1), 4 * a.vocab_size / c.tp * a.dim, 0.0)
    recompute = np.where(lay.ac > NO_AC, a_none * T, 0.0)  # one block recomputed during its backward
    # the ring's buffers in backward: k and v held and arriving, their fp32 gradients held and arriving
    ring = np.where(c.cp > 1, T * kv_local * 2 * (2 * e + 2 * 4), 0.0)
    # expert parallelism: one MoE block's tokens on the move (received, regrouped, results going back)
    experts = np.where(c.ep > 1, 3 * a.moe_top_k * T / c.moe_tp * a.dim * e, 0.0)
    # At the end of forward (the head's work) no block is working: no recompute, ring or exchange then.
    forward = head
    backward = (0.0 if work.fused_head else head) + recompute + ring + experts
    return forward, backward
