"""Parameters (how tensor parallelism and FSDP split each) and FLOPs per token of a model."""

from __future__ import annotations

import numpy as np

from plait.model.args import ModelArgs

# ------------------------------------------------------------------------------------------- parameters
# A parameter is (dim0, dim1, how tensor parallel splits it): 0 = Shard(0) (column-parallel linear, and the
# vocabulary-split embedding / output), 1 = Shard(1) (row-parallel linear), -1 = replicated (norm weights).
# FSDP2 then splits dim 0 of the TP-local tensor into dp_shard chunks, padding it to ceil(dim0 / dp_shard)
# rows on every rank: that padded size is what each rank allocates. dim1 is a float where a part is weighted by
# its share of the blocks.
Param = tuple[int, float, int]


def layer_params(a: ModelArgs) -> list[Param]:
    """One block's parameters that tensor parallelism splits and FSDP shards over dp_shard x cp: attention,
    norms and the dense MLP; for a model mixing dense and MoE blocks, the average block (each MLP's columns
    weighted by its share of the blocks: every count below is linear in them). The MoE parts: moe_params."""
    q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    h, f = a.dim, a.hidden_dim
    out: list[Param] = [(q, h, 0), (kv, h, 0), (kv, h, 0), (h, q, 1), (h, 1, -1), (h, 1, -1)]
    moe = a.n_moe_layers / a.n_layers
    if moe < 1:
        out += [(f, h * (1 - moe), 0), (f, h * (1 - moe), 0), (h, f * (1 - moe), 1)]
    if a.retrieval_ids:  # RETRO's chunked cross-attention, in its share of the blocks (plait.model.retrieval)
        crossing = len(a.retrieval_ids) / a.n_layers
        out += [(q, h * crossing, 0), (kv, h * crossing, 0), (kv, h * crossing, 0), (h, q * crossing, 1)]
        out += [(h, crossing, -1)]  # its norm
    return out


def encoder_params(a: ModelArgs) -> list[Param]:
    """RETRO's neighbour encoder (none without retrieval): its dense bidirectional blocks, split by tensor
    parallelism as the decoder's are, and its final norm. FSDP shards it with the model's root unit, which is
    gathered through the step."""
    if not a.retrieval_ids:
        return []
    plain = a.neighbour_encoder_args()
    block = [(d0, d1 * a.retrieval_encoder_layers, split) for d0, d1, split in layer_params(plain)]
    return [*block, (a.dim, 1, -1)]


def moe_params(a: ModelArgs) -> tuple[list[Param], list[Param]]:
    """An average block's parameters that tensor parallelism leaves whole (ParallelDims.tp_whole), as (the q/k
    norms and the MoE router and shared expert, the routed experts; MoE parts weighted by the MoE blocks'
    share). FSDP shards both over dp_shard x cp x tp (an MoE block runs on each tp rank's sequence shard, a
    q/k norm on its heads), the experts after expert parallelism has split them by expert (dim 0 of the
    stacked (experts, F x h) weights: the 0 below)."""
    moe = a.n_moe_layers / a.n_layers
    rest: list[Param] = [(a.head_dim, 1, -1), (a.head_dim, 1, -1)] if a.qk_norm else []
    if not moe:
        return rest, []
    h, e, fe, shared = a.dim, a.moe_experts, a.expert_hidden_dim, a.expert_hidden_dim * a.moe_shared_experts
    rest += [(e, h * moe, -1)]  # the router
    if shared:
        rest += [(shared, h * moe, -1), (shared, h * moe, -1), (h, shared * moe, -1)]
    experts: list[Param] = [(e, fe * h * moe, 0), (e, fe * h * moe, 0), (e, h * fe * moe, 0)]
    return rest, experts


def distinct(*columns) -> tuple[list[np.ndarray], np.ndarray | None]:
    """The distinct rows of integer columns (arrays of one shape, or scalars) and, for each element, the index
    of its row: the cost model's columns hold a few hundred distinct degrees over hundreds of thousands of
    layouts, so what depends on the degrees alone is computed once per distinct row (None: scalars, as they
    are)."""
    arrays = np.broadcast_arrays(*(np.asarray(c, dtype=np.int64) for c in columns))
    if arrays[0].ndim == 0:
        return list(arrays), None
    # one int64 key per element, each column in as many bits as its largest value needs: a 1-D sort, far
    # cheaper than rows'
    bits = [max(1, int(a.max(initial=0)).bit_length()) for a in arrays]
    assert sum(bits) <= 63 and all(int(a.min(initial=0)) >= 0 for a in arrays)  # noqa: S101
    key = np.zeros(arrays[0].shape, dtype=np.int64)
    for a, b in zip(arrays, bits, strict=True):
        key = key << b | a
    keys, first, inverse = np.unique(key.ravel(), return_index=True, return_inverse=True)
    return [a.ravel()[first] for a in arrays], inverse.reshape(arrays[0].shape)


def block_numel(a: ModelArgs, tp, fsdp_shard, ep) -> tuple:
    """Elements of one (average) block per rank: (FSDP-sharded, gathered) for its three parameter groups,
    dense parts (TP-split, sharded over fsdp_shard), the MoE router and shared expert (sharded over
    fsdp_shard x tp) and the experts (split over ep, sharded over fsdp_shard x tp / ep), as two dicts."""
    (tp, fsdp_shard, ep), inverse = distinct(tp, fsdp_shard, ep)
    sharded, gathered = _block_numel(a, tp, fsdp_shard, ep)
    if inverse is None:
        return sharded, gathered
    return tuple({k: np.asarray(v)[inverse] if np.ndim(v) else v for k, v in d.items()} for d in (sharded, gathered))


def _block_numel(a: ModelArgs, tp, fsdp_shard, ep) -> tuple:
    rest, experts = moe_params(a)
    moe_tp = tp if a.moe_experts or a.qk_norm else 1  # the whole parts are sharded over tp too
    sharded = {
        "dense": sharded_numel(layer_params(a), tp, fsdp_shard),
        "moe": sharded_numel(rest, 1, fsdp_shard * moe_tp),
        "experts": sharded_numel(experts, ep, fsdp_shard * moe_tp // ep),
    }
    gathered = {
        "dense": local_numel(layer_params(a), tp),
        "moe": local_numel(rest, 1),
        "experts": local_numel(experts, ep),
    }
    return sharded, gathered


def embed_params(a: ModelArgs) -> list[Param]:
    return [(a.vocab_size, a.dim, 0)]


def head_params(a: ModelArgs) -> list[Param]:
    """The final norm and the output projection, and RETRO's pointer beside them (whole on every tp rank), with
    its learned retriever's table."""
    out: list[Param] = [(a.dim, 1, -1)]
    if a.retrieval_ids and a.retrieval_pointer:  # wq, wk; the switch, its bias, the share and the follow bonus
        out += [(a.head_dim, 2 * a.dim, -1), (a.dim + 3, 1, -1)]
        out += [(a.vocab_size, a.retrieval_dim, -1), (1, 1, -1)] if a.learns_retriever else []
    return out if a.tie_embeddings else [*out, (a.vocab_size, a.dim, 0)]


def retrieval_snapshot_bytes(a: ModelArgs) -> int:
    """The learned retriever's two snapshots of its table (buffers, fp32, whole on every rank that holds the
    head: plait.model.retrieval_learned)."""
    return 2 * 4 * a.vocab_size * a.retrieval_dim if a.learns_retriever else 0


def sharded_numel(params, tp, shard):
    """Elements each rank allocates for these parameters under TP degree tp and FSDP shard group size."""
    total = 0
    for d0, d1, split in params:
        rows = d0 // tp if split == 0 else d0
        cols = d1 // tp if split == 1 else d1
        total = total + -(-rows // shard) * cols
    return total


def local_numel(params, tp):
    """Elements of the TP-local (FSDP-unsharded) parameters: what an FSDP all-gather materialises."""
    total = 0
    for d0, d1, split in params:
        total = total + d0 * d1 // np.where(split == -1, 1, tp)
    return total


def matmul_params(a: ModelArgs) -> float:
    return a.matmul_params()


# ---------------------------------------------------------------------------------------------- FLOPs


def layer_flops_per_token(a: ModelArgs, seq_len: int) -> float:
    return a.layer_flops_per_token(seq_len)


def head_flops_per_token(a: ModelArgs) -> float:
    return a.head_flops_per_token()


def train_flops_per_token(a: ModelArgs, seq_len: int) -> float:
    """The MFU numerator: ModelArgs.flops_per_token, the runtime's rule."""
    return a.flops_per_token(seq_len)
