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

import functools
from dataclasses import dataclass

import numpy as np

from plait.model.args import recompute_units_pay, split_layers
from plait.model.head import LOGITS_PER_CHUNK
from plait.model.llama import ModelArgs
from plait.parallel.rules import fsdp_enabled
from plait.parallel.rules import tp_whole as rules_tp_whole
from plait.planner.cluster import Cluster, GiB

SCHEDULES = ("none", "gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
"""Pipeline schedules by code; 'none' is a layout without a pipeline (pp = 1)."""
AC_MODES = ("none", "selective", "full")

ALLOCATOR_OVERHEAD = 0.10
"""Caching-allocator slack (fragmentation, rounding to blocks) as a fraction of the dynamic memory."""
RESERVED_GIB = 2.0
"""Per-device memory the model never sees: CUDA context, NCCL channels and cuBLAS workspaces."""
SELECTIVE_RECOMPUTE = 0.15
"""Selective AC recomputes only element-wise work (norms, rotary, SwiGLU gating): memory-bound, taken as
this fraction of a layer's forward time."""
GEMM_KNEE = 128
"""A GEMM dimension d runs at d / (d + GEMM_KNEE) of the large-GEMM efficiency (skinny GEMMs are slower)."""
OPTIMIZER_BYTES_PER_PARAM = 28
"""AdamW step traffic: read param, grad, exp_avg, exp_avg_sq (4 x fp32), write param and both moments."""


@dataclass(frozen=True)
class Workload:
    model: ModelArgs
    seq_len: int
    global_batch: int
    """Sequences per optimizer step."""
    compute_dtype: str = "bf16"
    """'bf16' (FSDP2 mixed precision: bf16 compute copies, fp32 master weights) or 'fp32'."""
    fused_head: bool = True
    """train.fused_head: the output projection and loss chunk by chunk (plait.model.head), no (B, T, V)
    logits kept; False: logits, then cross-entropy."""

    @property
    def act_bytes(self) -> int:
        return 2 if self.compute_dtype == "bf16" else 4

    @property
    def tokens(self) -> int:
        return self.global_batch * self.seq_len


@dataclass
class Layouts:
    """Columns of candidate layouts (numpy arrays of one length)."""

    dp_replicate: np.ndarray
    dp_shard: np.ndarray
    tp: np.ndarray
    pp: np.ndarray
    virtual: np.ndarray
    schedule: np.ndarray  # index into SCHEDULES
    micro_batch: np.ndarray  # sequences per micro-batch
    ac: np.ndarray  # index into AC_MODES
    offload: np.ndarray  # bool
    reshard: np.ndarray  # bool: FSDP reshard_after_forward
    sync_each: np.ndarray  # bool: FSDP reduce-scatters every micro-batch (sharded gradient accumulation)
    cp: np.ndarray  # context parallel degree
    ep: np.ndarray  # expert parallel degree (a split of dp_shard x cp x tp for MoE blocks)

    @classmethod
    def single(cls, **kw) -> Layouts:
        """One layout from scalars: dp_replicate, dp_shard, tp, pp, virtual, schedule (name), micro_batch,
        ac (name), offload, reshard, sync_each, cp, ep."""
        defaults = dict(dp_replicate=1, dp_shard=1, tp=1, pp=1, virtual=1, micro_batch=1, ac="none", cp=1, ep=1)
        kw = {**defaults, "offload": False, "reshard": True, "sync_each": False, **kw}
        kw.setdefault("schedule", "none" if kw.get("pp", 1) == 1 else "1f1b")
        kw["schedule"] = SCHEDULES.index(kw["schedule"])
        kw["ac"] = AC_MODES.index(kw["ac"])
        return cls(**{k: np.asarray([v]) for k, v in kw.items()})

    def __len__(self) -> int:
        return len(self.tp)

    def take(self, index) -> Layouts:
        return Layouts(**{k: v[index] for k, v in vars(self).items()})

    def row(self, i: int) -> dict:
        out = {k: v[i].item() for k, v in vars(self).items()}
        out["schedule"] = SCHEDULES[out["schedule"]]
        out["ac"] = AC_MODES[out["ac"]]
        return out


# ------------------------------------------------------------------------------------------- parameters
# A parameter is (dim0, dim1, how tensor parallel splits it): 0 = Shard(0) (column-parallel linear, and the
# vocabulary-split embedding / output), 1 = Shard(1) (row-parallel linear), -1 = replicated (norm weights).
# FSDP2 then splits dim 0 of the TP-local tensor into dp_shard chunks, padding it to ceil(dim0 / dp_shard)
# rows on every rank: that padded size is what each rank allocates.


def layer_params(a: ModelArgs) -> list[tuple[int, int, int]]:
    """One block's parameters that tensor parallelism splits and FSDP shards over dp_shard x cp: attention,
    norms and the dense MLP; for a model mixing dense and MoE blocks, the average block (each MLP's columns
    weighted by its share of the blocks: every count below is linear in them). The MoE parts: moe_params."""
    q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    h, f = a.dim, a.hidden_dim
    out = [(q, h, 0), (kv, h, 0), (kv, h, 0), (h, q, 1), (h, 1, -1), (h, 1, -1)]
    moe = a.n_moe_layers / a.n_layers
    if moe < 1:
        out += [(f, h * (1 - moe), 0), (f, h * (1 - moe), 0), (h, f * (1 - moe), 1)]
    return out


def moe_params(a: ModelArgs) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """An average block's parameters that tensor parallelism leaves whole (ParallelDims.tp_whole), as (the q/k
    norms and the MoE router and shared expert, the routed experts; MoE parts weighted by the MoE blocks'
    share). FSDP shards both over dp_shard x cp x tp (an MoE block runs on each tp rank's sequence shard, a
    q/k norm on its heads), the experts after expert parallelism has split them by expert (dim 0 of the
    stacked (experts, F x h) weights: the 0 below)."""
    moe = a.n_moe_layers / a.n_layers
    rest = [(a.head_dim, 1, -1), (a.head_dim, 1, -1)] if a.qk_norm else []
    if not moe:
        return rest, []
    h, e, fe, shared = a.dim, a.moe_experts, a.expert_hidden_dim, a.expert_hidden_dim * a.moe_shared_experts
    rest += [(e, h * moe, -1)]  # the router
    if shared:
        rest += [(shared, h * moe, -1), (shared, h * moe, -1), (h, shared * moe, -1)]
    experts = [(e, fe * h * moe, 0), (e, fe * h * moe, 0), (e, h * fe * moe, 0)]
    return rest, experts


def block_numel(a: ModelArgs, tp, fsdp_shard, ep) -> tuple:
    """Elements of one (average) block per rank: (FSDP-sharded, gathered) for its three parameter groups,
    dense parts (TP-split, sharded over fsdp_shard), the MoE router and shared expert (sharded over
    fsdp_shard x tp) and the experts (split over ep, sharded over fsdp_shard x tp / ep), as two dicts."""
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


def embed_params(a: ModelArgs) -> list[tuple[int, int, int]]:
    return [(a.vocab_size, a.dim, 0)]


def head_params(a: ModelArgs) -> list[tuple[int, int, int]]:
    out = [(a.dim, 1, -1)]
    return out if a.tie_embeddings else [*out, (a.vocab_size, a.dim, 0)]


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


def matmul_params(a: ModelArgs) -> int:
    return a.matmul_params()


# ---------------------------------------------------------------------------------------------- FLOPs


def layer_flops_per_token(a: ModelArgs, seq_len: int) -> float:
    return a.layer_flops_per_token(seq_len)


def head_flops_per_token(a: ModelArgs) -> float:
    return a.head_flops_per_token()


def train_flops_per_token(a: ModelArgs, seq_len: int) -> float:
    """The MFU numerator: ModelArgs.flops_per_token, the runtime's rule."""
    return a.flops_per_token(seq_len)


# ---------------------------------------------------------------------------------------------- activations


def _norm_bytes(e: int) -> int:
    """Bytes per element an RMSNorm keeps for backward: its input as it came (plait.model.llama.RMSNormFunction
    recomputes the fp32 normalised value in backward; the inverse RMS, 4 bytes a row, is counted apart)."""
    return e


def layer_activation_bytes(a: ModelArgs, e: int, tp, ac, cp=1, ep=1) -> np.ndarray:
    """Bytes kept for backward per token per block (measured on the real model: tests/test_planner.py).

    none: two norms, each (norm_bytes h + 4 for rsqrt) + its output h e (the input of the next matmul);
        q, k, v (k and v after the GQA repeat: h wide each) and the attention output h e each; logsumexp
        4 H; SwiGLU keeps w1 x, silu(w1 x), w3 x and their product: 4 F e. Under sequence parallel every
        term is split over tp except the two matmul inputs, which are all-gathered (2 h e).
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
    kv = a.n_kv_heads * a.head_dim
    nb = _norm_bytes(e)
    attention = np.where(np.asarray(cp) > 1, 2 * e * h + 2 * e * kv, 4 * e * h)  # q, k, v and the output
    moe = a.n_moe_layers / a.n_layers
    mlp_none, mlp_kept = moe_mlp_bytes(a, e)
    common = 2 * nb * h + attention + 4 * heads + 8
    # Under TP a dense block gathers both norms' outputs (2 h e, whole); an MoE block only the attention's:
    # it runs on its sequence shard (its norm's output h e / tp).
    none_dense = (common + 4 * e * f) / tp + 2 * e * h
    none_moe = (common + mlp_none + e * h) / tp + e * h
    full = e * h / tp
    kept = e * h + e * (h + 2 * kv) + e * h + 4 * heads  # input, q/k/v, attention: the attention half's
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


def moe_mlp_bytes(a: ModelArgs, e: int) -> tuple[float, float]:
    """Bytes per token an MoE block's MLP keeps (measured on plait.model.llama.MoE: tests/test_plan_vs_runtime.py),
    as (no AC, selective AC beyond the one h e the block's formula counts for the MLP's output). Per routed copy
    (k per token): without AC the expert's SwiGLU tensors (4 F e), the gathered token, the expert output and
    its weighted copy (3 h e) and two int64 indices with their inverse (32); selective keeps the w1 and w3
    outputs and the w2 output (2 F e + h e). Per token: the fp32 router scores and their top-k weights
    (4 E + 4; selective: the router's output, E e); a shared expert as a dense SwiGLU of its width."""
    h, k, fe, experts = a.dim, a.moe_top_k, a.expert_hidden_dim, a.moe_experts
    shared = a.expert_hidden_dim * a.moe_shared_experts
    none = k * (4 * fe * e + 3 * h * e + 32) + 4 * experts + 4 + 4 * shared * e
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


def head_transient_bytes(a: ModelArgs, e: int, tp, T, fused: bool = True) -> np.ndarray:
    """The head's working memory at its peak: the plain head's logits and their fp32 copy (T V / tp (e + 4));
    the fused head's one chunk of logits (plait.model.head.chunk_tokens) with its fp32 work (exponentials,
    target mask, gradient: e + 12 bytes an entry, eager), the weight gradient's fp32 accumulator and the
    gathered input gradient."""
    vocab = a.vocab_size / tp
    if not fused:
        return T * vocab * (e + 4)
    chunk = np.minimum(T, np.ceil(LOGITS_PER_CHUNK / vocab))  # T: the micro-batch's tokens, gathered over tp
    return chunk * vocab * (2 * e + 12) + 4 * vocab * a.dim + T * a.dim * e


EMBED_ACTIVATION_BYTES = 8
"""Per token, first stage: the int64 token ids the embedding keeps for its backward."""


# ---------------------------------------------------------------------------------------------- pipeline


def split_stages(a: ModelArgs, seq_len: int, pp, virtual):
    """Layers on the first and on the last pipeline rank, as the runtime splits them (model.args.split_layers,
    'cost': FLOPs balanced, the output projection on the last stage); a rank holds stages r, r + p, ... of the
    p x v. Returns (n_first, n_last) arrays; with pp = 1 both are L (one rank holds everything)."""
    pp, virtual = np.broadcast_arrays(np.asarray(pp, dtype=np.int64), np.asarray(virtual, dtype=np.int64))
    n_first, n_last = np.full(pp.shape, a.n_layers, np.int64), np.full(pp.shape, a.n_layers, np.int64)
    for p, v in set(zip(pp.ravel().tolist(), virtual.ravel().tolist(), strict=True)):
        if p == 1:
            continue
        stages = split_layers(a, p * v, "cost", seq_len)
        at = (pp == p) & (virtual == v)
        n_first[at] = sum(len(stages[s]) for s in range(0, p * v, p))
        n_last[at] = sum(len(stages[s]) for s in range(p - 1, p * v, p))
    return n_first, n_last


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
        ops = [_F] * warm + [_B, _F] * (m - warm) + [_B] * warm
        return np.array(ops), np.zeros(len(ops), dtype=np.int64)
    zero_bubble = schedule == "zero_bubble"
    per_round = m // max(1, m // p)
    total = m * v
    warm = min(total, (v - 1) * per_round + (1 if zero_bubble else 2) * (p - 1 - r))
    op = np.arange(total + warm)  # warm-up (F), steady (F, then B), cool-down (B); W after B once op >= warm + r
    fwd_stage = (op // per_round) % v
    bwd_stage = v - 1 - ((op - warm) // per_round) % v
    lag_stage = v - 1 - ((op - r - warm) // per_round) % v  # W at op is for the backward of op - r
    ops = np.stack([np.full_like(op, _F), np.full_like(op, _I if zero_bubble else _B), np.full_like(op, _W)], 1)
    stages = np.stack([fwd_stage, bwd_stage, lag_stage], 1)
    valid = np.stack([op < total, op >= warm, zero_bubble & (op - warm >= r)], 1)
    ops, stages = ops[valid], stages[valid]
    if zero_bubble:  # the weight gradients still owed after the last backward, oldest first
        late = np.arange(total + warm - min(r, total), total + warm)
        ops = np.concatenate([ops, np.full_like(late, _W)])
        stages = np.concatenate([stages, v - 1 - ((late - warm) // per_round) % v])
    return ops, stages


@functools.lru_cache(maxsize=4096)
def held_chunks(schedule: str, p: int, v: int, m: int, r: int) -> np.ndarray:
    """How rank r's activations stack up: one row per forward, holding per local stage (first v columns)
    the micro-batches whose forward is done and whose backward (zero bubble: weight gradient) is not, and
    (last v columns) those whose zero-bubble weight gradient is done. The rank's activation peak is the
    largest row weighted by the bytes one micro-batch of each stage keeps in each state."""
    ops, stages = _rank_actions(schedule, p, v, m, r)
    delta = np.zeros((len(ops), 2 * v), dtype=np.int64)
    rows = np.arange(len(ops))
    delta[rows, stages] = np.select([ops == _F, (ops == _B) | (ops == _W)], [1, -1], 0)
    delta[rows, v + stages] = ops == _W
    # Peaks come right after a forward that the next action does not extend (a B or W lowers the total).
    peak = (ops == _F) & (np.append(ops[1:], _B) != _F)
    return np.unique(np.cumsum(delta, axis=0)[peak], axis=0).astype(np.float64)


def peak_activations(schedule, pp, virtual, m, rank_is_last: bool, weight) -> np.ndarray:
    """Per layout (pp > 1): the peak over the schedule of sum over local stages s of held(s) x bytes(s) +
    done(s) x residue(s), where ``weight(s, mask)`` returns (bytes, residue) of one micro-batch of stage s
    for the layouts in ``mask``, on the first or the last pipeline rank. 0 where pp = 1."""
    out = np.zeros(len(pp), dtype=np.float64)
    piped = np.nonzero(pp > 1)[0]
    keys, group = np.unique(np.stack([schedule, pp, virtual, m], axis=1)[piped], axis=0, return_inverse=True)
    order = np.argsort(group.ravel(), kind="stable")
    bounds = np.searchsorted(group.ravel()[order], np.arange(len(keys) + 1))
    for g, key in enumerate(keys):
        sched, p, v, mb = (int(x) for x in key)
        idx = piped[order[bounds[g] : bounds[g + 1]]]  # the layouts with this schedule, pp, v and m
        rows = held_chunks(SCHEDULES[sched], p, v, mb, p - 1 if rank_is_last else 0)
        held, residue = zip(*(weight(s, idx) for s in range(v)), strict=True)
        out[idx] = np.max(rows @ np.stack([*held, *residue]), axis=0)  # (v held + v done) x layouts in the group
    return out


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
    the output matmul's input. Norms (plait.model.llama.RMSNormFunction: one node with the weight's gradient)
    are visited by the weight pass, which frees what they keep."""
    h = a.dim
    layer = (4 * e * h + 4 * a.n_heads) / tp
    head = e * h / tp if fused else (4 * a.vocab_size + e * a.vocab_size) / tp + e * h
    return layers * layer + np.where(has_head, head, 0)


# ---------------------------------------------------------------------------------------------- comm


def _spans_nodes(inner, size, per_node):
    """Whether the ranks of one mesh-axis group sit on more than one node. Axes are laid out innermost
    first as tp, dp_shard, dp_replicate, pp (plait.parallel.dims), so a group of `size` ranks, `inner`
    apart, fits in a node iff inner x size <= devices per node."""
    return (size > 1) & (inner * size > per_node)


def _link(cluster: Cluster, spans):
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


# ---------------------------------------------------------------------------------------------- the model


NO_AC, SELECTIVE_AC, FULL_AC = (AC_MODES.index(m) for m in AC_MODES)
NO_PIPELINE, GPIPE, ONE_F_ONE_B, INTERLEAVED, ZERO_BUBBLE = (SCHEDULES.index(s) for s in SCHEDULES)


@dataclass
class _Columns:
    """A batch of layouts' columns and what follows from them, shared by the memory and the time model."""

    tp: np.ndarray
    pp: np.ndarray
    v: np.ndarray  # virtual stages per pipeline rank
    shard: np.ndarray
    rep: np.ndarray
    cp: np.ndarray
    ep: np.ndarray
    moe_tp: np.ndarray  # ranks that split an MoE block's tokens beyond cp
    whole_tp: np.ndarray  # parameters TP leaves whole: FSDP over tp (plait.parallel.rules.tp_whole)
    dp: np.ndarray
    fsdp_shard: np.ndarray  # context parallel ranks shard the parameters with dp_shard (plait.parallel.dims)
    m: np.ndarray  # micro-batches per step
    T: np.ndarray  # this rank's tokens of one micro-batch
    single: np.ndarray  # no pipeline
    fsdp: np.ndarray  # plait.parallel.rules.fsdp_enabled
    accumulate: np.ndarray  # gradients unsharded across micro-batches (no-sync), unless reduced after each
    held: np.ndarray  # gathered parameters stay gathered through the step

    @classmethod
    def of(cls, work: Workload, lay: Layouts) -> _Columns:
        a = work.model
        tp, pp, v = lay.tp.astype(np.int64), lay.pp.astype(np.int64), lay.virtual.astype(np.int64)
        shard, rep = lay.dp_shard.astype(np.int64), lay.dp_replicate.astype(np.int64)
        cp, ep = lay.cp.astype(np.int64), lay.ep.astype(np.int64)
        dp = shard * rep
        m = (work.global_batch // dp) // lay.micro_batch
        return cls(
            tp, pp, v, shard, rep, cp, ep,
            moe_tp=tp if a.moe_experts else np.ones_like(tp),
            whole_tp=tp if a.moe_experts or a.qk_norm else np.ones_like(tp),
            dp=dp, fsdp_shard=shard * cp, m=m,
            T=(lay.micro_batch * work.seq_len / cp).astype(np.float64),
            single=pp == 1,
            fsdp=fsdp_enabled(dp * cp, ep, rules_tp_whole(tp, bool(a.moe_experts), a.qk_norm), lay.offload),
            accumulate=((m > 1) | (pp > 1)) & ~lay.sync_each,
            held=(pp > 1) | ~lay.reshard,
        )  # fmt: skip


def evaluate(work: Workload, cluster: Cluster, lay: Layouts) -> dict[str, np.ndarray]:
    """Memory (bytes, worst rank) and step time (s) with their parts, MFU and tokens/s for each layout: the
    first and the last pipeline rank are modelled (the embedding's and the output projection's), the worse
    of the two counts."""
    c = _Columns.of(work, lay)
    out: dict[str, np.ndarray] = {"micro_batches": c.m}
    mem = {name: _rank_memory(work, lay, c, name) for name in ("first", "last")}
    for name in ("first", "last"):  # per pipeline rank, for the comparison with measured memory
        for key in ("states", "buffers", "activations"):
            out[f"mem_{key}_{name}"] = mem[name][key]
    worst_first = mem["first"]["total"] >= mem["last"]["total"]
    for key in ("states", "buffers", "activations", "transient", "allocator", "total", "host"):
        out[f"mem_{key}"] = np.where(worst_first, mem["first"][key], mem["last"][key])
    out["fits_host"] = out["mem_host"] * cluster.devices_per_node <= 0.9 * cluster.host_memory_gib * GiB
    out["fits"] = (out["mem_total"] <= cluster.memory_gib * GiB) & out["fits_host"]
    links = _Links.of(cluster, c)
    out["tp_cross_node"] = links.tp_spans
    per_rank = {name: _rank_time(work, cluster, lay, c, links, rank) for name, rank in mem.items()}
    out.update(_step_time(work, cluster, lay, c, per_rank))
    return out


def _rank_memory(work: Workload, lay: Layouts, c: _Columns, name: str) -> dict[str, np.ndarray]:
    """The first pipeline rank's (it holds the embedding) or the last's (the output projection) memory, by part."""
    a, e, fused = work.model, work.act_bytes, work.fused_head
    tp, pp, v, T = c.tp, c.pp, c.v, c.T
    is_first = name == "first"
    layers = split_stages(a, work.seq_len, pp, v)[0 if is_first else 1]
    block_s, block_u = block_numel(a, tp, c.fsdp_shard, c.ep)
    layer_s, layer_u = sum(block_s.values()), sum(block_u.values())
    emb_s, emb_u = sharded_numel(embed_params(a), tp, c.fsdp_shard), local_numel(embed_params(a), tp)
    head_s, head_u = sharded_numel(head_params(a), tp, c.fsdp_shard), local_numel(head_params(a), tp)
    if is_first:
        root_s, root_u = emb_s + np.where(c.single, head_s, 0), emb_u + np.where(c.single, head_u, 0)
    else:
        root_s, root_u = head_s + np.where(c.single, emb_s, 0), head_u + np.where(c.single, emb_u, 0)
    has_head, has_embed = c.single | (not is_first), c.single | is_first
    sharded = layers * layer_s + root_s
    unsharded = layers * layer_u + root_u
    states = np.where(lay.offload, 0.0, 16.0 * sharded)  # fp32 param + fp32 grad + AdamW (2 x fp32)
    gathered = np.where(c.held, unsharded, _resharding_gathered(a, tp, layer_u, emb_u, head_u, fused))
    params_buf = np.where(c.fsdp, e * gathered, 0.0)
    grads_buf = np.where(c.fsdp, np.where(c.accumulate, 4.0 * unsharded, e * (2 * layer_u + root_u)), 0.0)
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
    acts = _activations(work, lay, c, layers, rank_last=not is_first, has_head=has_head, hand_off=hand_off)
    acts = acts + np.where(has_embed, c.m * T * EMBED_ACTIVATION_BYTES, 0)  # the token ids of all micro-batches
    transient = _transient(work, lay, c, has_head)
    dynamic = params_buf + grads_buf + tp_buf + pp_buf + acts + transient
    return dict(
        states=states,
        buffers=params_buf + grads_buf + tp_buf + pp_buf,
        activations=acts,
        transient=transient,
        allocator=dynamic * ALLOCATOR_OVERHEAD + RESERVED_GIB * GiB,
        total=states + dynamic * (1 + ALLOCATOR_OVERHEAD) + RESERVED_GIB * GiB,
        host=np.where(lay.offload, 16.0 * sharded, 0.0),
        sharded=sharded,
        unsharded=unsharded,
        layers=layers,
        root_unsharded=root_u,
        has_output=not is_first,  # the last rank holds the output projection (without a pipeline, both do)
    )


def _resharding_gathered(a: ModelArgs, tp, layer_u, emb_u, head_u, fused: bool):
    """Gathered parameters at the peak where blocks reshard after forward (no pipeline): the current and the
    prefetched block and the root. Untied, the embedding is a unit of its own gathered for its forward only,
    as the output is under the fused head (gathered with the last block, freed before backward):
    plait.parallel.parallelize._shard_embedding_and_head."""
    if a.tie_embeddings:
        return 2 * layer_u + emb_u + head_u
    out_u = local_numel([(a.vocab_size, a.dim, 0)], tp)
    return (np.maximum(2 * layer_u, layer_u + out_u) if fused else 2 * layer_u + out_u) + a.dim


def _activations(work: Workload, lay: Layouts, c: _Columns, layers, *, rank_last: bool, has_head, hand_off):
    """Activations kept for backward at the rank's peak: one micro-batch without a pipeline, else the
    schedule's peak over the micro-batches each of this rank's v stages holds (peak_activations)."""
    a, e, fused, T, v = work.model, work.act_bytes, work.fused_head, c.T, c.v
    chunk = layers / v * layer_activation_bytes(a, e, c.tp, lay.ac, c.cp, c.ep) * T
    # One micro-batch of one of this rank's v stages: its layers, its input (received, except on the first
    # stage), and its output until the backward: the stage that sends keeps it, the final stage keeps its
    # logits (the schedule's stage output) and the loss's activations. The last stage's output: the logits
    # (B, T, V / tp); with the fused head the micro-batch's loss, and the output weight's gradient it computed
    # in forward (in the gathered weight's dtype), kept per micro-batch in flight until that micro-batch's
    # backward.
    head_grad = a.vocab_size / c.tp * a.dim * np.where(c.fsdp, e, 4)
    head = head_activation_bytes(a, e, c.tp, fused) * T + (head_grad if fused else T * a.vocab_size / c.tp * e)
    zb = (
        zero_bubble_residue(a, e, c.tp, layers / v, False, fused),
        zero_bubble_residue(a, e, c.tp, layers / v, True, fused),
    )

    def stage_bytes(s, idx):
        first_stage, last_stage = s == 0 and not rank_last, rank_last and s == int(v[idx][0]) - 1
        # (the layers' bytes already count the stage input, which the first block's norm saves)
        held = chunk[idx] + (head[idx] if last_stage else hand_off[idx])
        # zero bubble: a stage that received its input keeps it as long as the rest of the residue
        residue = 0 * held if first_stage else zb[1 if last_stage else 0][idx] * T[idx] + hand_off[idx]
        residue = np.where(lay.ac[idx] == FULL_AC, 0, residue)  # full AC: the residue is recomputed, not kept
        return held, residue

    acts = np.where(
        c.single,
        chunk + np.where(has_head, head_activation_bytes(a, e, c.tp, fused) * T, 0),
        peak_activations(lay.schedule, c.pp, v, c.m, rank_last, stage_bytes),
    )
    if rank_last:
        acts = np.where(lay.schedule == ZERO_BUBBLE, acts * ZERO_BUBBLE_LAST_MARGIN, acts)
    return acts


def _transient(work: Workload, lay: Layouts, c: _Columns, has_head):
    """Memory that lives only during one block's backward (or the head's)."""
    a, e, T = work.model, work.act_bytes, c.T
    a_none = layer_activation_bytes(a, e, c.tp, NO_AC, c.cp, c.ep)
    kv_local = a.n_kv_heads * a.head_dim / c.tp  # the keys (and values) one rank's attention holds per token
    transient = np.where(lay.ac > NO_AC, a_none * T, 0.0)  # one block recomputed during its backward
    transient = transient + np.where(has_head, head_transient_bytes(a, e, c.tp, T, work.fused_head), 0.0)
    # the ring's buffers in backward: k and v held and arriving, their fp32 gradients held and arriving
    transient = transient + np.where(c.cp > 1, T * kv_local * 2 * (2 * e + 2 * 4), 0.0)
    # expert parallelism: one MoE block's tokens on the move (received, regrouped, results going back)
    return transient + np.where(c.ep > 1, 3 * a.moe_top_k * T / c.moe_tp * a.dim * e, 0.0)


@dataclass
class _Links:
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
    def of(cls, cluster: Cluster, c: _Columns) -> _Links:
        G = cluster.devices_per_node
        tp_spans = _spans_nodes(1, c.tp, G)
        return cls(
            tp_spans,
            _link(cluster, tp_spans),
            _link(cluster, _spans_nodes(c.tp, c.cp, G)),
            _link(cluster, _spans_nodes(c.tp * c.cp, c.shard, G)),
            _link(cluster, _spans_nodes(c.tp * c.cp * c.shard, c.rep, G)),
            _link(cluster, _spans_nodes(c.tp * c.cp * c.dp, c.pp, G)),
            _link(cluster, _spans_nodes(1, c.fsdp_shard * c.whole_tp, G)),
            _link(cluster, _spans_nodes(1, c.ep, G)),
        )


def _rank_time(work: Workload, cluster: Cluster, lay: Layouts, c: _Columns, links: _Links, rank: dict) -> dict:
    """One pipeline rank's time per micro-batch by part (compute, TP, CP, EP, pipeline sends), with the F / B / W
    shares zero bubble schedules, its exposed FSDP communication per step, and its optimizer step."""
    a, s, e, T, tp, cp, ep = work.model, work.seq_len, work.act_bytes, c.T, c.tp, c.cp, c.ep
    layers = rank["layers"]
    local_width = a.dim / tp
    eff = cluster.efficiency * (T / (T + GEMM_KNEE)) * (local_width / (local_width + GEMM_KNEE))
    rate = cluster.peak_flops * eff
    full = lay.ac == FULL_AC
    recompute = np.where(full, 1.0, np.where(lay.ac == SELECTIVE_AC, SELECTIVE_RECOMPUTE, 0.0))
    extra_collectives = np.where(lay.ac > NO_AC, 3, 0)  # recomputing a block repeats its SP all-gathers
    moe_share = a.n_moe_layers / a.n_layers
    sp_share = 1 - moe_share / 2  # an MoE block has the attention's SP collectives only
    c_layer = layer_flops_per_token(a, s)
    w_layer = 2 * matmul_params(a)  # weight-gradient FLOPs per token (the rest of backward is input-grad)
    head = head_flops_per_token(a) * (c.single | rank["has_output"])
    fwd = T * (layers * c_layer + head) / tp
    wgt = T * (layers * w_layer + head) / tp
    bwd_in = 2 * fwd - wgt + recompute * T * layers * c_layer / tp
    compute = (fwd + bwd_in + wgt) / rate
    tp_bw, tp_lat = links.tp
    coll = ring_time(T * a.dim * e, tp, tp_bw, tp_lat)  # one SP all-gather or reduce-scatter
    tp_time = layers * sp_share * (8 + extra_collectives) * coll
    pp_bw, pp_lat = links.pp
    p2p = np.where(c.pp > 1, 2 * c.v * (T * a.dim * e / tp / pp_bw + pp_lat), 0.0)  # each TP rank: its shard
    # Ring attention, per layer: each of the c - 1 hops travels while one block computes (1/c of this rank's
    # attention, whose forward is 4 h s FLOPs per token, backward twice that), so only what a hop takes
    # beyond its block is exposed; in backward the gradients of the previous step's keys travel alongside,
    # and their last hop home is exposed whole. Full AC runs the forward ring twice.
    cp_bw, cp_lat = links.cp
    kv_local = a.n_kv_heads * a.head_dim / tp
    kv_hop, grad_hop = 2 * T * kv_local * e / cp_bw + cp_lat, 2 * T * kv_local * 4 / cp_bw + cp_lat
    block = 4 * a.dim * s * T / tp / rate / cp
    ring_fwd = (cp - 1) * np.maximum(kv_hop - block, 0)
    ring_bwd = (cp - 1) * np.maximum(kv_hop + grad_hop - 2 * block, 0) + grad_hop
    cp_time = np.where(cp > 1, layers * (ring_fwd * np.where(full, 2, 1) + ring_bwd), 0.0)
    # Expert parallelism, per MoE block and pass: the routed copies (k per token) go to their experts and
    # back, (ep - 1) / ep of them to other ranks, plus an exchange of the counts; backward the same for the
    # gradients; full AC dispatches the forward again. On the critical path: nothing hides it.
    ep_bw, ep_lat = links.ep
    a2a = 2 * (a2a_bytes(a, e, T / c.moe_tp, ep) / ep_bw + 2 * ep_lat)
    ep_time = np.where(ep > 1, layers * moe_share * a2a * (2 + full), 0.0)
    t_mb = compute + tp_time + p2p + cp_time + ep_time
    # F / B / W shares of a micro-batch (communication spread pro rata) for the zero-bubble schedule.
    total_flops = fwd + bwd_in + wgt
    f_t, b_t, w_t = (t_mb * x / total_flops for x in (fwd, bwd_in, wgt))
    fsdp_exposed, gathers = _fsdp_exposed(work, lay, c, links, rank, f_t, b_t + w_t)
    return dict(
        compute=compute,
        tp=tp_time,
        cp=cp_time,
        ep=ep_time,
        p2p=p2p,
        t_mb=t_mb,
        zb=np.maximum(f_t + b_t - w_t, 0),
        fsdp=np.where(c.fsdp, fsdp_exposed, 0.0),
        optimizer=_optimizer_time(cluster, lay, rank["sharded"], gathers),
    )


def _fsdp_exposed(work: Workload, lay: Layouts, c: _Columns, links: _Links, rank: dict, f_t, bwd_t) -> tuple:
    """(FSDP communication not hidden by compute per step, the all-gathers of each parameter per step).

    Forward all-gathers hide behind the forward of their micro-batch, backward ones (after
    reshard-after-forward) and the gradient reduce-scatter (+ the HSDP all-reduce across replicas, on the last
    micro-batch only: accumulation skips the sync) behind its backward. The first group's gather and the last
    group's reduction cannot overlap anything. Each FSDP group over its own ranks: dense parts over
    fsdp_shard, MoE router and shared expert over fsdp_shard x tp, experts over fsdp_shard x tp / ep
    (plait.parallel.parallelize._shard_moe)."""
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
        ag = ag + ring_time(e * numel, n, bw, lat, groups)
        rs = rs + ring_time(4.0 * numel, n, bw, lat, groups)
        ar = ar + allreduce_time(4.0 * numel / n, c.rep, rp_bw, rp_lat, groups)
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


def _optimizer_time(cluster: Cluster, lay: Layouts, sharded, gathers):
    """The optimizer step: bound by device memory bandwidth, or with CPU offload by the host's, plus moving the
    shards over PCIe for each FSDP gather (and the gradients back)."""
    return np.where(
        lay.offload,
        OPTIMIZER_BYTES_PER_PARAM * sharded * cluster.devices_per_node / cluster.host_bw
        + (gathers + 1) * 4.0 * sharded / cluster.pcie_bw,
        OPTIMIZER_BYTES_PER_PARAM * sharded / cluster.hbm_bw,
    )


def _step_time(work: Workload, cluster: Cluster, lay: Layouts, c: _Columns, per_rank: dict) -> dict:
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
    step = mf * t_mb + bubble + fsdp_time + opt_time
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
        step_time=step,
        tokens_per_s=tokens / step,
        mfu=train_flops_per_token(work.model, work.seq_len) * tokens / (step * world * cluster.peak_flops),
    )
