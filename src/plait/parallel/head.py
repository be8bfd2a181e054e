"""The fused output head and loss (plait.model.head) under tensor parallelism: each tp rank holds a slice of the
vocabulary (the output weight column-split, Shard(0)) and, with sequence parallelism, a slice of the sequence.

Communication plan, over the tp axis, per micro-batch: one all-gather of the final norm's sequence shards
(B, T/tp, dim) before the first chunk; per chunk two all-reduces of per-token statistics (the max of the ranks'
log-sum-exps, then the sum of their exponentials with the target's logit, which one rank holds): 3 x 4 bytes
per token; one
reduce-scatter of the input gradient (B, T, dim) back to sequence shards after the last chunk (each rank's
gradient covers only its vocabulary: the sum over ranks is the gradient). The (B, T, V) logits are never
gathered, as with loss-parallel cross-entropy; the weight gradient stays a vocabulary shard.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from plait.core.collectives import all_gather_single, reduce_scatter_single
from plait.model.head import Shards, linear_cross_entropy


class VocabShards(Shards):
    """Collectives of the fused head over the tp ranks: vocabulary rows vocab_start .. + V/tp here, the
    sequence split evenly (Shard(1), as sequence parallelism lays it out)."""

    split = True

    def __init__(self, group: dist.ProcessGroup, vocab_start: int):
        self.group, self.vocab_start, self.size = group, vocab_start, dist.get_world_size(group)

    def gather(self, h: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        out = torch.empty((self.size * b, t, d), dtype=h.dtype, device=h.device)  # the shards one after another
        all_gather_single(out, h.contiguous(), group=self.group)
        return out.view(self.size, b, t, d).transpose(0, 1).flatten(1, 2)  # (B, T, dim)

    def scatter(self, grad: torch.Tensor) -> torch.Tensor:
        b, t, d = grad.shape
        parts = grad.view(b, self.size, t // self.size, d).transpose(0, 1).contiguous()  # (tp, B, T/tp, dim)
        out = torch.empty((b, t // self.size, d), dtype=grad.dtype, device=grad.device)
        reduce_scatter_single(out, parts.view(self.size * b, t // self.size, d), group=self.group)
        return out

    def max_(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group)
        return x

    def sum_(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x


def vocab_parallel_loss(
    h, weight, targets, chunk=0, *, group: dist.ProcessGroup, compiled=False, in_place=True, mixture=None
):
    """The model's head_loss under tensor parallelism: h the final norm's output (a sequence-sharded DTensor),
    weight the vocabulary-sharded output weight (a DTensor); their local tensors go through the fused head
    (to_local keeps autograd: the gradients come back as DTensors of the same layouts)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    local_w = weight.to_local() if isinstance(weight, DTensor) else weight
    local_h = h.to_local() if isinstance(h, DTensor) else h
    shards = VocabShards(group, rank * local_w.shape[0])
    assert local_w.shape[0] * size == weight.shape[0], "the vocabulary splits evenly (parallel.rules.tp_problem)"
    return linear_cross_entropy(local_h, local_w, targets, chunk, shards, compiled, in_place, mixture)


def apply_head(model, tp_mesh, chunk: int, compiled: bool, in_place: bool) -> None:
    """A Transformer's fused head at train.loss_chunk_tokens, its element-wise work compiled with the blocks
    (compile.enabled), through the vocabulary-parallel collectives of the tp axis under tensor parallelism
    (tp_mesh None: the whole vocabulary here); in_place=False under zero-bubble pipelines, whose backward
    walks the graph twice."""
    if tp_mesh is None:
        model.head_loss = partial(linear_cross_entropy, chunk=chunk, compiled=compiled, in_place=in_place)
    else:
        group = tp_mesh.get_group()
        model.head_loss = partial(vocab_parallel_loss, group=group, chunk=chunk, compiled=compiled, in_place=in_place)
