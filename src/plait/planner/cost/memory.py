"""Memory per rank: model states, gathered parameters, gradient buffers, activations kept for backward (per
activation-checkpointing mode, through the pipeline schedule's in-flight micro-batches), transient memory and
the allocator's slack."""

from __future__ import annotations

import functools
from typing import overload

import numpy as np

from plait.model.args import LOGITS_PER_CHUNK, ModelArgs, recompute_units_pay, split_layers
from plait.planner.cluster import GiB
from plait.planner.cost.counts import (
    block_numel,
    distinct,
    embed_params,
    encoder_params,
    head_params,
    local_numel,
    sharded_numel,
)
from plait.planner.cost.layouts import (
    FULL_AC,
    GPIPE,
    NO_AC,
    ONE_F_ONE_B,
    SCHEDULES,
    ZERO_BUBBLE,
    Columns,
    Layouts,
    Workload,
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


# ---------------------------------------------------------------------------------------------- activations


def _norm_bytes(e: int) -> int:
    """Bytes per element an RMSNorm keeps for backward: its input as it came (plait.model.norm.RMSNormFunction
    recomputes the fp32 normalised value in backward; the inverse RMS, 4 bytes a row, is counted apart)."""
    return e


def layer_activation_bytes(a: ModelArgs, e: int, tp, ac, cp=1, ep=1) -> np.ndarray:
    """Bytes kept for backward per token per block (measured on the real model: tests/test_planner.py).

    none: two norms, each (norm_bytes h + 4 for rsqrt) + its output h e (the input of the next matmul);
        q, k, v (k and v after the GQA repeat) and the attention output, each Q = H x head_dim wide (h, but
        for a head width of its own: Qwen3's 4096 beside h = 2048), Q e each; logsumexp 4 H; with per-head
        q/k norms (qk_norm), their inputs, (Q + KV) e, and inverse RMS, 4 (H + H_kv); SwiGLU keeps w1 x,
        silu(w1 x), w3 x and their product: 4 F e. Under sequence parallel every term is split over tp except
        the two matmul inputs, which are all-gathered (2 h e).
    full: the block input only, sequence-sharded: h e / tp.
    selective (plait's policy: keep matmul and attention outputs), as one region per block: the input,
        q/k/v, attention output and logsumexp, w1 and w3 outputs, each split over tp, and the row-parallel
        outputs of wo and w2, which are full-size partial sums before their reduce-scatter (2 h e); as two
        units per block (model.args.recompute_units_pay: under TP) the same but for those two partial sums,
        for which each unit's input (the residual stream, h e) and w2's input (F e) are kept, split over tp.
    Context parallel (cp > 1), none: the ring attention keeps k and v as they travel, n_kv_heads wide (the
        GQA repeat happens inside it), 2 kv e instead of 2 h e; the other modes keep what they keep at cp = 1.
    Mixtures of experts (`moe_mlp_bytes`): the MLP terms of the average block (dense and MoE blocks weighted
        by their share); the attention terms as above. Under TP an MoE block runs on its sequence shard: its
        terms split over tp, and only the attention's input is gathered. Expert parallelism moves tokens to
        their experts and back; with balanced routing each rank keeps what it would without it, and under
        selective AC also both all-to-alls' outputs (kept so that the recompute does not send them again).
    """
    h, f, heads = a.dim, a.hidden_dim, a.n_heads
    q, kv = heads * a.head_dim, a.n_kv_heads * a.head_dim
    nb = _norm_bytes(e)
    attention = np.where(np.asarray(cp) > 1, 2 * e * q + 2 * e * kv, 4 * e * q)  # q, k, v and the output
    if a.qk_norm:  # the per-head norms' inputs and inverse RMS
        attention = attention + nb * (q + kv) + 4 * (heads + a.n_kv_heads)
    moe = a.n_moe_layers / a.n_layers
    mlp_none, mlp_kept = moe_mlp_bytes(a, e)
    common = 2 * nb * h + attention + 4 * heads + 8
    # Under TP a dense block gathers both norms' outputs (2 h e, whole); an MoE block only the attention's:
    # it runs on its sequence shard (its norm's output h e / tp).
    none_dense = (common + 4 * e * f) / tp + 2 * e * h
    none_moe = (common + mlp_none + e * h) / tp + e * h
    full = e * h / tp
    kept = e * h + e * (q + 2 * kv) + e * q + 4 * heads  # input, q/k/v, attention: the attention half's
    kept_dense = kept + 2 * e * f  # + the w1 and w3 outputs
    selective_dense = np.where(
        recompute_units_pay(h, f, tp), (kept_dense + e * h + e * f) / tp, kept_dense / tp + 2 * e * h
    )
    selective_moe = (kept + mlp_kept + e * h) / tp + e * h  # one region; wo's partial sum whole under TP
    selective_moe = selective_moe + np.where(np.asarray(ep) > 1, 2 * a.moe_top_k * h * e / tp, 0)
    none = (1 - moe) * none_dense + moe * none_moe
    selective = (1 - moe) * selective_dense + moe * selective_moe
    ac = np.asarray(ac)
    return np.where(ac == 0, none, np.where(ac == 1, selective, full))


def retrieval_activation_bytes(a: ModelArgs, e: int, tp, ac) -> np.ndarray:
    """RETRO's bytes kept for backward per token of the sequence (0 without retrieval; measured on the real
    model: tests/test_plan_vs_runtime.py). Each token brings n = 2k neighbour tokens (k neighbours of 2c per
    chunk of c), kept whatever the activation checkpointing, which covers the decoder's blocks only: their int64
    ids, the encoder's blocks over them (sequence-parallel under TP, as the decoder's, without checkpointing),
    its final norm, and its output, whole on every tp rank (every cross-attending block's key and value
    projections take it). Per cross-attending block, without AC or outside selective recompute's units (under
    TP: they cover attention and MLP, the cross-attention runs between them): its norm's input, its output
    gathered and shifted by c - 1 (h e, whole), the queries, the keys and values of n tokens after the GQA
    repeat, the attention's output and its copy into the output projection (each Q e / tp), logsumexp; as one
    selective region (tp = 1): the projections' outputs (keys and values before the repeat), the attention's
    and the output projection's partial sum (h e); full AC: nothing (the block's input and the encoder's output
    are counted already)."""
    if not a.retrieval_ids:
        return np.zeros_like(np.asarray(tp, dtype=np.float64))
    h, heads, n = a.dim, a.n_heads, 2 * a.retrieval_k
    q, kv = heads * a.head_dim, a.n_kv_heads * a.head_dim
    plain = a.neighbour_encoder_args()
    encoder = n * a.retrieval_encoder_layers * layer_activation_bytes(plain, e, tp, NO_AC)
    encoder = encoder + n * ((_norm_bytes(e) * h + 4) / tp + h * e + EMBED_ACTIVATION_BYTES)
    none = (_norm_bytes(e) * h + 4 + q * e + 2 * n * q * e + 2 * q * e + 4 * heads) / tp + h * e
    region = (2 * q * e + 2 * n * kv * e + 4 * heads) / tp + h * e
    selective = np.where(recompute_units_pay(h, a.hidden_dim, tp), none, region)
    ac = np.asarray(ac)
    cross = np.where(ac == 0, none, np.where(ac == 1, selective, 0.0))
    return encoder + len(a.retrieval_ids) * cross


def moe_mlp_bytes(a: ModelArgs, e: int) -> tuple[float, float]:
    """Bytes per token an MoE block's MLP keeps (measured on plait.model.moe.MoE: tests/test_plan_vs_runtime.py),
    as (no AC, selective AC beyond the one h e the block's formula counts for the MLP's output). Per routed copy
    (k per token): without AC the expert's SwiGLU tensors (4 F e), the gathered token and the expert output
    back in token order (2 h e) and int64 indices (32); selective keeps the w1 and w3 outputs and the w2 output
    (2 F e + h e). Per token: the fp32 router scores and their top-k weights (4 E + 8; selective: the router's
    output, E e); a shared expert as a dense SwiGLU of its width."""
    h, k, fe, experts = a.dim, a.moe_top_k, a.expert_hidden_dim, a.moe_experts
    shared = a.expert_hidden_dim * a.moe_shared_experts
    none = k * (4 * fe * e + 2 * h * e + 32) + 4 * experts + 8 + 4 * shared * e
    kept = k * (2 * fe * e + h * e) + experts * e + (2 * shared * e + h * e if shared else 0) - h * e
    return none, kept


def head_activation_bytes(a: ModelArgs, e: int, tp, fused: bool = True) -> np.ndarray:
    """Per token, last stage: the final norm's (a sequence shard), then with the fused head the gradient of
    its output (e h / tp: computed in forward, plait.model.head; the output weight's gradient, also computed
    in forward, is the gradient the model states count); with the plain head the output matmul's input
    (all-gathered: h e), the fp32 log-softmax of the vocab-sharded logits (4 V / tp) and the int64 target."""
    norm = (_norm_bytes(e) * a.dim + 4) / tp
    if fused:
        return norm + e * a.dim / tp
    return norm + e * a.dim + 4 * a.vocab_size / tp + 8


def head_transient_bytes(a: ModelArgs, e: int, tp, T, fused: bool = True, device: str = "cuda") -> np.ndarray:
    """The head's working memory at its peak: the plain head's logits and their fp32 copy (T V / tp (e + 4));
    the fused head's (plait.model.head) last chunk of logits (chunk_tokens) with its fp32 work, or after it the
    chunk's gradient beside its weight-gradient product where the matmul cannot add into the accumulator (not
    half precision on CUDA); the weight gradient's fp32 accumulator; the gathered input gradient. Per logit of
    a chunk: the eager one-pass log-softmax (the whole vocabulary on this rank) keeps the logits and their fp32
    log-probabilities, turned into the gradient in place and cast back (e + 4, + e for half): 8 bytes; with the
    vocabulary split over tp, the statistics' fp32 copy and exponentials beside the logits: e + 8 for half, 8
    for fp32 (the copy is the logits themselves). Compiled (two fused passes) it is less: the eager bound."""
    vocab = a.vocab_size / tp
    if not fused:
        return T * vocab * (e + 4)
    # T: the micro-batch's tokens, gathered over tp, in equal chunks (plait.model.args.chunk_tokens)
    chunk = np.ceil(T / np.maximum(1, np.ceil(T * vocab / LOGITS_PER_CHUNK)))
    per_logit = np.where((tp > 1) & (e < 4), e + 8, 8)
    product = 0 if device == "cuda" and e < 4 else e * vocab * a.dim
    # the logits' work, or after it the chunk's gradient (logits' dtype) beside the weight-gradient product
    work = np.maximum(chunk * vocab * per_logit, chunk * vocab * e + product)
    return work + 4 * vocab * a.dim + T * a.dim * e


EMBED_ACTIVATION_BYTES = 8
"""Per token, first stage: the int64 token ids the embedding keeps for its backward."""


# ---------------------------------------------------------------------------------------------- pipeline


def split_stages(a: ModelArgs, seq_len: int, pp, virtual):
    """Layers on the first and on the last pipeline rank, as the runtime splits them (model.args.split_layers,
    'cost': FLOPs balanced, the output projection on the last stage); a rank holds stages r, r + p, ... of the
    p x v. Returns (n_first, n_last, edge_first, edge_last) arrays: the ranks' layers, and those of the
    model's first and last stage among them; with pp = 1 all are L (one rank holds everything)."""
    (pps, vs), inverse = distinct(pp, virtual)
    out = np.full((4, *np.shape(pps)), a.n_layers, np.int64)
    for i, (p, v) in enumerate(zip(np.ravel(pps).tolist(), np.ravel(vs).tolist(), strict=True)):
        if p == 1:
            continue
        stages = split_layers(a, p * v, "cost", seq_len)
        at = (slice(None), i) if inverse is not None else slice(None)
        out[at] = (
            sum(len(stages[s]) for s in range(0, p * v, p)),
            sum(len(stages[s]) for s in range(p - 1, p * v, p)),
            len(stages[0]),
            len(stages[-1]),
        )
    return tuple(out[:, inverse]) if inverse is not None else tuple(out)


_F, _B, _I, _W = 0, 1, 2, 3  # forward, full backward, input gradient, weight gradient


def _rank_actions(schedule: str, p: int, v: int, m: int, r: int) -> tuple[np.ndarray, np.ndarray]:
    """The compute actions of pipeline rank r in the order torch.distributed.pipelining runs them, as two
    arrays: op (_F, _B, _I or _W) and local stage index.

    GPipe: all forwards, then all backwards. 1F1B: min(m, p - r) warm-up forwards, then one backward and one
    forward in turn. Interleaved 1F1B and zero bubble (torch's ``_get_1f1b_rank_ops``): warm-up forwards
    ((v - 1) p + k (p - 1 - r) with k = 2, resp. 1), then forward + backward pairs, walking the local stages
    round by round; zero bubble splits each backward into I and a W that lags r backward ops behind."""
    if schedule in ("gpipe", "1f1b"):
        warm = m if schedule == "gpipe" else min(m, p - r)
        seq = [_F] * warm + [_B, _F] * (m - warm) + [_B] * warm
        return np.array(seq), np.zeros(len(seq), dtype=np.int64)
    zero_bubble = schedule == "zero_bubble"
    per_round = m // max(1, m // p)
    total = m * v
    warm = min(total, (v - 1) * per_round + (1 if zero_bubble else 2) * (p - 1 - r))
    op = np.arange(total + warm)  # warm-up (F), steady (F, then B), cool-down (B); W after B once op >= warm + r
    fwd_stage = (op // per_round) % v
    bwd_stage = v - 1 - ((op - warm) // per_round) % v
    lag_stage = v - 1 - ((op - r - warm) // per_round) % v  # W at op is for the backward of op - r
    ops = np.broadcast_to(np.array([_F, _I if zero_bubble else _B, _W]), (len(op), 3))
    stages = np.stack([fwd_stage, bwd_stage, lag_stage], 1)
    valid = np.stack([op < total, op >= warm, zero_bubble & (op - warm >= r)], 1)
    ops, stages = ops[valid], stages[valid]
    if zero_bubble:  # the weight gradients still owed after the last backward, oldest first
        late = np.arange(total + warm - min(r, total), total + warm)
        ops = np.concatenate([ops, np.full_like(late, _W)])
        stages = np.concatenate([stages, v - 1 - ((late - warm) // per_round) % v])
    return ops, stages


STEADY_MICRO_BATCHES = 4
"""A longer steady state only repeats moments. 1F1B and interleaved 1F1B: the distinct moments of m
micro-batches (a multiple of p) are those of 4 p from 3 p on. Zero bubble: they are too, but for the weight
gradients done, which grow by p each period in the moments that follow the steady state, so those of k p
(k > 5) are 4 p's plus (k - 4) times the growth from 4 p to 5 p (tests/test_planner.py walks them all)."""

GPIPE_LINEAR_FROM = 3
"""GPipe's moments (all forwards, then the backwards' first two) hold m, m - 1 and m - 2 micro-batches: from
this many micro-batches on, those of m are 3's plus (m - 3) times the growth from 3 to 4, for any m (walked in
tests/test_planner.py)."""


@functools.lru_cache(maxsize=4096)
def held_chunks(schedule: str, p: int, v: int, m: int, r: int) -> tuple[np.ndarray, np.ndarray]:
    """How rank r's memory stacks up over its schedule, at the moments that can be its peak. One row per
    moment, five groups of v columns (one per local stage): the micro-batches whose forward is done and whose
    backward (zero bubble: weight gradient) is not; those whose zero-bubble weight gradient is done; 1 where
    the stage's gradients exist (its first backward has run); 1 for the stage whose backward starts now (its
    gradients before their reduction: FSDP's fresh ones); 1 for the stage whose backward, not its first, just
    ended (a gradient made whole and being added to the kept one). The moments: the end of each run of
    forwards, and the start and end of each backward that follows one, and of each stage's first two.
    Returned apart, (forward ends, moments in backward): the rank's peak is the largest row, weighted by
    what each column's unit costs (peak_activations), with what the moment works in (rank_memory)."""
    steady = STEADY_MICRO_BATCHES * p
    if schedule == "gpipe" and m > GPIPE_LINEAR_FROM + 1:
        return _extrapolated(schedule, p, v, GPIPE_LINEAR_FROM, 1, m, r)
    if m > steady and m % p == 0:
        if schedule in ("1f1b", "interleaved_1f1b"):
            return held_chunks(schedule, p, v, steady, r)
        if schedule == "zero_bubble" and m > steady + p:
            return _extrapolated(schedule, p, v, steady, p, m, r)
    return walk_held_chunks(schedule, p, v, m, r)


def _extrapolated(schedule: str, p: int, v: int, base: int, period: int, m: int, r: int) -> tuple:
    """held_chunks at m micro-batches from those at base and base + period, where each period adds the same."""
    at, later = held_chunks(schedule, p, v, base, r), held_chunks(schedule, p, v, base + period, r)
    return tuple(b + (x - b) * ((m - base) // period) for b, x in zip(at, later, strict=True))


def walk_held_chunks(schedule: str, p: int, v: int, m: int, r: int) -> tuple[np.ndarray, np.ndarray]:
    """held_chunks by walking every action of the schedule."""
    ops, stages = _rank_actions(schedule, p, v, m, r)
    n = len(ops)
    time = np.arange(n)
    makes_grads = (ops == _B) | (ops == _W)  # the input-gradient pass (zero bubble) makes none
    held_step = (ops == _F).astype(np.int64) - makes_grads
    # each stage's first and second backward (n where it has none): its gradients exist from the first on
    grad_ops = np.nonzero(makes_grads)[0]
    first_at, second_at = np.full(v, n), np.full(v, n)
    seen, at = np.unique(stages[grad_ops], return_index=True)
    first_at[seen] = grad_ops[at]
    rest = grad_ops[grad_ops != first_at[stages[grad_ops]]]
    seen, at = np.unique(stages[rest], return_index=True)
    second_at[seen] = rest[at]
    first = time == first_at[stages]
    follows_forward = np.append(False, ops[:-1] == _F)
    peak = np.nonzero((ops == _F) & (np.append(ops[1:], _B) != _F))[0]
    backward = np.nonzero(makes_grads & (follows_forward | first | (time == second_at[stages])))[0]
    none, ended = np.full(len(backward), -1), np.where(first[backward], -1, stages[backward])
    # moments as (time after which, stage starting its backward, stage ending a later backward, in backward):
    # forward ends, then backward starts and ends in time order
    ends = len(peak) + 2 * len(backward)
    at = np.concatenate([peak, np.stack([backward - 1, backward], axis=1).ravel()])
    start = np.concatenate([np.full(len(peak), -1), np.stack([stages[backward], none], axis=1).ravel()])
    later = np.concatenate([np.full(len(peak), -1), np.stack([none, ended], axis=1).ravel()])
    keep = _distinct_moments(at, start, later, np.arange(ends) >= len(peak), held_step, first, stages)
    at, start, later = at[keep], start[keep], later[keep]
    # held, then done, per stage after each kept moment: each action's step summed into the first moment at
    # or after it, then accumulated over the moments (cheaper than accumulating over every action)
    chosen = np.sort(at)
    into = np.searchsorted(chosen, time) * 2 * v + stages
    size = (len(chosen) + 1) * 2 * v
    counts = np.bincount(into, held_step, size) + np.bincount(into + v, ops == _W, size)
    counts = np.cumsum(counts.reshape(-1, 2 * v)[:-1], axis=0)[np.searchsorted(chosen, at)]
    rows = np.zeros((len(at), 5 * v))
    rows[:, : 2 * v] = counts
    rows[:, 2 * v : 3 * v] = at[:, None] >= first_at
    rows[np.nonzero(start >= 0)[0], 3 * v + start[start >= 0]] = 1
    rows[np.nonzero(later >= 0)[0], 4 * v + later[later >= 0]] = 1
    in_backward = keep >= len(peak)
    return rows[~in_backward], rows[in_backward]


_HASH_WEIGHTS = np.random.default_rng(0).integers(1, 2**63, size=(2, 4, 1024), dtype=np.uint64) | np.uint64(1)


def _distinct_moments(at, start, later, in_backward, held_step, first, stages) -> np.ndarray:
    """Which of a schedule's moments (after action ``at``, a stage starting its backward or -1, one ending a
    later backward or -1; forward ends, then moments in backward, each in time order) can be a peak, in
    order: a steady state repeats its moments, and the planner weighs each for every layout. Of moments alike
    but for their count of weight gradients done (which only grows, and costs bytes >= 0), only the last can
    be the largest. Alike: equal in two 64-bit hashes, linear in a moment's columns, so that a sum over the
    actions makes them (a false match: odds of 2**-128 per pair)."""
    w = _HASH_WEIGHTS[:, :, : int(stages.max(initial=0)) + 1]
    steps = held_step.astype(np.uint64) * w[:, 0, stages] + first.astype(np.uint64) * w[:, 1, stages]
    key = np.cumsum(steps, axis=1)[:, at] + np.where(start >= 0, w[:, 2, start], 0)
    key += np.where(later >= 0, w[:, 3, later], 0) + in_backward * _HASH_WEIGHTS[:, 3, -1:]
    order = np.argsort(key[0], kind="stable")  # equal keys stay in time order
    h1, h2 = key[0, order], key[1, order]
    latest = np.append(h1[1:] != h1[:-1], True)  # the last of each run of equals
    if np.any(~latest[:-1] & (h2[1:] != h2[:-1])):  # the first hash matched where the second did not: odds 2**-64
        _, latest = np.unique(np.ascontiguousarray(key[:, ::-1].T).view(np.dtype((np.void, 16))), return_index=True)
        return np.sort(len(at) - 1 - latest)
    return np.sort(order[latest])


def peak_activations(schedule, pp, virtual, m, rank_is_last: bool, weight) -> dict[str, np.ndarray]:
    """Per layout (pp > 1), at the end of a forward ('f') and in a backward ('b'), at the schedule's largest
    such moment (held_chunks): the activations ('acts_f', 'acts_b'), sum over local stages s of held(s) x
    bytes(s) + done(s) x residue(s), and the gradients then ('grads_f', 'grads_b'), those of the stages whose
    backward has begun plus a backward's fresh ones. ``weight(idx)`` returns, shaped (5, 2, layouts), the
    bytes and residue of one micro-batch, its kept gradients, the fresh ones at a backward's start and at a
    later backward's end, of the rank's edge stage (the model's first stage on the first pipeline rank, its
    last on the last: the local stage 0, resp. v - 1) and of each of its other local stages, for the layouts
    ``idx``. 0 where pp = 1."""
    out = {k: np.zeros(len(pp), dtype=np.float64) for k in ("acts_f", "grads_f", "acts_b", "grads_b")}
    piped = np.nonzero(pp > 1)[0]
    if not len(piped):
        return out
    columns = [np.asarray(x, dtype=np.int64)[piped] for x in (schedule, pp, virtual, m)]
    groups, group = distinct(*columns)  # the distinct (schedule, pp, v, m), and each layout's
    assert group is not None  # noqa: S101  # the columns are 1-D arrays, never scalars
    # Layouts of one group often have the same units (what tells them apart, e.g. how the data-parallel ranks
    # split into replicas and shards, changes no activation or gradient here): each distinct column is priced
    # once and its result shared.
    units = weight(piped).reshape(10, -1)  # row 2 u: unit u of the edge stage; 2 u + 1: of another stage
    first, inverse = _alike_columns(units, group)
    order = np.argsort(group[first], kind="stable")  # the distinct columns, group by group
    first, of = first[order], group[first[order]]
    inverse = np.argsort(order)[inverse]
    units = units[:, first]
    present, starts = np.unique(of, return_index=True)
    found = {k: np.zeros(len(first)) for k in out}
    for g, a, z in zip(present, starts, [*starts[1:], len(first)], strict=True):
        sched, p, v, mb = (int(x[g]) for x in groups)
        rows, forwards = _moment_weights(SCHEDULES[sched], p, v, mb, rank_is_last)
        kept, made = rows[:, :4] @ units[:4, a:z], rows[:, 4:] @ units[4:, a:z]  # (moments, layouts)
        total, at_col = kept + made, np.arange(z - a)
        for moment, span in (("f", slice(0, forwards)), ("b", slice(forwards, len(rows)))):
            at = np.argmax(total[span], axis=0) + span.start
            found[f"acts_{moment}"][a:z], found[f"grads_{moment}"][a:z] = kept[at, at_col], made[at, at_col]
    for k, x in found.items():
        out[k][piped] = x[inverse]
    return out


@functools.lru_cache(maxsize=4096)
def _moment_weights(schedule: str, p: int, v: int, m: int, rank_is_last: bool) -> tuple[np.ndarray, int]:
    """held_chunks' moments of the first or the last pipeline rank (forward ends, then moments in backward)
    as weights of peak_activations' units: per unit, its edge stage's column and the sum of its other
    stages' (those stages have equal units), shaped (moments, 10); and how many are forward ends."""
    forward_ends, in_backward = held_chunks(schedule, p, v, m, p - 1 if rank_is_last else 0)
    rows = np.concatenate([forward_ends, in_backward]).reshape(-1, 5, v)
    edge = rows[:, :, -1 if rank_is_last else 0]
    weights = np.stack([edge, rows.sum(axis=2) - edge], axis=2).reshape(-1, 10)
    return weights, len(forward_ends)


def _alike_columns(units: np.ndarray, group: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(first, inverse) of the distinct (group, column of units) pairs: an index of each, and each column's.
    Alike: equal in two 64-bit hashes, linear in the values' bits with their high half folded into the low
    (a false match: odds of about 2**-128 per pair, as in _distinct_moments; on one, the columns are sorted
    themselves); equal values with other bits (0.0 and -0.0) are merely priced apart."""
    bits = np.ascontiguousarray(units).view(np.uint64)  # (values, layouts)
    w = _HASH_WEIGHTS[:, 1, : len(bits) + 1]
    key = group.astype(np.uint64) * w[:, :1]
    for i, row in enumerate(bits):  # row by row: no (values, layouts) temporary
        mixed = row ^ (row >> np.uint64(32))  # values apart by a power of 2 differ in high bits only: fold them
        key += mixed * w[:, i + 1 : i + 2]
    order = np.argsort(key[0])
    h1, h2 = key[0, order], key[1, order]
    starts = np.append(True, h1[1:] != h1[:-1])
    if np.any(~starts & (h2 != np.roll(h2, 1))):  # the first hash matched where the second did not: odds 2**-64
        rows = np.column_stack([group.astype(np.uint64), bits.T])  # both uint64: no cast through float
        _, first, inverse = np.unique(rows, axis=0, return_index=True, return_inverse=True)
        return first, inverse.ravel()
    inverse = np.empty(len(order), dtype=np.int64)
    inverse[order] = np.cumsum(starts) - 1
    return order[starts], inverse


ZERO_BUBBLE_LAST_MARGIN = 1.15
"""Zero bubble's last pipeline rank keeps more than ``zero_bubble_residue`` accounts for: with one stage per
rank the weight passes of the last stage wait, and each waiting micro-batch holds the fused head's output-weight
gradient (V x dim) it computed in forward. Measured 0-14% above the model on the last rank
(tests/test_plan_vs_runtime.py), so its activations are taken 15% larger: a zero-bubble layout the planner
calls fitting must fit. The first rank's prediction is exact."""


def zero_bubble_residue(a: ModelArgs, e: int, tp, layers, has_head, fused: bool = True) -> np.ndarray:
    """Bytes per token one micro-batch of a stage keeps after its zero-bubble weight gradient, until the step
    ends (measured: tests/test_plan_vs_runtime.py). torch's input-gradient pass runs with retain_graph=True
    and the weight pass only visits the nodes next to the weights, so what those do not need stays saved: per
    layer the attention's q, k, v (h wide each after the GQA repeat), output and logsumexp; for the final
    stage also the fused head's input gradient (e h / tp), or the plain head's fp32 log-softmax, logits and
    the output matmul's input. Norms (plait.model.norm.RMSNormFunction: one node with the weight's gradient)
    are visited by the weight pass, which frees what they keep."""
    h = a.dim
    layer = (4 * e * h + 4 * a.n_heads) / tp
    head = e * h / tp if fused else (4 * a.vocab_size + e * a.vocab_size) / tp + e * h
    return layers * layer + np.where(has_head, head, 0)


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
    states = np.where(lay.offload, 0.0, full * sharded)
    # Gathered parameters: all of them when held (a pipeline, or no resharding after forward), else what the
    # two moments below hold (_resharding_gathered).
    gathered_f, gathered_b = (
        np.where(c.held, unsharded, g + enc_u) for g in _resharding_gathered(a, tp, layer_u, emb_u, head_u, fused)
    )
    # Without FSDP, bf16 autocast makes a bf16 copy of every fp32 weight it multiplies, held to backward
    # (autocast's cache; MoE experts cast theirs for grouped_mm, which saves them): the gathered parameters' part.
    casts = np.where(e < 4, e * unsharded, 0.0)
    params_f, params_b = (np.where(c.fsdp, e * g, casts) for g in (gathered_f, gathered_b))
    # Without a pipeline (in one, per stage: _pipeline_grads): the fp32 gradients FSDP accumulates unsharded
    # between micro-batches; else the unsharded ones at the start of backward, before their reduce-scatter: two
    # blocks' and the output projection's (the embedding's come at the end of backward, when the activations
    # are gone).
    piped = pp > 1
    accumulated = np.where(c.fsdp & c.accumulate & ~piped, 4.0 * unsharded, 0.0)
    fresh = e * (2 * layer_u + np.where(has_head, head_u, emb_u))
    grads_buf = np.where(c.fsdp & ~piped, np.where(c.accumulate, accumulated, fresh), 0.0)
    tp_buf = np.where(tp > 1, 2 * T * a.dim * e, 0.0)
    # Pipeline receive buffers live only while their micro-batch does (plait.core.torch_private.
    # bounded_receive_stage): a received activation is the stage's input, saved by its first block (an
    # activation, below); what is not saved is one buffer per direction the rank receives in (activations
    # into every stage but the first, gradients into every stage but the last: 2 v - 1 of the rank's v
    # stages), and with GPipe / 1F1B a second gradient buffer, the previous one, which the schedule holds
    # until it posts the next receive.
    hand_off = T * a.dim * e / tp  # sequence shards under TP
    single_stage = (lay.schedule == GPIPE) | (lay.schedule == ONE_F_ONE_B)
    pp_buf = np.where(pp > 1, (2 * v - 1 + (single_stage & is_first)) * hand_off, 0.0)
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
    states_at_peak = np.where(lay.offload, 0.0, np.where(kept_grads, full, no_grads) * sharded)
    at_forward_end = params_f + accumulated + transient_f + acts_f + at["grads_f"]
    dynamic = np.maximum(at_forward_end, params_b + grads_buf + transient_b + acts_b + at["grads_b"]) + tp_buf + pp_buf
    peak = np.maximum(states_at_peak + dynamic, states)
    acts = np.maximum(acts_f, acts_b)
    buffers = np.maximum(params_f, params_b) + grads_buf + tp_buf + pp_buf  # (a pipeline's gradients: states)
    return dict(
        states=states,
        buffers=buffers,
        activations=acts,
        transient=np.maximum(transient_f, transient_b),
        peak=peak,
        allocator=dynamic * ALLOCATOR_OVERHEAD + RESERVED_GIB * GiB,
        total=peak + dynamic * ALLOCATOR_OVERHEAD + RESERVED_GIB * GiB,
        host=np.where(lay.offload, full * sharded, 0.0),
        host_at_peak=np.where(lay.offload, np.where(kept_grads | piped, full, no_grads) * sharded, 0.0),  # then
        sharded=sharded,
        unsharded=unsharded,
        layers=layers,
        root_unsharded=root_u,
        has_output=not is_first,  # the last rank holds the output projection (without a pipeline, both do)
    )


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
