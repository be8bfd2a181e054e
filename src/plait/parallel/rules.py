"""Every rule of a parallel layout, written once: which degrees can split this model and sequence, how a batch
divides over ranks and micro-batches, what a pipeline schedule needs, and when FSDP wraps the model.

The runtime's check before any worker starts (plait.parallel.dims.validate_layout), the planner's search over
candidate layouts (plait.planner.search) and its cost model all call these. The element-wise ones (tp_whole,
fsdp_enabled) take plain values or numpy columns of candidate layouts alike, so the planner's vectorised form
is these functions, not a second encoding of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from plait.core.torch_private import torch_version, weight_pass_takes_custom_functions

if TYPE_CHECKING:
    from plait.model.args import ModelArgs

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
"""The pipeline schedules plait runs (parallel.pp_schedule)."""


def tp_whole(tp: Any, moe: Any, qk_norm: Any) -> Any:
    """Whether tensor parallelism leaves parameters whole on every tp rank while the ranks compute different
    parts with them (an MoE block on each rank's sequence shard, q/k norms on each rank's heads), so their
    gradients are partial sums over tp: FSDP shards them over dp_shard x cp x tp and reduces them there.
    Element-wise: plain values or numpy columns."""
    return (tp > 1) & (moe | qk_norm)


def fsdp_enabled(dp_cp: Any, ep: Any, whole_tp: Any, cpu_offload: Any) -> Any:
    """FSDP2 wraps the model where data or context parallelism shards it (dp x cp > 1), where expert
    parallelism splits experts, where tensor parallelism leaves parameters whole (`tp_whole`: FSDP reduces
    their gradients), and at dp = cp = 1 where CPU offload is asked (FSDP2's offload policy is how
    parameters, gradients and optimizer state live on the CPU). Element-wise, as tp_whole."""
    return (dp_cp > 1) | (ep > 1) | whole_tp | cpu_offload


def num_micro_batches(micro_batch_size: int, local_batch: int, stages: int = 1) -> int:
    """Micro-batches per step on one data-parallel rank: local_batch / train.micro_batch_size, or, with
    train.micro_batch_size unset (0), one per pipeline stage (stages: pp x virtual; 1 without a pipeline: the
    whole batch at once). The rule the layout check, the pipeline, the trainer and the planner share."""
    return local_batch // micro_batch_size if micro_batch_size else stages


def tp_problem(m: ModelArgs, seq_len: int, tp: int) -> str | None:
    """Why tensor parallelism of degree tp cannot split this model and sequence (None: it can). The rule the
    runtime (validate_layout) and the planner's search share."""
    if m.n_heads % tp or m.n_kv_heads % tp:
        ok = [d for d in range(1, m.n_kv_heads + 1) if m.n_kv_heads % d == 0 and m.n_heads % d == 0]
        return (
            f"parallel.tp_degree={tp} must divide model.n_heads={m.n_heads} and "
            f"model.n_kv_heads={m.n_kv_heads}; choose tp_degree in {ok}"
        )
    if m.hidden_dim % tp or m.vocab_size % tp:
        return f"parallel.tp_degree={tp} must divide the MLP width ({m.hidden_dim}) and model.vocab_size={m.vocab_size}"
    if seq_len % tp:
        return (
            f"data.seq_len={seq_len} must be divisible by parallel.tp_degree={tp} "
            "(sequence parallel splits the sequence)"
        )
    if m.retrieval_ids and (2 * m.retrieval_chunk) % tp:
        return (
            f"parallel.tp_degree={tp} must divide a neighbour's 2 x model.retrieval_chunk={2 * m.retrieval_chunk} "
            "tokens (the neighbours' encoder runs sequence-parallel too)"
        )
    return None


def cp_problem(m: ModelArgs, seq_len: int, cp: int, tp: int = 1) -> str | None:
    """Why context parallelism of degree cp cannot split this sequence (None: it can); shared like tp_problem.
    Each rank holds two of 2 x cp equal chunks (a head one and its mirror from the tail, so that causal
    attention costs every rank the same), and under sequence parallelism its part splits again by tp."""
    if cp == 1:
        return None
    if m.retrieval_ids:
        return (
            f"model.retrieval_layers with parallel.cp_degree={cp} is not supported yet (a sequence's neighbours "
            "follow its tokens in one row, which CP would cut); use data or tensor parallelism"
        )
    if seq_len % (2 * cp):
        ok = [c for c in range(1, cp + 1) if c == 1 or seq_len % (2 * c) == 0]  # 1: no split at all
        return (
            f"data.seq_len={seq_len} must be divisible by 2 x parallel.cp_degree = {2 * cp} (each rank holds two "
            f"equal chunks of every sequence); use a seq_len that is a multiple of {2 * cp}, or cp_degree in {ok}"
        )
    if (seq_len // cp) % tp:
        return (
            f"data.seq_len / parallel.cp_degree = {seq_len // cp} must be divisible by parallel.tp_degree={tp} "
            "(sequence parallel splits each rank's part of the sequence)"
        )
    if 0 < m.sliding_window < seq_len:
        return (
            f"model.sliding_window={m.sliding_window} with parallel.cp_degree={cp}: the ring attention is causal "
            "without a window; set parallel.cp_degree=1"
        )
    return None


def pp_problem(m: ModelArgs, pp: int) -> str | None:
    """Why pipeline parallelism of degree pp cannot split this model (None: it can); shared like tp_problem."""
    if pp > 1 and m.tie_embeddings:
        return (
            "model.tie_embeddings=true cannot be pipelined: the embedding and the output projection live on "
            "different stages; untie them or set parallel.pp_degree=1"
        )
    if m.n_layers < pp:
        return f"model.n_layers={m.n_layers} is fewer than parallel.pp_degree={pp}; lower parallel.pp_degree"
    if pp > 1 and m.retrieval_ids:
        return (
            f"model.retrieval_layers with parallel.pp_degree={pp} is not supported yet (the neighbours' encoder "
            "is not split into pipeline stages); use data or tensor parallelism"
        )
    return None


def schedule_problem(schedule: str, fused_head: bool) -> str | None:
    """Why this torch cannot run a pipeline schedule with this head (None: it can); shared by the runtime's
    check and the planner's search, so `--layout auto` never picks what the run would refuse."""
    if schedule == "zero_bubble" and fused_head and not weight_pass_takes_custom_functions():
        return (
            f"pp_schedule='zero_bubble' with train.fused_head=true does not run on torch {torch_version()}: its "
            "weight pass cannot differentiate through the fused head (a custom autograd Function); set "
            "train.fused_head=false, use pp_schedule='interleaved_1f1b', or upgrade torch to 2.12 or newer"
        )
    return None


def ep_problem(m: ModelArgs, ep: int, dp_shard: int, cp: int, moe_tp: int) -> str | None:
    """Why expert parallelism of degree ep cannot split this model in this layout (None: it can): its ranks
    are ranks of one FSDP shard group that hold different tokens, dp_shard x cp (x tp for an MoE block)."""
    if ep == 1:
        return None
    ranks = dp_shard * cp * moe_tp
    if ranks % ep:
        ok = [d for d in range(1, ranks + 1) if ranks % d == 0]
        return (
            f"parallel.ep_degree={ep} must divide dp_shard x cp x tp = {ranks} (the expert-parallel ranks are "
            f"ranks of one FSDP shard group that hold different tokens); choose ep_degree in {ok}, or raise "
            "parallel.dp_shard_degree"
        )
    return None


def batch_problem(global_batch: int, dp: int, micro_batch_size: int) -> str | None:
    """Why the global batch cannot be split over dp data-parallel ranks and then into micro-batches of
    micro_batch_size sequences (0: no accumulation) (None: it can)."""
    if global_batch % dp:
        return (
            f"train.global_batch_size={global_batch} is not divisible by the data-parallel degree {dp} "
            f"(dp_replicate x dp_shard); use a multiple of {dp}"
        )
    local = global_batch // dp
    if micro_batch_size and local % micro_batch_size:
        return (
            f"the per-rank batch {local} (train.global_batch_size / {dp} data-parallel ranks) is not a multiple "
            f"of train.micro_batch_size={micro_batch_size}"
        )
    return None


def pipeline_problem(
    m: ModelArgs, pp: int, schedule: str, virtual: int, local: int, micro_batch_size: int, fused_head: bool
) -> str | None:
    """Why this pipeline cannot run (None: it can, or there is none): the schedule's stages per rank, the
    stages against the model's blocks, the micro-batches each schedule needs, the model (pp_problem) and this
    torch (schedule_problem)."""
    if virtual < 1:
        return "parallel.pp_virtual_stages must be at least 1"
    if schedule in ("gpipe", "1f1b") and virtual != 1:
        return (
            f"parallel.pp_schedule='{schedule}' runs one stage per rank: set parallel.pp_virtual_stages=1 "
            f"or use pp_schedule='interleaved_1f1b'"
        )
    if pp == 1:
        return None
    stages = pp * virtual
    if m.n_layers < stages:
        return (
            f"model.n_layers={m.n_layers} is fewer than the pipeline stages pp_degree x pp_virtual_stages "
            f"= {stages}; lower parallel.pp_degree or parallel.pp_virtual_stages"
        )
    micro = num_micro_batches(micro_batch_size, local, stages)
    if local % micro:
        return (
            f"the per-rank batch {local} cannot be split into {micro} pipeline micro-batches; set "
            f"train.micro_batch_size to a divisor of {local}"
        )
    if schedule != "gpipe" and micro < pp:
        return (
            f"pp_schedule='{schedule}' needs at least pp_degree={pp} micro-batches, got {micro}; "
            f"lower train.micro_batch_size or raise train.global_batch_size"
        )
    if schedule == "interleaved_1f1b" and micro % pp:
        return f"interleaved_1f1b needs the micro-batch count ({micro}) to be a multiple of pp_degree={pp}"
    return pp_problem(m, pp) or schedule_problem(schedule, fused_head)


def reduce_every_micro_batch_problem(asked: bool, fsdp: bool, pp: int, schedule: str) -> str | None:
    """Why parallel.fsdp_reduce_every_micro_batch cannot apply (None: it can, or it is not asked)."""
    if not asked:
        return None
    if not fsdp:
        return (
            "parallel.fsdp_reduce_every_micro_batch=true needs FSDP, which this layout does not use (no data "
            "parallelism, no cpu_offload): there are no gradients to reduce; set it false"
        )
    if pp > 1 and schedule == "zero_bubble":
        return (
            "parallel.fsdp_reduce_every_micro_batch=true with pp_schedule='zero_bubble' is refused: that "
            "schedule computes weight gradients apart from their backward, so they accumulate unsharded; "
            "use pp_schedule='interleaved_1f1b' or set it false"
        )
    return None
