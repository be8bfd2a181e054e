"""A mixture of experts in place of a block's feed-forward: top-k routing, the experts' SwiGLU weights stacked
(grouped matmuls where the device has them), optional shared experts, a load-balancing loss and
auxiliary-loss-free balancing biases. Model code only: expert parallelism is plait.parallel.experts, the
balancing bookkeeping around a step plait.engine.expert_balance.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from plait.core.torch_private import grouped_mm, grouped_mm_fits, in_backward
from plait.model.args import ModelArgs
from plait.model.mlp import FeedForward


class MoE(nn.Module):
    """Token-choice top-k mixture of SwiGLU experts (Mixtral, Qwen3-MoE, DeepSeek-V3), with an optional shared
    expert. Each token's router scores (softmax over the experts, or a sigmoid each) pick its top-k experts
    (after adding the loss-free balancing bias, which picks but never weights), whose outputs are summed with
    the scores as weights (renormalised to sum 1 if norm_topk). Experts are stacked: w1 and w3 (E, F, dim),
    w2 (E, dim, F). Computed exactly, expert by expert, on the tokens routed to each (dropless: no capacity).

    Balancing: with aux_loss > 0 the sequence-wise load-balancing loss (`_balance_loss`) is added to the
    training objective through the gradient (AuxLoss: the forward's output is unchanged), scaled by
    `aux_scale`, which the trainer sets each step so that the loss counts as the mean over the global batch's
    sequences. Training forwards add the routing counts per expert to `load` and the loss values to
    `aux_total` (buffers the trainer reads and resets each step: plait.engine.expert_balance)."""

    expert_bias: torch.Tensor  # buffers (registered below)
    load: torch.Tensor
    aux_total: torch.Tensor

    def __init__(self, args: ModelArgs):
        super().__init__()
        e, f, dim = args.moe_experts, args.expert_hidden_dim, args.dim
        self.top_k, self.score, self.norm_topk = args.moe_top_k, args.moe_score, args.moe_norm_topk
        self.aux_coef = args.moe_aux_loss
        self.router = nn.Linear(dim, e, bias=False)
        self.experts = Experts(e, dim, f)
        self.shared = FeedForward(dim, f * args.moe_shared_experts) if args.moe_shared_experts else None
        self.register_buffer("expert_bias", torch.zeros(e))  # persistent: balancing state, checkpointed
        self.register_buffer("load", torch.zeros(e), persistent=False)  # tokens routed per expert, this step
        self.register_buffer("aux_total", torch.zeros(()), persistent=False)  # summed per-sequence losses
        self.aux_scale = 1.0
        self.counting = True  # off while a pipeline stage infers its shapes (plait.parallel.pipeline)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, dim = x.shape
        tokens = x.reshape(-1, dim)
        logits = self.router(tokens).float()
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        picked = torch.topk(scores + self.expert_bias, self.top_k, dim=-1, sorted=False).indices  # (N, k)
        weights = scores.gather(-1, picked)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        out = self.experts(tokens, picked, weights.type_as(x))
        # An activation-checkpoint recompute (in backward) and a pipeline's shape inference count nothing. A
        # compiled block runs this code once per micro-batch: its recompute is inside the compiled backward.
        first_pass = self.training and self.counting and (torch.compiler.is_compiling() or not in_backward())
        if first_pass:
            with torch.no_grad():
                self.load += expert_counts(picked.flatten(), self.load.numel()).to(self.load.dtype)
        if self.aux_coef and self.training and torch.is_grad_enabled():
            aux = self._balance_loss(scores.view(bsz, seqlen, -1), picked.view(bsz, seqlen, -1))
            if first_pass:
                self.aux_total += aux.detach()
            out = AuxLoss.apply(out, aux * self.aux_scale)
        if self.shared is not None:
            out = out + self.shared(tokens)
        return out.view(bsz, seqlen, dim)

    def _balance_loss(self, scores: torch.Tensor, picked: torch.Tensor) -> torch.Tensor:
        """Summed over this micro-batch's sequences: coef x sum_e f_e P_e, f_e = E / (k T) x the picks of e in
        the sequence, P_e = the mean over its tokens of e's normalised score (DeepSeek-V3's sequence-wise loss;
        Switch Transformer's with the sequence as the batch). Written as sum_e f_e x (the scores summed over
        this part's tokens) / T with f and T from `sequence_counts`, so where the sequences are split over
        ranks each part's value is its share of the loss and of its gradient (their sum is the loss)."""
        experts = scores.shape[-1]
        counts = torch.zeros_like(scores[:, 0]).scatter_add_(
            1, picked.flatten(1), torch.ones_like(picked.flatten(1), dtype=scores.dtype)
        )  # (B, E)
        counts = self.sequence_counts(counts)
        seqlen = counts[:1].sum() / self.top_k  # every token makes top_k picks
        f = counts * experts / (self.top_k * seqlen)
        p = (scores / scores.sum(-1, keepdim=True)).sum(1) / seqlen  # (B, E)
        return self.aux_coef * (f * p).sum()

    def sequence_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """The picks per expert (B, E) of each whole sequence from those of this rank's part of it: the same
        tensor here. The seam for layouts that split sequences over ranks (context parallelism, and sequence
        parallelism through an MoE block), which sum it over them: plait.parallel.experts."""
        return counts


class Experts(nn.Module):
    """E SwiGLU experts as stacked weights, applied to the tokens routed to each."""

    def __init__(self, experts: int, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(experts, hidden_dim, dim))
        self.w3 = nn.Parameter(torch.empty(experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(experts, dim, hidden_dim))

    def forward(self, tokens: torch.Tensor, picked: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """tokens (N, dim), picked (N, k) expert ids, weights (N, k) -> sum_k weight x expert(token)."""
        if tokens.is_meta:  # shapes only (a pipeline stage's shape inference on older torch)
            return torch.zeros_like(tokens)
        flat = picked.flatten()
        order = flat.argsort(stable=True)  # the (token, slot) pairs grouped by expert
        rows = order // picked.shape[1]
        counts = expert_counts(flat, self.w1.shape[0])
        routed = self.grouped(tokens[rows], counts)  # (N k, dim), in expert order
        # Back to (token, slot) order by a gather, whose backward keeps only the index, then each token's k
        # results weighted and summed. (Adding the weighted rows into zeros, index_add_, keeps its whole source
        # for backward: k copies of the token in fp32 under autocast, the largest thing a block kept.)
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        mixed = routed[inverse].view(*picked.shape, -1)  # (N, k, dim)
        return (mixed * weights.unsqueeze(-1)).sum(1).type_as(tokens)

    def grouped(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Each expert on its tokens: x (sum(counts), dim) holds counts[e] tokens for expert e, in expert order.
        The seam expert parallelism replaces (plait.parallel.experts): it sends the tokens to the ranks that
        hold their experts and brings the results back in this order."""
        return swiglu_experts(x, counts, self.w1, self.w2, self.w3)


def expert_counts(picked: torch.Tensor, experts: int) -> torch.Tensor:
    """Picks per expert (int64, `experts` long) of a flat tensor of expert ids: bincount's result, with a
    shape that does not depend on the values (torch.compile traces it without a data-dependent size)."""
    counts = torch.zeros(experts, dtype=torch.int64, device=picked.device)
    return counts.scatter_add_(0, picked, torch.ones_like(picked))


def swiglu_experts(x: torch.Tensor, counts: torch.Tensor | list[int], w1, w2, w3) -> torch.Tensor:
    """Expert e's SwiGLU (w1[e], w3[e]: (F, dim), w2[e]: (dim, F)) on its counts[e] rows of x, in order. An
    expert with no tokens still takes part (a zero-row product), so every expert weight gets a gradient.
    Grouped matmuls (one kernel per projection for all experts) where the device has them: the group
    offsets stay on the device, so nothing waits for the host and the shapes are static (compilable).
    Elsewhere one matmul per expert, whose row counts the host must know."""
    kind = x.device.type
    low = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype
    cast = low != x.dtype and grouped_mm_fits(x, w1, w2, dtype=low)
    if cast:
        # autocast does not cover torch._grouped_mm: cast as it would for a matmul, or the fp32 residual
        # stream would take the per-expert loop
        x, w1, w2, w3 = (t.to(low) for t in (x, w1, w2, w3))
    if grouped_mm_fits(x, w1, w2):
        if isinstance(counts, torch.Tensor):
            offsets = counts.cumsum(0, dtype=torch.int32)
        else:
            offsets = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(x.device)
        if cast:
            # The gate and up projections as one grouped GEMM twice as wide (E, dim, 2F): its input read once,
            # one kernel, and in backward one input gradient instead of two and their sum. Its weights are the
            # two casts stacked, so backward keeps as many bytes as before. Weights used as they come (FSDP's
            # gathered bf16) are not stacked: the copy would be kept for backward on top of them.
            gate, up = grouped_mm(x, torch.cat((w1, w3), dim=1).transpose(1, 2), offsets).chunk(2, dim=-1)
        else:
            gate, up = grouped_mm(x, w1.transpose(1, 2), offsets), grouped_mm(x, w3.transpose(1, 2), offsets)
        return grouped_mm(F.silu(gate) * up, w2.transpose(1, 2), offsets)
    if isinstance(counts, torch.Tensor):
        counts = counts.tolist()
    outs = [(F.silu(c @ w1[e].t()) * (c @ w3[e].t())) @ w2[e].t() for e, c in enumerate(x.split(counts))]
    return torch.cat(outs)


class AuxLoss(torch.autograd.Function):
    """Adds a loss to the objective through the gradient: forward returns x unchanged; backward also sends
    d(loss) = 1 into the loss's graph (Megatron's MoEAuxLossAutoScaler), so no model output has to carry it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(loss)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (loss,) = ctx.saved_tensors
        return grad, torch.ones_like(loss)
