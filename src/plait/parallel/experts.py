"""Expert parallelism: each MoE block's experts split over the ep ranks, tokens sent to their experts and back
by all-to-all.

The model's experts compute through one seam, ``Experts.grouped(x, counts)``: the tokens of this rank grouped
by expert (counts[e] for expert e, all E experts). Here that seam becomes:

1. dispatch: the counts go to every ep rank (a small all-to-all), then the tokens themselves, each rank
   receiving, from every rank, the tokens for its own E / ep experts (rows ordered by source, then expert);
2. the local experts run on their tokens (regrouped by expert: every source's tokens for expert 0, ...);
3. combine: the results go back by the reverse all-to-all, arriving in the order they left, which is the
   order ``grouped`` promises.

Dropless: every token reaches every expert it picked, however unbalanced the routing (no capacity factor,
no padding); the price of an imbalance is time on the busiest rank, which moe/load_imbalance shows.

The expert weights are DTensors sharded on the expert dimension over the ep mesh (FSDP2 shards them further
over ep_shard: plait.parallel.fsdp.apply_fsdp). Their gradients arrive summed over the ep ranks' tokens
(the all-to-all's backward brings every rank's share to the expert's owner) and FSDP then averages over
ep_shard, so they are scaled by 1 / ep on the way in (tp / ep where tp ranks hold different tokens of an MoE
block: plait.parallel.dims): the mean over all data-parallel ranks, as for every other parameter.
"""

from __future__ import annotations

from functools import partial
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from plait.model.moe import Experts, MoE, swiglu_experts
from plait.parallel.dims import Meshes
from plait.parallel.env import register_group, registered_group


def apply_moe_layout(model: nn.Module, meshes: Meshes) -> None:
    """The mixture-of-experts blocks of a model (on meta) in this layout: where sequences are split over ranks
    (cp, and tp: see plait.parallel.dims) each block's balancing loss sums its routing counts over them;
    with ep > 1 its experts are split over the ep ranks and routed to by all-to-all."""
    dims = meshes.dims
    for module in model.modules():
        if isinstance(module, MoE) and (dims.cp > 1 or dims.moe_tp > 1):
            setattr(module, "sequence_counts", partial(_summed, group=meshes.sequence.get_group()))  # noqa: B010 - shadows the method
        if isinstance(module, Experts) and dims.ep > 1:
            apply_ep(module, meshes.ep, grad_scale=dims.moe_tp / dims.ep)


def _summed(counts: torch.Tensor, group) -> torch.Tensor:
    counts = counts.clone()
    dist.all_reduce(counts, group=group)
    return counts


def apply_ep(experts: Experts, ep_mesh, grad_scale: float) -> None:
    """Split the experts over ep_mesh (on meta) and route through it. grad_scale: what the all-to-all's sum
    over the ep ranks' tokens is multiplied by so that FSDP's mean over the other ranks gives the step's mean
    gradient (1 / ep; tp / ep where the tp ranks hold different tokens)."""
    for name, param in list(experts.named_parameters(recurse=False)):
        local = param.detach().chunk(ep_mesh.size(), dim=0)[ep_mesh.get_local_rank()]
        sharded = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
        experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
    setattr(experts, "grouped", partial(_expert_parallel, experts, ep_mesh, grad_scale))  # noqa: B010 - shadows the method


def _expert_parallel(
    experts: Experts, ep_mesh, grad_scale: float, x: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    ep, group = ep_mesh.size(), ep_mesh.get_group()
    name = register_group(group)
    send = counts.view(ep, -1)  # tokens for each rank's experts
    # recv[s, e]: tokens from rank s for local expert e. (Filled with what is sent so that a fake process group,
    # which moves nothing, sizes a balanced exchange: plait.planner's memory checks run on one.)
    recv = send.clone()
    dist.all_to_all_single(recv, send, group=group)
    sent, got = send.tolist(), recv.tolist()  # the step's only host syncs: the split sizes
    sent_rows, got_rows = [sum(row) for row in sent], [sum(row) for row in got]
    arrived = torch.ops.plait.expert_all_to_all(x, got_rows, sent_rows, name)
    local = len(got[0])
    by_source = arrived.split([n for row in got for n in row])  # (source, expert) order
    by_expert = torch.cat([by_source[s * local + e] for e in range(local) for s in range(ep)])
    weights = [ScaleGrad.apply(cast(DTensor, w).to_local(), grad_scale) for w in (experts.w1, experts.w2, experts.w3)]
    out = swiglu_experts(by_expert, [sum(got[s][e] for s in range(ep)) for e in range(local)], *weights)
    done = out.split([got[s][e] for e in range(local) for s in range(ep)])  # (expert, source) order
    back = torch.cat([done[e * ep + s] for s in range(ep) for e in range(local)])
    return torch.ops.plait.expert_all_to_all(back, sent_rows, got_rows, name)


def all_to_all_forward(x: torch.Tensor, out_rows: list[int], in_rows: list[int], group: str) -> torch.Tensor:
    """Rows of x split by in_rows go one piece to each rank of the group; out_rows pieces arrive, in rank
    order. A torch op (plait::expert_all_to_all) so that selective activation checkpointing can keep its
    output (activation_checkpoint.SAVED_OPS) instead of sending the tokens again in the recompute."""
    out = x.new_empty((sum(out_rows), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_rows, in_rows, group=registered_group(group))
    return out


expert_all_to_all = torch.library.custom_op("plait::expert_all_to_all", all_to_all_forward, mutates_args=())


@expert_all_to_all.register_fake
def _(x, out_rows, in_rows, group):
    return x.new_empty((sum(out_rows), *x.shape[1:]))


def _setup_context(ctx, inputs, output):
    _, out_rows, in_rows, group = inputs
    ctx.rows, ctx.group = (out_rows, in_rows), group


def _backward(ctx, grad):
    out_rows, in_rows = ctx.rows
    return torch.ops.plait.expert_all_to_all(grad.contiguous(), in_rows, out_rows, ctx.group), None, None, None


expert_all_to_all.register_autograd(_backward, setup_context=_setup_context)


class ScaleGrad(torch.autograd.Function):
    """x unchanged; its gradient times `scale`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None
