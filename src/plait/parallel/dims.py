"""The parallel layout: validated degrees, one named DeviceMesh, and purpose-named sub-meshes.

Mesh axes, outermost first: ``pp`` (pipeline stages), ``dp_replicate`` (HSDP replicas: MiCS groups),
``dp_shard`` (FSDP shard group: the MiCS partition group), ``cp`` (context parallel: each rank a part of every
sequence), ``tp`` (tensor + sequence parallel, innermost so its heavy traffic stays inside a node). Every axis
exists even with degree 1, so code never branches on which axes are present.

Context parallelism is folded into FSDP (as torchtitan does): the ranks of a cp group hold different tokens
of the same sequences, so their gradients are reduced together with the data-parallel ones, and parameters
are sharded over dp_shard x cp.

A mixture-of-experts block under tensor parallelism is not split by tp: it runs on each tp rank's sequence
shard (the layout sequence parallelism leaves between blocks), so for it the tp ranks are more ranks with
different tokens, like cp's; its parameters are FSDP-sharded over dp_shard x cp x tp ("tokens").

Expert parallelism borrows its ranks from those: dp_shard x cp (x tp) splits into (ep_shard, ep), ep
innermost. The experts are split over ep (each rank its share, tokens sent to them by all-to-all) and
FSDP-sharded over ep_shard; every other parameter is sharded as before. The ep ranks hold different tokens,
so no rank computes anything twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

from plait.config import Config, ParallelConfig
from plait.core.errors import ConfigError
from plait.core.torch_private import (
    flatten_mesh,
    merge_inner_axes,
    torch_version,
    unflatten_mesh,
    weight_pass_takes_custom_functions,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from plait.model.args import ModelArgs

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    cpu_offload: bool = False  # FSDP2's offload policy: FSDP2 then applies at any dp, 1 included
    cp: int = 1
    ep: int = 1  # a split of dp_shard x cp (x tp), not a further factor of the world
    moe: bool = False  # the model has mixture-of-experts blocks
    qk_norm: bool = False  # the model normalises queries and keys per head (Qwen3)

    @classmethod
    def from_config(cls, cfg: ParallelConfig, world_size: int, model: ModelArgs | None = None) -> ParallelDims:
        """Resolve dp_shard=-1 to what the other degrees leave of the world, and check the product. model: the
        model's parts that tensor parallelism runs whole (mixture-of-experts blocks, q/k norms) change how
        their gradients are reduced (`tp_whole`)."""
        if cfg.cp_degree < 1:
            raise ConfigError(f"parallel.cp_degree={cfg.cp_degree} must be at least 1 (1: no context parallelism)")
        fixed = cfg.dp_replicate_degree * cfg.tp_degree * cfg.pp_degree * cfg.cp_degree
        shard = cfg.dp_shard_degree
        if shard == -1:
            if world_size % fixed:
                raise ConfigError(
                    f"world size {world_size} is not divisible by dp_replicate x cp x tp x pp = {fixed}; "
                    f"choose degrees whose product divides {world_size}, or run a multiple of {fixed} processes "
                    f"(plait train --nproc {fixed})"
                )
            shard = world_size // fixed
        dims = cls(
            cfg.dp_replicate_degree,
            shard,
            cfg.tp_degree,
            cfg.pp_degree,
            cfg.cpu_offload,
            cfg.cp_degree,
            cfg.ep_degree,
            bool(model and model.moe_experts),
            bool(model and model.qk_norm),
        )
        if dims.world_size != world_size:
            raise ConfigError(
                f"parallel degrees dp_replicate={dims.dp_replicate} x dp_shard={dims.dp_shard} x cp={dims.cp} "
                f"x tp={dims.tp} x pp={dims.pp} = {dims.world_size}, but {world_size} processes run; set "
                f"parallel.dp_shard_degree=-1 to infer it, or change --nproc"
            )
        return dims

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different batches are processed at once."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_cp(self) -> int:
        """Ranks that hold different tokens of a step (dp x cp): the loss and the gradients are averaged over
        them."""
        return self.dp * self.cp

    @property
    def moe_tp(self) -> int:
        """How many ranks split each sequence's tokens inside a mixture-of-experts block beyond cp: tp (the
        block runs on each tp rank's sequence shard), 1 for a dense model."""
        return self.tp if self.moe else 1

    @property
    def tp_whole(self) -> bool:
        """Whether tensor parallelism leaves parameters whole on every tp rank while the ranks compute different
        parts with them (an MoE block on each rank's sequence shard, q/k norms on each rank's heads), so their
        gradients are partial sums over tp: FSDP shards them over dp_shard x cp x tp and reduces them there."""
        return self.tp > 1 and (self.moe or self.qk_norm)

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP2 wraps the model where data or context parallelism shards it, where expert parallelism splits
        experts, where tensor parallelism leaves parameters whole (`tp_whole`: FSDP reduces their gradients),
        and at dp = cp = 1 where CPU offload is asked (FSDP2's offload policy is how parameters, gradients and
        optimizer state live on the CPU)."""
        return self.dp_cp > 1 or self.cpu_offload or self.ep > 1 or self.tp_whole

    def describe(self) -> str:
        """The degrees as one line for logs and reports."""
        cp = f" cp={self.cp}" if self.cp > 1 else ""
        ep = f" ep={self.ep}" if self.ep > 1 else ""
        return f"pp={self.pp} dp_replicate={self.dp_replicate} dp_shard={self.dp_shard}{cp} tp={self.tp}{ep}"

    def build_mesh(self, device_type: str) -> DeviceMesh:
        from torch.distributed.device_mesh import init_device_mesh

        shape = (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)
        return init_device_mesh(device_type, shape, mesh_dim_names=AXES)


class Meshes:
    """Sub-meshes by purpose, cut from the one world mesh."""

    def __init__(self, mesh: DeviceMesh, dims: ParallelDims):
        self.world = mesh
        self.dims = dims

    @classmethod
    def build(cls, dims: ParallelDims, device_type: str) -> Meshes:
        return cls(dims.build_mesh(device_type), dims)

    @cached_property
    def batch(self) -> DeviceMesh:
        """Ranks that see different data (data loading, loss averaging): dp_replicate x dp_shard, flattened."""
        return flatten_mesh(self.world["dp_replicate", "dp_shard"], "batch")

    @cached_property
    def loss(self) -> DeviceMesh:
        """Ranks that hold different tokens (dp_replicate x dp_shard x cp, flattened): the loss's token count
        and mean are reduced over them."""
        return flatten_mesh(self.world["dp_replicate", "dp_shard", "cp"], "loss")

    @cached_property
    def fsdp(self) -> DeviceMesh:
        """FSDP2's mesh: 1-D shard group (dp_shard, merged with cp under context parallelism), or 2-D
        (dp_replicate, shard group) for HSDP."""
        if self.dims.cp > 1:
            if self.dims.dp_replicate > 1:
                return merge_inner_axes(self.world, "dp_replicate", ("dp_shard", "cp"), "dp_shard_cp")
            return flatten_mesh(self.world["dp_shard", "cp"], "dp_shard_cp")
        if self.dims.dp_replicate > 1:
            return self.world["dp_replicate", "dp_shard"]
        return self.world["dp_shard"]

    @cached_property
    def _data_tp(self) -> DeviceMesh:
        return flatten_mesh(self.world["dp_replicate", "dp_shard", "cp", "tp"], "dp_cp_tp")

    @cached_property
    def tokens(self) -> DeviceMesh:
        """Ranks that hold different tokens of a step inside a mixture-of-experts block: the loss ranks, and
        tp's too (`ParallelDims.moe_tp`). Routing statistics are summed over them."""
        return self.loss if self.dims.moe_tp == 1 else self._data_tp

    @cached_property
    def sequence(self) -> DeviceMesh:
        """Ranks that hold parts of the same sequences inside a mixture-of-experts block: cp, and tp under
        `moe_tp`. Its sequence-wise balancing loss sums their routing counts."""
        if self.dims.cp > 1 and self.dims.moe_tp > 1:
            return flatten_mesh(self.world["cp", "tp"], "cp_tp")
        return self.world["tp"] if self.dims.moe_tp > 1 else self.world["cp"]

    def _split_tokens(self, ep: int, names: tuple[str, str, str]) -> DeviceMesh:
        """`tokens` as (replicas, shard, ep): its dp_replicate part, and the rest split in two, ep innermost
        (neighbouring ranks, as cp and tp are)."""
        d = self.dims
        return unflatten_mesh(self.tokens, (d.dp_replicate, self.tokens.size() // d.dp_replicate // ep, ep), names)

    @cached_property
    def _experts(self) -> DeviceMesh:
        return self._split_tokens(self.dims.ep, ("ep_replicate", "ep_shard", "ep"))

    @property
    def ep(self) -> DeviceMesh:
        """The ranks one MoE block's experts are split over (all-to-all dispatch and combine)."""
        return self._experts["ep"]

    @property
    def experts_fsdp(self) -> DeviceMesh:
        """FSDP2's mesh for expert-parallel experts: the rest of the token ranks (ep_shard), or (ep_replicate,
        ep_shard) under HSDP."""
        if self.dims.dp_replicate > 1:
            return self._experts["ep_replicate", "ep_shard"]
        return self._experts["ep_shard"]

    @cached_property
    def fsdp_tp(self) -> DeviceMesh:
        """FSDP2's mesh for parameters tensor parallelism leaves whole (`ParallelDims.tp_whole`): dp_shard x cp
        x tp, (dp_replicate, that) under HSDP."""
        if self.dims.dp_replicate > 1:
            shard = self._data_tp.size() // self.dims.dp_replicate
            return unflatten_mesh(self._data_tp, (self.dims.dp_replicate, shard), ("tp_replicate", "tp_shard"))
        return self._data_tp

    @property
    def cp(self) -> DeviceMesh:
        return self.world["cp"]

    @property
    def tp(self) -> DeviceMesh:
        return self.world["tp"]

    @property
    def pp(self) -> DeviceMesh:
        return self.world["pp"]

    @property
    def dp_rank(self) -> int:
        return self.batch.get_local_rank()


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
    return None


def cp_problem(m: ModelArgs, seq_len: int, cp: int, tp: int = 1) -> str | None:
    """Why context parallelism of degree cp cannot split this sequence (None: it can); shared like tp_problem.
    Each rank holds two of 2 x cp equal chunks (a head one and its mirror from the tail, so that causal
    attention costs every rank the same), and under sequence parallelism its part splits again by tp."""
    if cp == 1:
        return None
    if seq_len % (2 * cp):
        ok = [c for c in range(1, cp + 1) if seq_len % (2 * c) == 0]
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


def ep_problem(m: ModelArgs, dims: ParallelDims) -> str | None:
    """Why expert parallelism of degree dims.ep cannot split this model in this layout (None: it can); shared
    like tp_problem."""
    if dims.ep == 1:
        return None
    ranks = dims.dp_shard * dims.cp * dims.moe_tp
    if ranks % dims.ep:
        ok = [d for d in range(1, ranks + 1) if ranks % d == 0]
        return (
            f"parallel.ep_degree={dims.ep} must divide dp_shard x cp x tp = {ranks} (the expert-parallel ranks are "
            f"ranks of one FSDP shard group that hold different tokens); choose ep_degree in {ok}, or raise "
            "parallel.dp_shard_degree"
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


def validate_layout(cfg: Config, dims: ParallelDims) -> None:
    """Refuse layouts that cannot work, before any worker starts; each message names the setting to change."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    problem = (
        tp_problem(m, cfg.data.seq_len, dims.tp)
        or cp_problem(m, cfg.data.seq_len, dims.cp, dims.tp)
        or ep_problem(m, dims)
    )
    if problem:
        raise ConfigError(problem)
    if t.global_batch_size % dims.dp:
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} is not divisible by the data-parallel degree "
            f"{dims.dp} (dp_replicate x dp_shard); use a multiple of {dims.dp}"
        )
    local = t.global_batch_size // dims.dp
    if t.micro_batch_size and local % t.micro_batch_size:
        raise ConfigError(
            f"the per-rank batch {local} (train.global_batch_size / {dims.dp} data-parallel ranks) is not a "
            f"multiple of train.micro_batch_size={t.micro_batch_size}"
        )
    if p.fsdp_reduce_every_micro_batch and not dims.fsdp_enabled:
        raise ConfigError(
            "parallel.fsdp_reduce_every_micro_batch=true needs FSDP, which this layout does not use (no data "
            "parallelism, no cpu_offload): there are no gradients to reduce; set it false"
        )
    virtual = p.pp_virtual_stages
    if virtual < 1:
        raise ConfigError("parallel.pp_virtual_stages must be at least 1")
    if p.pp_schedule in ("gpipe", "1f1b") and virtual != 1:
        raise ConfigError(
            f"parallel.pp_schedule='{p.pp_schedule}' runs one stage per rank: set parallel.pp_virtual_stages=1 "
            f"or use pp_schedule='interleaved_1f1b'"
        )
    if dims.pp > 1:
        stages = dims.pp * virtual
        if m.n_layers < stages:
            raise ConfigError(
                f"model.n_layers={m.n_layers} is fewer than the pipeline stages pp_degree x pp_virtual_stages "
                f"= {stages}; lower parallel.pp_degree or parallel.pp_virtual_stages"
            )
        micro = num_micro_batches(t.micro_batch_size, local, stages)
        if local % micro:
            raise ConfigError(
                f"the per-rank batch {local} cannot be split into {micro} pipeline micro-batches; set "
                f"train.micro_batch_size to a divisor of {local}"
            )
        if p.pp_schedule != "gpipe" and micro < dims.pp:
            raise ConfigError(
                f"pp_schedule='{p.pp_schedule}' needs at least pp_degree={dims.pp} micro-batches, got {micro}; "
                f"lower train.micro_batch_size or raise train.global_batch_size"
            )
        if p.pp_schedule == "interleaved_1f1b" and micro % dims.pp:
            raise ConfigError(
                f"interleaved_1f1b needs the micro-batch count ({micro}) to be a multiple of pp_degree={dims.pp}"
            )
        problem = pp_problem(m, dims.pp)
        if problem:
            raise ConfigError(problem)
        if p.fsdp_reduce_every_micro_batch and p.pp_schedule == "zero_bubble":
            raise ConfigError(
                "parallel.fsdp_reduce_every_micro_batch=true with pp_schedule='zero_bubble' is refused: that "
                "schedule computes weight gradients apart from their backward, so they accumulate unsharded; "
                "use pp_schedule='interleaved_1f1b' or set it false"
            )
        problem = schedule_problem(p.pp_schedule, cfg.train.fused_head)
        if problem:
            raise ConfigError(problem)
