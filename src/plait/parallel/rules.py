"""Every rule of a parallel layout, written once: which degrees can split this model and sequence, how a batch
divides over ranks and micro-batches, what a pipeline schedule needs, when FSDP wraps the model, and the layouts
that compiled blocks (compile_problem) and LoRA adapters (lora_problem) run in.

The runtime's check before any worker starts (plait.parallel.dims.validate_layout), the planner's search over
candidate layouts (plait.planner.search) and its cost model all call these. The element-wise ones (tp_whole,
fsdp_enabled) take plain values or numpy columns of candidate layouts alike, so the planner's vectorised form
is these functions, not a second encoding of them. One exception: reduce_every_micro_batch_problem is a
per-layout choice the search filters its numpy columns by (plait.planner.search.enumerate_layouts), keeping
it only where FSDP accumulates: a subset of what the rule allows.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from plait.core.torch_private import compile_with_tp_works, torch_version, weight_pass_takes_custom_functions

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
    """Why this torch cannot run a pipeline schedule with this head (None: it can). The runtime's check calls it
    through pipeline_problem; the planner's search through pipeline_problem too, and before that to leave such
    schedules out of its candidates (plait.planner.search), so `--layout auto` never picks a schedule the run
    would refuse (tests/parallel/test_parallel.py checks both)."""
    if schedule == "zero_bubble" and fused_head and not weight_pass_takes_custom_functions():
        return (
            f"pp_schedule='zero_bubble' with train.fused_head=true does not run on torch {torch_version()}: its "
            "weight pass cannot differentiate through the fused head (a custom autograd Function); set "
            "train.fused_head=false, use pp_schedule='interleaved_1f1b', or upgrade torch to 2.12 or newer"
        )
    return None


def ep_problem(m: ModelArgs, ep: int, dp_shard: int, cp: int, moe_tp: int) -> str | None:
    """Why expert parallelism of degree ep cannot split this model in this layout (None: it can): each ep rank
    holds an equal share of the experts, and its ranks are ranks of one FSDP shard group that hold different
    tokens, dp_shard x cp (x tp for an MoE block)."""
    if ep == 1:
        return None
    if not m.moe_experts:
        return (
            f"parallel.ep_degree={ep} splits a mixture of experts, but this model is dense "
            "(model.moe_experts=0); set parallel.ep_degree=1, or choose an MoE model (e.g. model.preset=moe-debug)"
        )
    if m.moe_experts % ep:
        ok = [d for d in range(1, m.moe_experts + 1) if m.moe_experts % d == 0]
        return (
            f"parallel.ep_degree={ep} must divide model.moe_experts={m.moe_experts} (each ep rank holds "
            f"an equal share of the experts); choose ep_degree in {ok}"
        )
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


def stages_problem(schedule: str, virtual: int) -> str | None:
    """Why a schedule cannot run this many stages per rank (None: it can); `plait plan --config` refuses a
    pinned pair with it, as the run does."""
    if virtual < 1:
        return "parallel.pp_virtual_stages must be at least 1"
    if schedule in ("gpipe", "1f1b") and virtual != 1:
        return (
            f"parallel.pp_schedule='{schedule}' runs one stage per rank: set parallel.pp_virtual_stages=1 "
            f"or use pp_schedule='interleaved_1f1b'"
        )
    return None


def pipeline_problem(
    m: ModelArgs, pp: int, schedule: str, virtual: int, local: int, micro_batch_size: int, fused_head: bool
) -> str | None:
    """Why this pipeline cannot run (None: it can, or there is none): the schedule's stages per rank, the
    stages against the model's blocks, the micro-batches each schedule needs, the model (pp_problem) and this
    torch (schedule_problem)."""
    problem = stages_problem(schedule, virtual)
    if problem or pp == 1:
        return problem
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


def compile_problem(compiled: bool, moe: bool, tp: int, cp: int, pp: int, ep: int, schedule: str) -> str | None:
    """Why compiled blocks cannot run in this layout (None: they can, or nothing is compiled): the runtime's
    check, the planner's search and the agreement test share it, so `--layout auto` with compile.enabled never
    picks a layout the run refuses."""
    if not compiled:
        return None
    if tp > 1 and not compile_with_tp_works():
        return (
            f"compile.enabled=true with parallel.tp_degree={tp} is refused on torch {torch_version()}: "
            "torch.compile with tensor parallelism is broken in it (TP alone fails in backward with \"'Tensor' "
            "object has no attribute '_local_tensor'\"; FSDP2 + TP trains on wrong gradients); torch 2.11 "
            "compiles it correctly. Set parallel.tp_degree=1 or compile.enabled=false, or use torch 2.11"
        )
    if pp > 1 and schedule == "zero_bubble":
        return (
            "compile.enabled=true with parallel.pp_schedule='zero_bubble' is refused: zero-bubble splits each "
            "stage's backward into separate input- and weight-gradient passes, not verified through compiled "
            "blocks (plait's compile tests run 1f1b); use pp_schedule='1f1b', or compile.enabled=false"
        )
    if not moe:
        return None
    # Compiled MoE blocks run their experts as grouped matmuls with static shapes; each of these degrees needs
    # something inside the block that a graph cannot hold.
    for name, degree, why in (
        ("ep_degree", ep, "the all-to-all's split sizes are read on the host in every block"),
        ("tp_degree", tp, "the balancing loss sums routing counts over the ranks inside the block"),
        ("cp_degree", cp, "the balancing loss sums routing counts over the ranks inside the block"),
        ("pp_degree", pp, "a stage's shape inference runs the blocks without counting (a recompile)"),
    ):
        if degree > 1:
            return (
                f"compile.enabled=true with a mixture-of-experts model and parallel.{name}={degree} is not "
                f"supported yet ({why}); compiled MoE runs on data-parallel layouts (DDP, FSDP, HSDP): set "
                f"parallel.{name}=1 or compile.enabled=false"
            )
    return None


def optimizer_problem(muon: bool, offload: bool) -> str | None:
    """Why this optimizer cannot run in this layout (None: it can): Muon orthogonalises its matrices where the
    optimizer steps, which CPU offload puts on the host's cores."""
    if muon and offload:
        return (
            "optim.name='muon' with parallel.cpu_offload=true is refused: the Newton-Schulz iterations would run "
            "on the host's cores (for llama3-8b about 1e15 FLOPs a step, minutes on a CPU); use AdamW with "
            "offload (optim.state_dtype='bf16' saves a further 4 bytes a parameter), or Muon on more devices"
        )
    return None


def lora_problem(lora_rank: int, tp: int, pp: int) -> str | None:
    """Why LoRA adapters cannot train in this layout (None: they can, or there are none): the adapters are
    plain parameters beside the frozen weight, which TP's plans and the pipeline's stage split do not cover."""
    if lora_rank and (tp > 1 or pp > 1):
        return (
            f"finetune.lora_rank={lora_rank} runs on one process or data parallel (DDP/FSDP/HSDP), not with "
            f"parallel.tp_degree={tp} x parallel.pp_degree={pp}: set parallel.tp_degree=1 and "
            "parallel.pp_degree=1"
        )
    return None


def replicas_problem(
    fault_tolerant: bool,
    dp_replicate: int,
    own_data: bool,
    mixture: bool,
    rollback: bool,
    min_replicas: int,
    lighthouse: str = "http://-:0",
) -> str | None:
    """Why a fault-tolerant run (parallel.fault_tolerant) cannot run as set (None: it can, or it is not one). The
    replica groups are the data-parallel replicas; each places its batch in one sample stream by the count of
    committed batches, which plait's token loader does (your own samples and mixtures do not yet); and a group
    must not roll back alone to a checkpoint its peers never saw."""
    if not fault_tolerant:
        return None
    if dp_replicate > 1:
        return (
            f"parallel.dp_replicate_degree={dp_replicate} with parallel.fault_tolerant=true: the replica groups are "
            "the data-parallel replicas; set dp_replicate_degree=1 and start R groups (plait train --replicas R)"
        )
    if own_data or mixture:
        what = "your own data= samples" if own_data else "a mixture (data.sources)"
        return (
            f"parallel.fault_tolerant=true reads plait's token stream by the count of committed batches; {what} "
            "cannot be placed that way yet: train on one prepared directory (data.source)"
        )
    if rollback:
        return (
            "guard.nonfinite_policy='rollback' with parallel.fault_tolerant=true would roll one group back alone; "
            "use 'skip' (the step is then not committed by any group) or 'stop'"
        )
    if min_replicas < 1:
        return f"parallel.min_replicas={min_replicas} must be at least 1"
    if not re.fullmatch(r"https?://[^\s/:]+:\d{1,5}/?", lighthouse):
        return (
            f"parallel.fault_tolerant=true needs a lighthouse at http://HOST:PORT (parallel.lighthouse="
            f"{lighthouse!r}): start the groups with `plait train --replicas R` (it starts one), or start one with "
            "`plait lighthouse` and set parallel.lighthouse"
        )
    return None


def diloco_problem(
    fault_tolerant: bool,
    sync_every: int,
    checkpoint_every: int,
    steps: int,
    outer_lr: float = 0.7,
    outer_momentum: float = 0.9,
) -> str | None:
    """Why DiLoCo (parallel.diloco_sync_every) cannot run as set (None: it can, or it is off). Its rounds are
    the commit unit of a fault-tolerant run, and a checkpoint is taken where a round ends (its weights are then
    the groups' common ones)."""
    if sync_every < 0:
        return f"parallel.diloco_sync_every={sync_every} must be 0 (off) or a number of steps"
    if sync_every > 1 and not fault_tolerant:
        return (
            f"parallel.diloco_sync_every={sync_every} averages across replica groups: set parallel.fault_tolerant=true "
            "and start the groups with `plait train --replicas R`"
        )
    if sync_every > 1 and not outer_lr > 0:
        return f"parallel.diloco_outer_lr={outer_lr} must be above 0 (the paper's 0.7)"
    if sync_every > 1 and not 0 <= outer_momentum < 1:
        return f"parallel.diloco_outer_momentum={outer_momentum} must be in [0, 1) (the paper's 0.9; 0: no momentum)"
    for setting, value in (("checkpoint.every_steps", checkpoint_every), ("train.steps", steps)):
        if sync_every > 1 and value % sync_every:
            return (
                f"{setting}={value} must be a multiple of parallel.diloco_sync_every={sync_every}: checkpoints "
                "and the run's end fall where a round ends, when the groups hold the same weights"
            )
    return None
