"""Parallelise a plain Transformer from outside, in a fixed order:

1. tensor + sequence parallel (a plan: module name -> parallel style), loss-parallel output (the fused head's
   vocabulary-split collectives: plait.parallel.head); context
   parallel (ring attention over the cp axis, rotary tables at this rank's positions: plait.parallel.context);
   expert parallel (each MoE block's experts split over the ep axis: plait.parallel.experts);
2. activation checkpointing per block (none / selective / full);
3. torch.compile per block (compile.enabled; see plait.engine.compile_cache), after AC so the checkpointed block is
   traced whole, before FSDP2 so its collectives stay outside the compiled graphs;
4. FSDP2 per block and at the root, with a mixed-precision policy; HSDP on a 2-D mesh (MiCS); expert-parallel
   experts on their own mesh (the shard group's ranks outside their ep group);
   optional CPU offload of parameters, gradients and optimizer state.

Then ``materialize`` allocates the sharded parameters on the device and fills them with exactly the values
the single-process model would have (same seed, same names), so parallel runs are comparable bit for bit.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Callable
from functools import partial
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from plait.config import Config, ParallelConfig
from plait.core import torch_private
from plait.core.errors import ConfigError
from plait.core.torch_private import count_only_saved_ops, local_box
from plait.model.args import recompute_units_pay
from plait.model.llama import Attention, Transformer, TransformerBlock
from plait.model.mlp import FeedForward
from plait.model.moe import MoE
from plait.parallel.activations import track_sac_cache
from plait.parallel.compile import apply_compile
from plait.parallel.context import apply_cp
from plait.parallel.dims import Meshes
from plait.parallel.experts import apply_moe_layout
from plait.parallel.head import apply_head
from plait.parallel.placement import allocate


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


def tp_plan_block(moe: bool = False) -> dict[str, ParallelStyle]:
    """Per block: norms run sequence-parallel (activations sharded on the sequence dim) and their output is
    gathered (all-gather: see gather_norm_outputs) for the column-parallel projections; the row-parallel ones
    reduce-scatter back to sequence shards. Two all-gathers and two reduce-scatters of (B, T, dim) per block
    and pass. The gather sits on the norm, not on the attention / MLP module, so that selective recompute
    (apply_ac) can redo it in backward from the sequence shard instead of keeping the gathered tensor.

    A mixture of experts is not split: it runs on this rank's sequence shard as it is (no gather, no
    reduce-scatter), its parameters whole on every tp rank and reduced over the tp ranks with the
    data-parallel ones (plait.parallel.dims: `moe_tp`)."""
    plan: dict[str, ParallelStyle] = {
        "attention_norm": SequenceParallel(),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
    }
    if moe:
        plan["feed_forward"] = PrepareModuleInput(  # the norm's sequence shard as a plain tensor, as blocks pass
            input_layouts=Shard(1), desired_input_layouts=Shard(1), use_local_output=True
        )
        return plan
    plan["feed_forward.w1"] = ColwiseParallel()
    plan["feed_forward.w2"] = RowwiseParallel(output_layouts=Shard(1))
    plan["feed_forward.w3"] = ColwiseParallel()
    return plan


def _gather_sequence(module, args, output):
    return output.redistribute(placements=[Replicate()])  # Shard(1) -> Replicate: the all-gather


def gather_norm_outputs(block: nn.Module) -> None:
    """The sequence-parallel norms' outputs all-gathered for the column-parallel matmuls after them (not
    before a mixture of experts, which takes the sequence shard)."""
    for norm in (block.attention_norm, block.ffn_norm):
        if norm is block.ffn_norm and isinstance(block.feed_forward, MoE):
            continue
        cast(nn.Module, norm).register_forward_hook(_gather_sequence)


def apply_tp(model: Transformer, tp_mesh) -> None:
    """Embedding row-split over the vocabulary, output column-split with the logits left sharded on the
    vocabulary for loss-parallel cross-entropy (no all-gather of the (B, T, vocab) logits)."""
    top: dict[str, ParallelStyle] = {}
    retrieves = model.retrieval_encoder is not None
    if model.tok_embeddings is not None:
        # RETRO: the ids are the tokens followed by their neighbours'; the embedding is all-reduced whole, cut
        # into the two by the model, and each is sequence-sharded where its blocks start (apply_tp_retrieval).
        out = Replicate() if retrieves else Shard(1)
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=out)
    if model.norm is not None:
        top["norm"] = SequenceParallel()
    if model.output is not None:
        top["output"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
    # Between pipeline stages the hidden states travel as each TP rank's sequence shard (B, T/tp, dim): a
    # block returns its local shard under SP, so a stage hands on what its last block returns (TP rank j of
    # one stage talks to TP rank j of the next): 1/tp of the bytes, no gather. The receiving stage wraps the
    # shard as a sequence-sharded DTensor (so the model sees the global length, for the rotary tables) and its
    # first block takes the local shard again.
    if model.tok_embeddings is None:
        top["layers." + next(iter(model.layers))] = PrepareModuleInput(
            input_layouts=(Shard(1), None, None),
            desired_input_layouts=(Shard(1), None, None),
            use_local_output=True,
        )
        model.register_forward_pre_hook(partial(_sequence_shard_input, mesh=tp_mesh))
    if retrieves and model.tok_embeddings is not None:
        top["layers." + next(iter(model.layers))] = _shard_sequence_input()
    if top:
        parallelize_module(model, tp_mesh, top)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, tp_plan_block(moe=isinstance(block.feed_forward, MoE)))
        gather_norm_outputs(block)
    if retrieves:
        apply_tp_retrieval(model, tp_mesh)


def _shard_sequence_input() -> PrepareModuleInput:
    """A block's input (x, cos, sin) given whole on every tp rank, taken as this rank's sequence shard (a slice:
    no communication; its gradient is gathered back in backward)."""
    return PrepareModuleInput(
        input_layouts=(Replicate(), None, None), desired_input_layouts=(Shard(1), None, None), use_local_output=True
    )


def apply_tp_retrieval(model: Transformer, tp_mesh) -> None:
    """RETRO under tensor + sequence parallelism (plait.model.retrieval). The neighbours' encoder runs as the
    decoder's blocks do (the same plan: each neighbour's 2c tokens sequence-sharded), and its final norm's output
    is gathered whole: every tp rank holds all the encoded neighbours. Chunked cross-attention splits by heads:
    its norm's output is gathered whole (each chunk's queries are its tokens shifted by c - 1, across sequence
    shards), its query, key and value projections column-parallel, its output projection row-parallel with a
    reduce-scatter back to sequence shards, and its gate scales the sequence shards (a replicated scalar whose
    gradient is summed over them). Gradients reaching the encoded neighbours from each tp rank's heads are
    summed over the tp ranks by the column-parallel projections' backward."""
    encoder = model.retrieval_encoder
    assert encoder is not None
    first = next(iter(encoder.layers))
    parallelize_module(encoder, tp_mesh, {"layers." + first: _shard_sequence_input(), "norm": SequenceParallel()})
    for block in encoder.layers.values():
        parallelize_module(block, tp_mesh, tp_plan_block())
        gather_norm_outputs(block)
    encoder.norm.register_forward_hook(_gather_whole)
    cross_plan: dict[str, ParallelStyle] = {
        "cross_norm": SequenceParallel(),
        "cross.wq": ColwiseParallel(),
        "cross.wk": ColwiseParallel(),
        "cross.wv": ColwiseParallel(),
        "cross.wo": RowwiseParallel(output_layouts=Shard(1)),
        "cross.gate": SequenceParallel(use_local_output=True),  # its scalar's gradient summed over the shards
    }
    for block in model.layers.values():
        if block.cross is not None:
            parallelize_module(block, tp_mesh, cross_plan)
            cast(nn.Module, block.cross_norm).register_forward_hook(_gather_whole)
    if model.neighbour_copy is not None:  # its shares replicated: every tp rank scores every token alike
        distribute_module(model.neighbour_copy, tp_mesh)


def _gather_whole(module, args, output):
    return output.redistribute(placements=[Replicate()]).to_local()  # the all-gather, as a plain tensor


def _sequence_shard_input(module, args, *, mesh):
    x, *rest = args
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, [Shard(1)], run_check=False)
    return (x, *rest)


SAVED_OPS = frozenset(
    {
        torch.ops.aten.mm.default,
        torch.ops.aten.addmm.default,
        *torch_private.attention_kernel_ops(),  # scaled_dot_product_attention's kernels, grouped matmul
        torch.ops.plait.ring_attention.default,  # context parallel attention: keeping it saves a ring pass
        torch.ops.plait.expert_all_to_all.default,  # tokens sent to their experts and back: not sent again
    }
)
"""What selective recompute keeps: the outputs of matmuls and attention (expensive to recompute, cheap to keep
relative to the element-wise work around them); norms, activations and rotary embeddings are recomputed."""


def _selective_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def blocks(model: nn.Module) -> list[tuple[str | int, nn.Module]]:
    """The repeated blocks of a model, `model.layers` as an nn.ModuleDict or nn.ModuleList (plait's Transformer
    and most models); the unit of activation checkpointing, compilation and FSDP sharding. Empty if none."""
    layers = getattr(model, "layers", None)
    if isinstance(layers, nn.ModuleDict):
        return list(layers.items())
    if isinstance(layers, nn.ModuleList):
        return list(enumerate(layers))
    return []


def apply_ac(model: nn.Module, mode: str, tp: int = 1, nested_fsdp: bool = False) -> None:
    """full: each block recomputed whole in backward (it keeps only its input). selective: the matmul and
    attention outputs kept (_selective_policy), the element-wise work between them (norms, rotary tables,
    SiLU, the all-gathers of sequence parallelism) recomputed. On a block with recompute units (plait's:
    `attend` and `gated`, each half of the block up to its output projection) each unit is one selective
    region, so what it keeps is its input (a sequence shard under SP) and its matmul outputs, as Megatron's
    selective recompute with sequence parallelism does; the output projections keep their input as usual.
    That pays under tensor parallelism (model.args.recompute_units_pay: from tp = 2 for Llama's shapes); else,
    and on a block without units (your own model), the block is one selective region, which keeps the output
    projections' outputs instead (full-size partial sums under TP). nested_fsdp: blocks hold FSDP-sharded
    modules of their own (experts under expert parallelism, MoE blocks and q/k norms under tensor parallelism:
    see apply_fsdp), whose hooks run inside the regions: they count only the ops they keep
    (torch_private.count_only_saved_ops)."""
    contexts = partial(_selective_contexts, count_all=not nested_fsdp)
    layers = getattr(model, "layers", None)
    for name, block in blocks(model):
        if mode == "full":
            layers[name] = torch_private.checkpoint_wrapper(block, preserve_rng_state=False)  # type: ignore[index]
        elif _units_pay(block, tp):
            for unit in RECOMPUTE_UNITS:
                setattr(block, unit, partial(_recomputed, getattr(block, unit), contexts))  # shadows the method
        else:
            wrapped = torch_private.checkpoint_wrapper(block, preserve_rng_state=False, context_fn=contexts)
            layers[name] = wrapped  # type: ignore[index]  # (blocks(): a ModuleDict by name, a ModuleList by index)


RECOMPUTE_UNITS = ("attend", "gated")


def _units_pay(block: nn.Module, tp: int) -> bool:
    if not isinstance(block, TransformerBlock) or not isinstance(block.feed_forward, FeedForward):
        return False  # your own model's block, or a mixture of experts: one region
    hidden, dim = block.feed_forward.w1.weight.shape  # global shapes (DTensor under TP)
    return recompute_units_pay(dim, hidden, tp)


def _recomputed(fn, contexts, *args):
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False, context_fn=contexts)


def _selective_contexts(count_all: bool = True):
    caching, cached = create_selective_checkpoint_contexts(_selective_policy)
    if not count_all:
        count_only_saved_ops((caching, cached), SAVED_OPS)
    track_sac_cache(caching)  # counted when activation memory is being measured (plait.parallel.activations)
    return caching, cached


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


@torch.no_grad()
def load_local_shard(param: torch.Tensor, read_box: Callable[[tuple[int, ...], tuple[int, ...]], torch.Tensor]) -> None:
    """Fill this rank's shard of a parameter from ``read_box(offset, shape)``: the box of the full value that
    the shard covers (``local_box``), which the caller reads alone (a slice of a file), so no rank ever
    reads or holds another rank's part. A plain (unsharded) parameter reads the whole box."""
    if not isinstance(param, DTensor):
        param.copy_(read_box((0,) * param.dim(), tuple(param.shape)))
        return
    local = param.to_local()
    shape, offset = local_box(param)
    if local.numel() == 0:
        return
    if tuple(local.shape) != tuple(shape):
        raise RuntimeError(f"local shard {tuple(local.shape)} is not the box {tuple(shape)} torch reports")
    local.copy_(read_box(tuple(offset), tuple(shape)))


def init_local_shard(param: torch.Tensor, rows) -> None:
    """Initialise this rank's shard of a parameter from `rows(start, stop)` (the full value's rows, see
    `Transformer.init_weights`): only the rows the shard covers are drawn, then its columns cut out, so
    neither time nor memory depends on the full parameter's size beyond this rank's rows."""

    def read_box(offset: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        value = rows(offset[0], offset[0] + shape[0])
        return value[(slice(None), *(slice(o, o + n) for o, n in zip(offset[1:], shape[1:], strict=True)))]

    load_local_shard(param, read_box)


def parallelize_own(model: nn.Module, meshes: Meshes, cfg: Config, device: torch.device) -> nn.Module:
    """plait's plan for a model it did not write (on meta): activation checkpointing, compilation and FSDP2
    per block of `model.layers` (see `blocks`), then the root. Tensor parallelism needs the model's own plan
    (Trainer(parallelize=...)); a setting that needs blocks on a model without them is refused."""
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


def materialize_module(model: nn.Module, device: torch.device, *, seed: int, cpu_offload: bool = False) -> None:
    """Allocate a model built on meta (each rank its shards) and initialise it: its own init_weights() if it
    has one (which must set every parameter and buffer), else every module's reset_parameters(), run on a
    full-size copy of that module's own tensors alone, seeded by run.seed and the module's name, each rank
    keeping its shard: the same values for every layout, and never more than one module in full. seed:
    run.seed; cpu_offload: parallel.cpu_offload (FSDP2 then keeps the shards on the CPU)."""
    allocate(model, device, cpu_offload=cpu_offload)  # buffers on the device, offloaded parameters on the CPU
    if callable(getattr(model, "init_weights", None)):
        with torch.no_grad():
            getattr(model, "init_weights")()  # noqa: B009 - your model's own (nn.Module does not declare it)
        return
    buffers = [name for name, _ in model.named_buffers()]
    if buffers:
        raise ConfigError(
            f"your model has buffers ({', '.join(buffers[:3])}) that a model built on the meta device loses; give "
            "it an init_weights() method that sets them (and its parameters)"
        )
    for name, module in model.named_modules():
        if callable(getattr(module, "reset_parameters", None)):
            _reset_in_full(module, _seed(seed, name))


def _seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") >> 1


@torch.no_grad()
def _reset_in_full(module: nn.Module, seed: int) -> None:
    owners = [(m, key, p) for m in module.modules() for key, p in m.named_parameters(recurse=False)]
    full = {id(p): torch.empty(p.shape, dtype=p.dtype) for _, _, p in owners}  # global shapes, on the CPU
    try:
        torch_private.swap_parameters((m, key, nn.Parameter(full[id(p)], requires_grad=False)) for m, key, p in owners)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            getattr(module, "reset_parameters")()  # noqa: B009 - what the module defines (checked by the caller)
    finally:
        torch_private.swap_parameters(owners)
    for _, _, p in owners:
        load_local_shard(p, partial(_box_of, full[id(p)]))


def _box_of(value: torch.Tensor, offset: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
    return value[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]


def materialize(model: Transformer, device: torch.device, *, seed: int, cpu_offload: bool = False) -> None:
    """Allocate a parallelised model built on meta (each rank its own shards), then initialise it like the
    single-process model, each rank drawing only its shards' values. With CPU offload FSDP2 keeps the
    sharded parameters on the CPU, so they are allocated there (buffers stay on the device: `allocate`).
    seed: run.seed; cpu_offload: parallel.cpu_offload."""
    allocate(model, device, cpu_offload=cpu_offload)  # buffers on the device, offloaded parameters on the CPU
    model.init_weights(seed, assign=init_local_shard)
