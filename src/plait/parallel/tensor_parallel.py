"""Tensor and sequence parallelism of plait's Transformer: a plan (module name -> parallel style) per block,
applied with torch's `parallelize_module`; the embedding row-split over the vocabulary, the output
column-split with its logits left sharded for loss-parallel cross-entropy (plait.parallel.head), and RETRO's
encoder and chunked cross-attention (apply_tp_retrieval). The first step of `plait.parallel.parallelize`.

Under sequence parallelism the activations between blocks are sharded on the sequence dim (B, T/tp, dim); a
block's norms gather them whole for the column-parallel projections and its row-parallel projections
reduce-scatter back to sequence shards."""

from __future__ import annotations

from functools import partial
from typing import cast

from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from plait.model.llama import Transformer
from plait.model.moe import MoE


def tp_plan_block(moe: bool = False) -> dict[str, ParallelStyle]:
    """Per block: norms run sequence-parallel (activations sharded on the sequence dim) and their output is
    gathered (all-gather: see gather_norm_outputs) for the column-parallel projections; the row-parallel ones
    reduce-scatter back to sequence shards. Two all-gathers and two reduce-scatters of (B, T, dim) per block
    and pass. The gather sits on the norm, not on the attention / MLP module, so that selective recompute
    (plait.parallel.activation_checkpoint) can redo it in backward from the sequence shard instead of keeping
    the gathered tensor.

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
    if model.neighbour_pointer is not None:  # replicated too: every tp rank points for every token alike
        distribute_module(model.neighbour_pointer, tp_mesh)


def _gather_whole(module, args, output):
    return output.redistribute(placements=[Replicate()]).to_local()  # the all-gather, as a plain tensor


def _sequence_shard_input(module, args, *, mesh):
    x, *rest = args
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, [Shard(1)], run_check=False)
    return (x, *rest)
