"""FSDP2 per block and at the root, the last step of `plait.parallel.parallelize`: a mixed-precision policy
(bf16 compute, fp32 reduction), HSDP on a 2-D mesh (MiCS), optional CPU offload; the embedding and the fused
head as units gathered for their forward only; expert-parallel experts on their own mesh (the shard group's
ranks outside their ep group), and what tensor parallelism leaves whole sharded over the data and tp ranks."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from plait.config import ParallelConfig
from plait.model.llama import Attention, Transformer
from plait.model.moe import MoE
from plait.parallel.blocks import blocks
from plait.parallel.dims import Meshes


def fsdp_mp_policy(mixed_precision: str, device: torch.device) -> MixedPrecisionPolicy:
    """bf16 parameters for compute where train.mixed_precision asks (or 'auto' on a device with native bf16),
    fp32 gradient reduction always: the reduce-scatter sums in full precision."""
    from plait.core.hardware import uses_bf16

    bf16 = uses_bf16(mixed_precision, device)
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32)


def apply_fsdp(
    model: nn.Module,
    meshes: Meshes,
    p: ParallelConfig,
    device: torch.device,
    *,
    mp_policy: MixedPrecisionPolicy,
    fused_head: bool = True,
) -> None:
    """Shard each block, then the root (embedding, final norm, output). Gradient reduce-scatter over the
    shard group; under HSDP a further all-reduce across replicas (the MiCS two-hop sync). `p`: the parallel
    section (cpu_offload, fsdp_reshard_after_forward); fused_head: train.fused_head (whether the output
    projection is its own unit)."""
    offload: OffloadPolicy = OffloadPolicy()
    if p.cpu_offload:
        offload = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    warnings.filterwarnings("ignore", message=FSDP_VIEW_WARNING)
    kwargs: dict[str, Any] = dict(mesh=meshes.fsdp, mp_policy=mp_policy, offload_policy=offload)
    # Under a pipeline every micro-batch would gather the blocks again after resharding; the schedule
    # already defers the gradient reduce-scatter to the step's end, so keep parameters gathered instead.
    reshard = p.fsdp_reshard_after_forward and meshes.dims.pp == 1
    units = [block for _, block in blocks(model)]
    for i, block in enumerate(units):
        # The last block's parameters are needed again at once by backward: keep them gathered.
        unit_reshard = reshard and i < len(units) - 1
        for moe in [m for m in block.modules() if isinstance(m, MoE)]:
            _shard_moe(moe, meshes, kwargs, unit_reshard)
        for attention in [m for m in block.modules() if isinstance(m, Attention) and m.q_norm is not None]:
            if meshes.dims.tp > 1:  # each tp rank normalises its own heads with the whole weights
                _shard_over_tp([attention.q_norm, attention.k_norm], meshes, kwargs, unit_reshard)
        fully_shard(block, reshard_after_forward=unit_reshard, **kwargs)
    if reshard and isinstance(model, Transformer) and not model.args.tie_embeddings:
        _shard_embedding_and_head(model, units, kwargs, fused_head)
    # The root (final norm; and the embedding and output where they are not units of their own) is needed first
    # in backward (the output) and last (the embedding): keep it gathered through the step. (An explicit True
    # re-gathers it in every backward, measured as 25% of FSDP's traffic by bench/comm.py.)
    fully_shard(model, reshard_after_forward=False, **kwargs)


# Under tensor parallelism the embedding returns TP's to_local() view, and FSDP2 warns that an in-place op on a
# unit's view output would drop the unit's pre-backward hook. The model adds to it out of place, and the
# embedding's unit is not gathered again in backward (set_unshard_in_backward(False)).
FSDP_VIEW_WARNING = r"FSDP2-wrapped module \(FSDPEmbedding\) returned a view tensor"


def _shard_embedding_and_head(model: Transformer, blocks_: list[nn.Module], kwargs: dict, fused_head: bool) -> None:
    """The embedding, and the output under the fused head, as FSDP units gathered for their forward and not
    again in backward (FSDPModule.set_unshard_in_backward), where blocks reshard after forward and there is no
    pipeline: the whole-vocabulary weights (V h e bytes each) are no longer held from the first block's forward
    to the end of the step. Neither is needed in backward: the embedding's gradient is the incoming gradient
    scattered to rows, the fused head takes its weight gradient in forward. The same all-gathers as when the
    root kept them, one of each per micro-batch; the output's is prefetched by the last block's forward. Not
    with tied weights (one parameter in both: the root keeps it), nor the plain head's output (its backward
    multiplies by the weight right after forward: the root keeping it costs nothing more)."""
    if model.tok_embeddings is not None:
        embedding = cast(FSDPModule, fully_shard(model.tok_embeddings, reshard_after_forward=True, **kwargs))
        embedding.set_unshard_in_backward(False)
    if model.output is None or not fused_head:
        return
    output = cast(FSDPModule, fully_shard(model.output, reshard_after_forward=True, **kwargs))
    output.set_unshard_in_backward(False)
    if blocks_:
        cast(FSDPModule, blocks_[-1]).set_modules_to_forward_prefetch([output])
    model.head_loss = gathered_head(model.head_loss, output)


def gathered_head(head_loss: Callable, output) -> Callable:
    """The model's fused head_loss with its FSDP-sharded output gathered around it: the model calls the head
    with output.weight, not the module, so FSDP's forward hooks do not run; this gathers (FSDPModule.unshard,
    waiting on the last block's prefetch) and frees it again (reshard). The weight gradient the head took in
    forward reaches the unsharded parameter in backward and FSDP reduce-scatters it at the end of backward."""

    def loss(h, weight, targets, *args, **kwargs):
        output.unshard()
        try:
            return head_loss(h, output.weight, targets, *args, **kwargs)
        finally:
            output.reshard()

    return loss


def _shard_moe(moe: MoE, meshes: Meshes, kwargs: dict, reshard: bool) -> None:
    """Expert-parallel experts: FSDP over the token ranks outside their ep group (experts_fsdp). Under
    tensor parallelism the whole block (router, shared expert, experts) over the data and tp ranks."""
    dims = meshes.dims
    if dims.ep > 1:
        fully_shard(moe.experts, reshard_after_forward=reshard, **{**kwargs, "mesh": meshes.experts_fsdp})
    if dims.moe_tp > 1:
        _shard_over_tp(moe, meshes, kwargs, reshard)


def _shard_over_tp(modules, meshes: Meshes, kwargs: dict, reshard: bool) -> None:
    """FSDP for parameters that tensor parallelism leaves whole (`ParallelDims.tp_whole`) over the data and tp
    ranks (fsdp_tp): their gradients are sums over the tp ranks' parts and means over the data-parallel
    ranks', so FSDP divides by dp x cp, not by the group's size (in sums: gloo has no pre-scaled reduction)."""
    unit = fully_shard(modules, reshard_after_forward=reshard, **{**kwargs, "mesh": meshes.fsdp_tp})
    unit = unit[0] if isinstance(unit, list) else unit
    unit.set_gradient_divide_factor(float(meshes.dims.dp_cp))
    unit.set_force_sum_reduction_for_comms(True)
