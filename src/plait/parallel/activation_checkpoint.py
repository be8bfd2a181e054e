"""Activation checkpointing per block (parallel.activation_checkpoint: none / selective / full), the second
step of `plait.parallel.parallelize`: after tensor parallelism (so a recomputed region redoes its sequence
parallel all-gathers), before compilation (so the checkpointed block is traced whole) and FSDP2. What it keeps
is measured by plait.parallel.activations and modelled by plait.planner.cost.activations."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from plait.core import torch_private
from plait.core.torch_private import count_only_saved_ops
from plait.model.args import recompute_units_pay
from plait.model.llama import TransformerBlock
from plait.model.mlp import FeedForward
from plait.parallel import context, experts  # noqa: F401 - they register plait's custom ops that SAVED_OPS names
from plait.parallel.activations import track_sac_cache
from plait.parallel.blocks import blocks

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
    see plait.parallel.fsdp.apply_fsdp), whose hooks run inside the regions: they count only the ops they keep
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
