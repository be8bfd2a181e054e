"""The output projection and the next-token cross-entropy computed together, a chunk of tokens at a time.

The plain head materialises the logits (B, T, V), their fp32 copy and the fp32 log-softmax that autograd keeps
for backward: for llama3-1b at 4 x 2,048 tokens (V = 128,256) that is 2.1 GB of bf16 logits and 4.2 GB kept
in fp32, more than the whole model's bf16 weights. The fused head never holds more than one chunk's logits.
For each chunk of tokens it computes the logits, their log-sum-exp and the loss, and at once the gradient of
the loss with respect to the chunk's hidden states and (summed over chunks) the weight: the loss is a sum, so
its gradient is one scalar for every term, and backward only scales what forward kept. The same three matmuls
as the plain head (logits, input gradient, weight gradient), none recomputed; what stays alive from forward
to backward is the input gradient (B, T, dim) and the weight gradient (V, dim), not (B, T, V).

The math knows nothing about parallelism: a vocabulary split over ranks (tensor parallelism) plugs in as
`Shards` (plait.parallel.head), whose collectives are identities here.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from plait.model.args import LOGITS_PER_CHUNK, chunk_tokens  # noqa: F401 - the head's rule, torch-free for the planner

IGNORE_INDEX = -100  # a target that is not scored (a fine-tuning prompt's tokens)


class Shards:
    """The vocabulary of this rank: all of it. A vocabulary split over ranks (plait.parallel.head.VocabShards)
    overrides the collectives: gather / scatter the hidden states' sequence shards, reduce per-token
    statistics over the ranks holding other parts of the vocabulary."""

    vocab_start = 0
    split = False  # the vocabulary lies on several ranks: per-token statistics are combined over them

    def gather(self, h: torch.Tensor) -> torch.Tensor:
        return h

    def scatter(self, grad: torch.Tensor) -> torch.Tensor:
        return grad

    def max_(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def sum_(self, x: torch.Tensor) -> torch.Tensor:
        return x


def chunk_statistics(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int):
    """Per token of a chunk (logits (n, V_local) in the compute dtype): the log-sum-exp of this rank's logits and
    the target's logit where this rank holds it (else 0), both fp32. One pass over the logits once compiled
    (Inductor's online softmax keeps the running max and sum together; the max and the sum as two functions
    were two passes: docs/measurements.md, "head: log-sum-exp in one pass"). Eager: two (n, V) fp32
    temporaries at once (the fp32 copy of bf16 logits, its shifted exponentials), as before."""
    local = targets - vocab_start
    here = (local >= 0) & (local < logits.shape[1])
    picked = logits.gather(1, local.clamp(0, logits.shape[1] - 1)[:, None]).squeeze(1).float()
    x = logits.float()
    # written as Inductor's softmax pattern (amax and sum with keepdim) so that its online-softmax rewrite
    # (torch/_inductor/fx_passes/post_grad.py, prepare_softmax_pattern; Triton only) finds it: checked on the
    # CPU (the pattern matches; only its device check refuses there), while without keepdim it does not match
    top = x.amax(dim=1, keepdim=True)
    total = (x - top).exp_().sum(dim=1, keepdim=True)  # in place: at most two (n, V) fp32 temporaries
    return (top + total.log()).squeeze(1), torch.where(here, picked, 0.0)


def combine_statistics(lse: torch.Tensor, picked: torch.Tensor, shards: Shards):
    """The whole vocabulary's log-sum-exp and target logit from each rank's: lse = m + log(sum over ranks of
    exp(lse_r - m)), m the largest lse_r (two all-reduces of per-token values: the max, then the sum of the
    exponentials with the target's logit, which one rank holds). Nothing to combine where one rank holds it."""
    if not shards.split:
        return lse, picked
    top = shards.max_(lse.clone())
    both = shards.sum_(torch.stack([(lse - top).exp(), picked]))
    return top + both[0].log(), both[1]


def chunk_gradient(logits, lse, targets, vocab_start: int, dtype: torch.dtype) -> torch.Tensor:
    """d(sum of the chunk's losses)/d(logits) = softmax - one-hot of the target, on scored tokens (fp32 math,
    `dtype` out). One (n, V) fp32 temporary, updated in place; the target is subtracted by a scatter whose
    value is 0 where this rank does not hold it or the token is not scored (no index selection: no device
    sync)."""
    local = targets - vocab_start
    here = (local >= 0) & (local < logits.shape[1])
    scored = targets != IGNORE_INDEX
    grad = (logits.float() - lse[:, None]).exp_()
    hit = (here & scored).to(grad.dtype)[:, None]
    grad.scatter_add_(1, local.clamp(0, logits.shape[1] - 1)[:, None], -hit)
    return grad.mul_(scored.to(grad.dtype)[:, None]).to(dtype)


def chunk_gradient_fusable(logits, lse, targets, vocab_start: int, dtype: torch.dtype) -> torch.Tensor:
    """chunk_gradient without the scatter: the one-hot as a comparison with the column index, so a compiler
    makes the whole of it one kernel (read the logits, write the gradient; the scatter splits it in two with
    an fp32 (n, V) tensor between them: docs/measurements.md, "head: gradient without a scatter").
    Eager, the comparison would be another (n, V) temporary: eager keeps
    chunk_gradient."""
    local = targets - vocab_start
    scored = (targets != IGNORE_INDEX)[:, None]
    columns = torch.arange(logits.shape[1], device=logits.device)
    one_hot = (columns[None, :] == local[:, None]) & scored
    grad = (logits.float() - lse[:, None]).exp() - one_hot.float()
    return torch.where(scored, grad, 0.0).to(dtype)


def chunk_loss_and_gradient(logits: torch.Tensor, targets: torch.Tensor, grads: bool):
    """The eager path where this rank holds the whole vocabulary: the chunk's per-token losses (0 where
    unscored) and (with `grads`)
    its gradient with respect to the logits, from one log-softmax (a fused single kernel on a CPU) instead
    of the statistics then the gradient (two subtractions and two exponentials of (n, V) fp32). Loss from the
    log-probabilities, not log(softmax), which underflows to -inf far from the target; the gradient is their
    exponential, in place (docs/measurements.md, "head: one log-softmax on a CPU")."""
    scored = targets != IGNORE_INDEX
    index = targets.clamp(0, logits.shape[1] - 1)[:, None]
    logp = torch.log_softmax(logits, dim=1, dtype=torch.float32)  # bf16 on CUDA: read as is, no fp32 copy
    loss = torch.where(scored, -logp.gather(1, index).squeeze(1), 0.0)
    if not grads:
        return loss, None
    grad, weight = logp.exp_(), scored.to(logp.dtype)[:, None]  # an unscored token: no one-hot, no gradient
    grad.scatter_add_(1, index, -weight)
    return loss, grad.mul_(weight).to(logits.dtype)


ELEMENTWISE = (chunk_statistics, chunk_gradient)
"""The fused head's element-wise work per chunk, two passes over the chunk's logits; `compiled_elementwise()`
fuses each into one kernel (compile.enabled) that reads the logits in their dtype and keeps fp32 in registers."""


def compiled_elementwise():
    global _COMPILED
    if _COMPILED is None:
        fusable = (chunk_statistics, chunk_gradient_fusable)
        _COMPILED = tuple(torch.compile(f, dynamic=False, fullgraph=True) for f in fusable)
    return _COMPILED


def accumulate_weight_grad(grad_w: torch.Tensor, g: torch.Tensor, xc: torch.Tensor) -> None:
    """grad_w (fp32) += g.T @ xc. With half-precision operands on CUDA the matmul adds into grad_w itself
    (cuBLAS with an fp32 output, beta = 1: torch.addmm's out_dtype), not a separate fp32 pass over the (V, dim)
    product (docs/measurements.md, "head: weight gradient accumulated by the matmul"). Elsewhere (CPU, fp32
    operands), a matmul then an add; autocast is off for the fused call (it would cast grad_w to half).
    torch builds whose addmm.out_dtype takes no fp32 accumulator (it asked for self in the inputs' dtype in
    some releases) are detected at the first call and keep the matmul-then-add, said once."""
    global FUSED_ACCUMULATION
    if FUSED_ACCUMULATION is not False and g.is_cuda and g.dtype in (torch.bfloat16, torch.float16):
        try:
            with torch.autocast("cuda", enabled=False):
                torch.addmm(grad_w, g.t(), xc.to(g.dtype), out_dtype=torch.float32, out=grad_w)
            FUSED_ACCUMULATION = True
            return
        except (RuntimeError, TypeError) as e:
            if FUSED_ACCUMULATION:  # it ran before: a real failure
                raise
            FUSED_ACCUMULATION = False
            warnings.warn(f"fused head: the weight gradient is added after its matmul (torch.addmm: {e})", stacklevel=2)
    grad_w.add_(torch.mm(g.t(), xc))  # fp32 += the chunk's (compute dtype): no fp32 copy of it


class TokenMixture:
    """A loss of each token mixed from the model's probability p = exp(-loss) and another's: -log(a p + b), with
    a (N,) and b (N,) given per token (fp32, no gradient through them here; RETRO's copy from the neighbours,
    plait.model.retrieval.NeighbourCopy). The head then returns the sum over tokens of r x loss, r = a p / (a p +
    b) (the mixed loss's derivative with respect to the model's loss: the model's share of the target), and
    scales each token's gradient by r; `losses` and `shares` hold each token's own loss and r for the caller's
    remainder (NeighbourCopy.remainder), so that their sum is the mixed loss and its gradient the mixed loss's."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor):
        self.a, self.b = a.reshape(-1).float(), b.reshape(-1).float()
        self.losses, self.shares = torch.zeros_like(self.a), torch.ones_like(self.a)

    def weights(self, start: int, losses: torch.Tensor) -> torch.Tensor:
        stop = start + losses.shape[0]
        model = self.a[start:stop] * torch.exp(-losses.float())
        b = self.b[start:stop]
        r = torch.where(b > 0, model / (model + b).clamp_min(torch.finfo(torch.float32).tiny), 1.0)
        self.losses[start:stop], self.shares[start:stop] = losses, r
        return r


_COMPILED: tuple[Callable[..., Any], ...] | None = None
FUSED_ACCUMULATION: bool | None = None  # None: not tried yet; then whether torch.addmm accumulates in fp32 here


def _compute_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    kind = x.device.type
    if kind in ("cpu", "cuda", "xpu", "mps", "hpu") and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return weight.dtype


class LinearCrossEntropy(torch.autograd.Function):
    """sum over scored tokens of cross_entropy(h @ weight.T, targets), chunk by chunk (see the module doc).
    h: (B, T_local, dim) (a sequence shard under sequence parallelism, gathered here); weight (V_local, dim);
    targets (B, T) with IGNORE_INDEX for unscored tokens; `mixture`: each token's loss and gradient weighted as
    TokenMixture says. Returns a 0-d fp32 tensor."""

    @staticmethod
    def forward(
        ctx,
        h,
        weight,
        targets,
        chunk: int,
        shards: Shards,
        ops=ELEMENTWISE,
        in_place: bool = True,
        mixture: TokenMixture | None = None,
    ):
        statistics, gradient = ops
        x = shards.gather(h)  # (B, T, dim)
        flat, y = x.reshape(-1, x.shape[-1]), targets.reshape(-1)
        # the operands in the compute dtype once (autocast's dtype where it is on): autocast would cast the
        # (V, dim) weight again for every chunk's matmul (docs/measurements.md, "head: weight cast once per
        # call"); its cache does not reach a custom Function's forward
        dtype = _compute_dtype(x, weight)
        w, xs = weight.to(dtype), flat.to(dtype)
        grads = h.requires_grad or weight.requires_grad
        grad_x = torch.empty_like(flat) if h.requires_grad else None
        # a frozen output (LoRA fine-tuning) gets no weight gradient: neither its matmul nor its (V, dim) buffer
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if weight.requires_grad else None
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        one_pass = ops is ELEMENTWISE and not shards.split  # eager with the whole vocabulary here
        for start in range(0, flat.shape[0], chunk):
            xc, yc = xs[start : start + chunk], y[start : start + chunk]
            logits = torch.mm(xc, w.t())  # (n, V_local), in the compute dtype
            if one_pass:
                losses, g = chunk_loss_and_gradient(logits, yc, grads)
            else:
                local_lse, local_picked = statistics(logits, yc, shards.vocab_start)
                lse, picked = combine_statistics(local_lse, local_picked, shards)
                losses = torch.where(yc != IGNORE_INDEX, lse - picked, 0.0)
                g = gradient(logits, lse, yc, shards.vocab_start, logits.dtype) if grads else None
            del logits
            if mixture is not None:
                r = mixture.weights(start, losses)
                losses = losses * r
                g = None if g is None else g.mul_(r[:, None].to(g.dtype))
            total += losses.sum()
            if grads:
                if grad_x is not None:
                    grad_x[start : start + chunk] = torch.mm(g, w)
                if grad_w is not None:
                    accumulate_weight_grad(grad_w, g, xc)
        if grads:
            ctx.save_for_backward(
                None if grad_x is None else shards.scatter(grad_x.view(x.shape)).to(h.dtype),
                None if grad_w is None else grad_w.to(weight.dtype),
            )
        ctx.in_place, ctx.used = in_place, False
        return total

    @staticmethod
    def backward(ctx, grad):
        """Scale what forward computed by the incoming gradient: in place (no second (V, dim) buffer at the
        start of backward, when activations peak), or into new tensors where the graph is walked more than
        once (zero-bubble pipelines: an input pass and a weight pass over one graph)."""
        if ctx.in_place and ctx.used:
            raise RuntimeError("the fused head was built for one backward pass (in_place=True) and ran a second")
        ctx.used = True
        scaled = [
            None if t is None else (t.mul_(grad.to(t.dtype)) if ctx.in_place else t * grad.to(t.dtype))
            for t in ctx.saved_tensors
        ]
        return *scaled, None, None, None, None, None, None


def linear_cross_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk: int = 0,
    shards: Shards | None = None,
    compiled: bool = False,
    in_place: bool = True,
    mixture: TokenMixture | None = None,
) -> torch.Tensor:
    """Summed next-token loss of hidden states h (B, T, dim) under an output projection `weight` (V, dim),
    without the (B, T, V) logits; chunk: tokens per chunk (0: chunk_tokens' rule); compiled: the element-wise
    work as compiled kernels; in_place=False where backward walks the graph more than once (zero bubble);
    mixture: each token's loss and gradient weighted (TokenMixture)."""
    chunk = chunk_tokens(targets.numel(), weight.shape[0], chunk)
    ops = compiled_elementwise() if compiled else ELEMENTWISE
    return LinearCrossEntropy.apply(h, weight, targets, chunk, shards or Shards(), ops, in_place, mixture)
