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
from plait.core.torch_private import flatten_mesh, merge_inner_axes, unflatten_mesh
from plait.parallel import rules
from plait.parallel.rules import (
    batch_problem,
    compile_problem,
    cp_problem,
    diloco_problem,
    ep_problem,
    lora_problem,
    optimizer_problem,
    pipeline_problem,
    reduce_every_micro_batch_problem,
    replicas_problem,
    tp_problem,
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

    # The rules themselves live in plait.parallel.rules (one definition, shared with the planner): these read
    # them for this layout.
    tp_whole = property(lambda self: bool(rules.tp_whole(self.tp, self.moe, self.qk_norm)))
    fsdp_enabled = property(lambda self: bool(rules.fsdp_enabled(self.dp_cp, self.ep, self.tp_whole, self.cpu_offload)))

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


def validate_layout(cfg: Config, dims: ParallelDims) -> None:
    """Refuse layouts that cannot work, before any worker starts; each message names the setting to change.
    Every rule is one of plait.parallel.rules, which the planner's search applies to its candidates too."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    problem = (
        tp_problem(m, cfg.data.seq_len, dims.tp)
        or cp_problem(m, cfg.data.seq_len, dims.cp, dims.tp)
        or ep_problem(m, dims.ep, dims.dp_shard, dims.cp, dims.moe_tp)
        or batch_problem(t.global_batch_size, dims.dp, t.micro_batch_size)
        or reduce_every_micro_batch_problem(p.fsdp_reduce_every_micro_batch, dims.fsdp_enabled, dims.pp, p.pp_schedule)
        or pipeline_problem(
            m, dims.pp, p.pp_schedule, p.pp_virtual_stages, t.global_batch_size // dims.dp, t.micro_batch_size,
            t.fused_head,
        )
        or compile_problem(cfg.compile.enabled, bool(m.moe_experts), dims.tp, dims.cp, dims.pp, dims.ep, p.pp_schedule)
        or lora_problem(cfg.finetune.lora_rank, dims.tp, dims.pp)
        or optimizer_problem(cfg.optim.name == "muon", p.cpu_offload)
        or replicas_problem(
            p.fault_tolerant, dims.dp_replicate, False, bool(cfg.data.sources),
            cfg.guard.nonfinite_policy == "rollback", p.min_replicas,
            p.lighthouse,
        )
        or diloco_problem(
            p.fault_tolerant, p.diloco_sync_every, cfg.checkpoint.every_steps, cfg.train.steps, p.diloco_outer_lr,
            p.diloco_outer_momentum,
        )
    )  # fmt: skip
    if problem:
        raise ConfigError(problem)
