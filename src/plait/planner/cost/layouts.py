"""What the cost model prices: a workload (model, sequence, batch, precision) and columns of candidate layouts,
with the codes of their schedules and activation-checkpointing modes, and what follows from the columns."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from plait.model.args import ModelArgs
from plait.parallel.rules import fsdp_enabled
from plait.parallel.rules import tp_whole as rules_tp_whole

SCHEDULES = ("none", "gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
"""Pipeline schedules by code; 'none' is a layout without a pipeline (pp = 1)."""

AC_MODES = ("none", "selective", "full")


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
    device: str = "cuda"
    """The device type the run computes on: the fused head's weight gradient is added by the matmul itself
    only with half-precision operands on CUDA (plait.model.head.accumulate_weight_grad); elsewhere the chunk's
    product is a temporary first."""
    moment_bytes: int = 4
    """Bytes of each of AdamW's two moments per parameter: 4 (fp32), or 2 (optim.state_dtype = "bf16")."""
    compiled: bool = False
    """compile.enabled: the search offers only layouts compiled blocks run in (rules.compile_problem)."""
    lora_rank: int = 0
    """finetune.lora_rank: the search offers only layouts adapters train in (rules.lora_problem)."""
    muon: bool = False
    """optim.name = "muon": one momentum buffer for the blocks' matrices instead of two moments, the whole
    matrices each rank orthogonalises, and Newton-Schulz and its exchange in the step (cost.muon)."""
    replica_groups: int = 1
    """Fault-tolerant replica groups (parallel.fault_tolerant, `plait train --replicas`): the layout is one group's,
    and each rank averages its gradient shard with its peers of the other groups over the nodes' network."""
    sync_every: int = 1
    """parallel.diloco_sync_every: the groups average once per this many steps (DiLoCo), else every step."""

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


NO_AC, SELECTIVE_AC, FULL_AC = (AC_MODES.index(m) for m in AC_MODES)

NO_PIPELINE, GPIPE, ONE_F_ONE_B, INTERLEAVED, ZERO_BUBBLE = (SCHEDULES.index(s) for s in SCHEDULES)


@dataclass
class Columns:
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
    def of(cls, work: Workload, lay: Layouts) -> Columns:
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
