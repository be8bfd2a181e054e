"""Activation bytes per token: what a block, RETRO's retrieval, a mixture of experts' MLP and the head keep for
backward under each activation-checkpointing mode, and the head's working memory. Per token and per layer,
measured against the real model (tests/unit/test_planner.py, tests/parallel/test_plan_vs_runtime.py);
plait.planner.cost.memory multiplies them by a rank's tokens, layers and in-flight micro-batches."""

from __future__ import annotations

import numpy as np

from plait.model.args import LOGITS_PER_CHUNK, ModelArgs, recompute_units_pay
from plait.planner.cost.layouts import NO_AC


def _norm_bytes(e: int) -> int:
    """Bytes per element an RMSNorm keeps for backward: its input as it came (plait.model.norm.RMSNormFunction
    recomputes the fp32 normalised value in backward; the inverse RMS, 4 bytes a row, is counted apart)."""
    return e


def layer_activation_bytes(a: ModelArgs, e: int, tp, ac, cp=1, ep=1) -> np.ndarray:
    """Bytes kept for backward per token per block (measured on the real model: tests/unit/test_planner.py).

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
    model: tests/parallel/test_plan_vs_runtime.py). Each token brings n = 2k neighbour tokens (k neighbours of 2c per
    chunk of c), kept whatever the activation checkpointing, which covers the decoder's blocks only: their int64
    ids, the encoder's blocks over them (sequence-parallel under TP, as the decoder's, without checkpointing),
    its final norm, and its output, whole on every tp rank (every cross-attending block's key and value
    projections take it). Per cross-attending block, without AC or outside selective recompute's units (under
    TP: they cover attention and MLP, the cross-attention runs between them): its norm's input, its output
    gathered and shifted by c - 1 (h e, whole), the queries, the keys and values of n tokens after the GQA
    repeat, the attention's output and its copy into the output projection (each Q e / tp), logsumexp; as one
    selective region (tp = 1): the projections' outputs (keys and values before the repeat), the attention's
    and the output projection's partial sum (h e); full AC: nothing (the block's input and the encoder's output
    are counted already), but under TP the first block's input whole (h e, not h e / tp: its checkpoint keeps
    it before sequence parallelism shards it); and the neighbour pointer's (`pointer_activation_bytes`)."""
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
    # full AC: the first block's checkpoint keeps its input whole, before its sequence shard is taken (under TP a
    # retrieval model's embeddings are whole on every rank: plait.parallel.tensor_parallel.apply_tp_retrieval)
    first = np.where(ac == 2, h * e * (1 - 1 / np.asarray(tp, dtype=np.float64)), 0.0)
    return encoder + len(a.retrieval_ids) * cross + first + pointer_activation_bytes(a, e)


POINTER_SMALL_BYTES = 36
"""The pointer's per-token scalars kept for backward (the switch's sigmoid and its share, the copy's probability
of the target, the mixture's (1 - s) a, (1 - s) b + s p operands; fp32): nine of them, measured."""
BAG_BYTES_PER_TOKEN, BAG_BYTES = 12, 16
"""A learned retriever's bag of c tokens (plait.model.retrieval_learned.bag_embed) keeps, beside its vectors,
each token's id (int64) and weight (fp32), and a few scalars for the bag: measured."""


def pointer_activation_bytes(a: ModelArgs, e: int) -> float:
    """The neighbour pointer's bytes kept for backward per token of the sequence (0 without it; measured on the
    real model: tests/parallel/test_plan_vs_runtime.py). It runs beside the head, outside the blocks, so no
    activation checkpointing covers it; under TP every tp rank computes it whole (plait.model.retrieval), so it
    is not split. Each token sees n = 2 k c neighbour tokens (those of the last chunk before it): its gathered
    hidden state (h e), its query (d e, d the head width), its share of the keys over the chunk's neighbours
    (n d e / c), and, per neighbour token, the follow mask and the target mask (1 byte each) and the attention
    (fp32); and POINTER_SMALL_BYTES. With the learned retriever (retrieval_learned), per chunk of c tokens: the
    chunk's and its k neighbours' bags (their sum and unit vectors, 2 x 4 D each, D = retrieval_dim, and
    BAG_BYTES_PER_TOKEN c + BAG_BYTES), the prior's k cosines and log-probabilities (fp32), and per neighbour
    token the log-softmax within each neighbour beside the attention (fp32)."""
    if not (a.retrieval_ids and a.retrieval_pointer):
        return 0.0
    h, d, c = a.dim, a.head_dim, a.retrieval_chunk
    n = 2 * a.retrieval_k * c
    pointer = (h + d) * e + n * d * e / c + n * (1 + 1 + 4) + POINTER_SMALL_BYTES
    if not a.learns_retriever:
        return pointer
    bag = 8 * a.retrieval_dim + BAG_BYTES_PER_TOKEN * c + BAG_BYTES
    return pointer + ((1 + a.retrieval_k) * bag + 8 * a.retrieval_k) / c + 4 * n


def moe_mlp_bytes(a: ModelArgs, e: int) -> tuple[float, float]:
    """Bytes per token an MoE block's MLP keeps (measured on plait.model.moe.MoE:
    tests/parallel/test_plan_vs_runtime.py), as (no AC, selective AC beyond the one h e the block's formula counts for
    the MLP's output). Per routed copy (k per token): without AC the expert's SwiGLU tensors (4 F e), the gathered token
    and the expert output back in token order (2 h e) and int64 indices (32); selective keeps the w1 and w3 outputs and
    the w2 output (2 F e + h e). Per token: the fp32 router scores and their top-k weights (4 E + 8; selective: the
    router's output, E e); a shared expert as a dense SwiGLU of its width."""
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
