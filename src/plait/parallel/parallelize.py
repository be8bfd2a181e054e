"""Parallelise a plain Transformer from outside, in a fixed order; each step is a module of its own:

1. tensor + sequence parallel (a plan: module name -> parallel style: plait.parallel.tensor_parallel);
   loss-parallel output (the fused head's vocabulary-split collectives: plait.parallel.head); context parallel
   (ring attention over the cp axis, rotary tables at this rank's positions: plait.parallel.context); expert
   parallel (each MoE block's experts split over the ep axis: plait.parallel.experts);
2. activation checkpointing per block (none / selective / full: plait.parallel.activation_checkpoint);
3. torch.compile per block (compile.enabled: plait.parallel.compile; its caches: plait.engine.compile_cache),
   after AC so the checkpointed block is traced whole, before FSDP2 so its collectives stay outside the
   compiled graphs;
4. FSDP2 per block and at the root, with a mixed-precision policy (plait.parallel.fsdp); HSDP on a 2-D mesh
   (MiCS); expert-parallel experts on their own mesh (the shard group's ranks outside their ep group); optional
   CPU offload of parameters, gradients and optimizer state.

Then ``materialize`` (plait.parallel.materialize) allocates the sharded parameters on the device and fills them
with exactly the values the single-process model would have (same seed, same names), so parallel runs are
comparable bit for bit. A block is what plait.parallel.blocks says it is.
"""

from __future__ import annotations

import torch
from torch import nn

from plait.config import Config
from plait.core.errors import ConfigError
from plait.model.llama import Transformer
from plait.parallel.activation_checkpoint import apply_ac
from plait.parallel.blocks import blocks
from plait.parallel.compile import apply_compile
from plait.parallel.context import apply_cp
from plait.parallel.dims import Meshes
from plait.parallel.experts import apply_moe_layout
from plait.parallel.fsdp import apply_fsdp, fsdp_mp_policy
from plait.parallel.head import apply_head

# Re-exported for the callers that import them from here (plait.engine.trainable, plait.lifecycle.compress and
# .finetune); their home is plait.parallel.materialize.
from plait.parallel.materialize import load_local_shard, materialize, materialize_module  # noqa: F401
from plait.parallel.tensor_parallel import apply_tp


def parallelize(model: nn.Module, meshes: Meshes, cfg: Config, device: torch.device) -> nn.Module:
    """Apply TP/SP -> activation checkpointing -> compile -> FSDP2 to a model (or a pipeline stage of one)
    on meta."""
    dims = meshes.dims
    if dims.tp > 1 and isinstance(model, Transformer):  # (your model's tp is refused: parallelize_own)
        apply_tp(model, meshes.tp)
    if isinstance(model, Transformer) and model.output is not None:
        walks_twice = dims.pp > 1 and cfg.parallel.pp_schedule == "zero_bubble"
        tp_mesh = meshes.tp if dims.tp > 1 else None
        apply_head(model, tp_mesh, cfg.train.loss_chunk_tokens, cfg.compile.enabled, in_place=not walks_twice)
    if dims.cp > 1:
        apply_cp(model, meshes.cp)
    apply_moe_layout(model, meshes)
    if cfg.parallel.activation_checkpoint != "none":
        apply_ac(model, cfg.parallel.activation_checkpoint, dims.tp, nested_fsdp=dims.ep > 1 or dims.tp_whole)
    apply_compile(model, cfg.compile, device, fsdp=dims.fsdp_enabled)
    if dims.fsdp_enabled:
        mp = fsdp_mp_policy(cfg.train.mixed_precision, device)
        apply_fsdp(model, meshes, cfg.parallel, device, mp_policy=mp, fused_head=cfg.train.fused_head)
    return model


def parallelize_own(model: nn.Module, meshes: Meshes, cfg: Config, device: torch.device) -> nn.Module:
    """plait's plan for a model it did not write (on meta): activation checkpointing, compilation and FSDP2
    per block of `model.layers` (see plait.parallel.blocks), then the root. Tensor parallelism needs the
    model's own plan (Trainer(parallelize=...)); a setting that needs blocks on a model without them is
    refused."""
    dims = meshes.dims
    if dims.tp > 1:
        raise ConfigError(
            f"parallel.tp_degree={dims.tp}: plait's tensor-parallel plan is for its own Transformer; give your "
            "model's plan as Trainer(parallelize=fn) (fn(model, meshes, cfg, device) on the meta model), or set "
            "parallel.tp_degree=1"
        )
    if dims.cp > 1:
        raise ConfigError(
            f"parallel.cp_degree={dims.cp}: context parallelism replaces the attention of plait's own Transformer "
            "with a ring over the cp ranks; your model's attention is its own; set parallel.cp_degree=1"
        )
    if not blocks(model) and cfg.parallel.activation_checkpoint != "none":
        raise ConfigError(
            f"parallel.activation_checkpoint={cfg.parallel.activation_checkpoint}: your model has no blocks to "
            "checkpoint (plait looks for model.layers, an nn.ModuleList or nn.ModuleDict); set it to none"
        )
    return parallelize(model, meshes, cfg, device)
