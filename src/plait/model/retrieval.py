"""RETRO's pieces for plait's Transformer (model.retrieval_layers): the neighbours' encoder and chunked
cross-attention (Borgeaud et al. 2022).

A sequence of T tokens is cut into chunks of c tokens; for each chunk u the data brings its k neighbours from
the retrieval database (plait.data.retrieval), each a chunk and its continuation (2c tokens). Input layout:
the model takes the sequence's token ids followed by its neighbours' (B, T + (T / c) k 2c), so that every
layout, micro-batch and loader path carries them as the tokens are carried (`split_retrieved`).

- The encoder embeds the neighbours with the decoder's token embedding and runs `retrieval_encoder_layers`
  bidirectional blocks over each neighbour's 2c tokens (RETRO's encoder, without its conditioning on the
  chunk's activations), then a norm.
- Chunked cross-attention in the blocks of `retrieval_layers`, after self-attention and before the MLP, its
  output scaled by a learned gate tanh(w) that starts at 0 (`RetrievalGate`, Flamingo's): a retrieval model
  starts as the model without retrieval and opens the gate only as far as its neighbours pay. A zero output
  projection instead (the earlier start) shut nothing: Adam moves every one of its weights by about the
  learning rate each step, whether the neighbours help or not, and the active cross-attention then cost held-out
  loss. The gate is one number per block, moved by the sign of the whole batch's evidence. Token
  t attends to the encoded neighbours of chunk u = (t + 1) // c - 1, the last chunk that ends at or before t,
  so causality holds at chunk granularity: neighbours retrieved with a chunk's tokens reach only the tokens
  from that chunk's last one on. The first c - 1 tokens attend to none (their cross-attention is 0).
  Positions are relative, as in RETRO: the rotary embedding places a neighbour's tokens at 0 .. 2c - 1 (the
  retrieved chunk, then its continuation) and the tokens that see chunk u at c - 1 .. 2c - 2 (their offsets
  from chunk u's first token), so each token lines up with the continuation token it predicts, one position
  on. Without it a token can find that continuation token only by content: with neighbours that hold the very
  text to predict (a leaked oracle, bench/retrieval_quality.py --oracle), 150 steps of the default model did
  not learn to copy without it, and did with it (training loss 5.30 and 5.07 nats; the plain model 5.17).
- With model.retrieval_copy, the copy from the neighbours by content that a small model does not learn is
  given: each token's next-token probability is mixed with the unigram and bigram caches of the neighbours it
  sees, two learned shares from 0 (`NeighbourCopy`), through the fused head (plait.model.head.TokenMixture).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from plait.model.args import ModelArgs
from plait.model.head import IGNORE_INDEX
from plait.model.retrieval_learned import LearnedRetriever
from plait.model.rope import apply_rope


def split_retrieved(x: torch.Tensor, args: ModelArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens (B, T), neighbours (B, T / c, k, 2c)) of a retrieval model's input (B, T + (T / c) k 2c)."""
    c, k = args.retrieval_chunk, args.retrieval_k
    total = x.shape[1]
    length = total // (1 + 2 * k)
    if length * (1 + 2 * k) != total or length % c:
        raise ValueError(
            f"a retrieval model takes T tokens and (T / {c}) x {k} neighbours of {2 * c} tokens: {total} values per "
            f"row is no such input"
        )
    return x[:, :length], x[:, length:].reshape(x.shape[0], length // c, k, 2 * c)


class ChunkedCrossAttention(nn.Module):
    """Each token's attention over the encoded neighbours of the last chunk that ends at or before it."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.chunk, self.head_dim = args.retrieval_chunk, args.head_dim
        self.n_rep = args.n_heads // args.n_kv_heads
        q_dim, kv_dim = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
        self.wq = nn.Linear(args.dim, q_dim, bias=False)
        self.wk = nn.Linear(args.dim, kv_dim, bias=False)
        self.wv = nn.Linear(args.dim, kv_dim, bias=False)
        self.wo = nn.Linear(q_dim, args.dim, bias=False)
        self.gate = RetrievalGate()

    def forward(self, x: torch.Tensor, memory: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x (B, T, dim), memory (B, T / c, k 2c, dim): the encoded neighbours of each chunk; cos, sin: the rotary
        tables of positions 0 .. 2c - 1 (2c, head_dim)."""
        bsz, length, _ = x.shape
        c, groups, hd = self.chunk, length // self.chunk, self.head_dim
        # Row r of `shifted` is token r + c - 1: group u (rows u c .. u c + c - 1) is the tokens that see chunk u.
        shifted = F.pad(x[:, c - 1 :], (0, 0, 0, c - 1))
        q = self.wq(shifted).view(bsz * groups, c, -1, hd)
        q = apply_rope(q, cos[c - 1 : 2 * c - 1], sin[c - 1 : 2 * c - 1]).transpose(1, 2)
        width = 2 * c  # each neighbour at its own positions 0 .. 2c - 1
        k = self.wk(memory).view(bsz * groups * (memory.shape[2] // width), width, -1, hd)
        k = apply_rope(k, cos[:width], sin[:width]).view(bsz * groups, memory.shape[2], -1, hd).transpose(1, 2)
        v = self.wv(memory).view(bsz * groups, memory.shape[2], -1, hd).transpose(1, 2)
        if self.n_rep > 1:
            k, v = k.repeat_interleave(self.n_rep, dim=1), v.repeat_interleave(self.n_rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v)  # (B U, heads, c, hd): all of its chunk's neighbours
        out = out.transpose(1, 2).reshape(bsz, length, -1)  # row r: token r + c - 1
        out = F.pad(out, (0, 0, c - 1, 0))[:, :length]  # token t at row t; tokens before c - 1: zero
        return self.gate(self.wo(out))


class RetrievalGate(nn.Module):
    """tanh(w) x: how much of the cross-attention a block adds to its residual stream, one learned scalar that
    starts at 0 (Flamingo's gate, Alayrac et al. 2022), so a retrieval model starts as the same model without
    retrieval."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.weight).to(x.dtype) * x


def learned_share(weight: torch.Tensor, most: float) -> torch.Tensor:
    """A copy's learned share (or shares) from its weight: clamped to [0, most], its gradient scaled by
    COPY_GRAD_SCALE on its way back."""
    w = weight.to_local() if hasattr(weight, "to_local") else weight  # replicated on every tensor-parallel rank
    w = w * COPY_GRAD_SCALE + (w * (1 - COPY_GRAD_SCALE)).detach()  # its value, its gradient scaled
    return w.float().clamp(0.0, most)


def whole(x: torch.Tensor) -> torch.Tensor:
    """A tensor whole on this rank: a DTensor (tensor parallelism: a replicated parameter, a sequence-sharded
    hidden state) gathered as a plain tensor; its gradient is taken as the same on every tp rank, so a part that
    every tp rank computes alike (the pointer) adds it once."""
    return x.full_tensor() if hasattr(x, "full_tensor") else x


def mixture_remainder(a, b, mixture, targets) -> torch.Tensor:
    """What the head's weighted sum (TokenMixture) leaves of the mixed loss -log(a p + b): the sum over scored
    tokens of -log(a p + b) - r loss, with the head's own losses and r; its gradient reaches a and b only (the
    copies' shares and the pointer's attention)."""
    losses, r = mixture.losses.view_as(a), mixture.shares.view_as(a)
    model = torch.exp(-losses)
    mixed = -torch.log((a * model + b).clamp_min(torch.finfo(torch.float32).tiny)) - r * losses
    return torch.where(targets != IGNORE_INDEX, mixed, 0.0).sum()


COPY_SHARE_MAX = 0.45
"""The most of a token's probability either copy may take (model.retrieval_copy): the model keeps at least 10%,
so a target neither copy knows keeps a finite loss."""
COPY_GRAD_SCALE = 1e-3
"""The shares' gradient is scaled by this on its way back. Adam's step does not depend on a gradient's scale,
but the global norm that gradient clipping divides by does: at a share of 0 its gradient is about -q / p per
token (the cache's probability of the target over the model's), hundreds early in training, and unscaled it
dominated the norm (10 against 2.8 for all the rest at the tiny model's start) and so shrank every other
parameter's first steps. That made the model 0.08 nats/token better at 150 steps on the bundled corpus with
random neighbours as much as with retrieved ones: a change of step size, not retrieval (docs/data.md)."""


class NeighbourCopy(nn.Module):
    """A copy from the neighbours that needs no learning (model.retrieval_copy): each token's next-token
    probability is mixed with two caches of the neighbours of the last chunk that ends at or before it (the
    chunks the cross-attention sees; Kuhn and De Mori's cache model, kNN-LM's mixture):

        p(y) = (1 - w_u - w_b [x in them]) p_model(y) + w_u unigram(y) + w_b [x in them] bigram(y | x)

    with x the token, unigram(y) y's share of the neighbours' tokens, bigram(y | x) y's share of the tokens that
    follow x there. w_u and w_b are learned (from 0: a retrieval model starts as the model without the copy),
    each at most COPY_SHARE_MAX. The cross-attention has to learn to find a token in a neighbour and read the
    token after it, which a small model does not within a short run (bench/retrieval_ceiling.py --model-steps,
    docs/data.md); this copy is that skill given. Its loss goes through the fused head as a TokenMixture
    (plait.model.head), with no (B, T, vocab) logits."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.chunk = args.retrieval_chunk
        self.weight = nn.Parameter(torch.zeros(2))  # w_u, w_b

    def shares(self) -> torch.Tensor:
        return learned_share(self.weight, COPY_SHARE_MAX)

    def seen(self, tokens: torch.Tensor, neighbours: torch.Tensor):
        """Per token (B, T): (the neighbours it sees (B, T, k 2c), whether it sees any (B, T), which of their
        tokens are x (B, T, k (2c - 1)) among those with a successor, and those successors)."""
        c, length = self.chunk, tokens.shape[1]
        u = torch.div(torch.arange(length, device=tokens.device) + 1, c, rounding_mode="floor") - 1
        valid = (u >= 0).expand_as(tokens)
        seen = neighbours[:, u.clamp_min(0)]  # (B, T, k, 2c)
        matches = (seen[..., :-1] == tokens[..., None, None]).flatten(2) & valid[..., None]
        return seen.flatten(2), valid, matches, seen[..., 1:].flatten(2)

    def mixture(self, tokens, neighbours, targets) -> tuple[torch.Tensor, torch.Tensor]:
        """Per token (B, T): a, the model's share, and b, the caches' probability of the target (both with
        the shares' gradient)."""
        seen, valid, matches, after = self.seen(tokens, neighbours)
        unigram = (seen == targets[..., None]).float().mean(-1)
        count = matches.sum(-1)
        bigram = (matches & (after == targets[..., None])).sum(-1) / count.clamp_min(1)
        w = self.shares()
        wu, wb = w[0] * valid.float(), w[1] * (count > 0).float()
        return 1 - wu - wb, wu * unigram + wb * bigram

    def log_probs(self, logits, tokens, neighbours) -> torch.Tensor:
        """The mixed distribution's log-probabilities (B, T, vocab) of the model's logits: what generation
        samples from and evaluation scores."""
        seen, valid, matches, after = self.seen(tokens, neighbours)
        vocab = logits.shape[-1]
        unigram = torch.zeros(*tokens.shape, vocab, device=logits.device).scatter_add_(
            -1, seen, torch.full(seen.shape, 1.0 / seen.shape[-1], device=logits.device)
        )
        count = matches.sum(-1, keepdim=True)
        bigram = torch.zeros_like(unigram).scatter_add_(-1, after, matches.float() / count.clamp_min(1))
        w = self.shares()
        wu, wb = (w[0] * valid.float())[..., None], (w[1] * (count > 0).float())
        probs = (1 - wu - wb) * logits.float().softmax(-1) + wu * unigram + wb * bigram
        return probs.log()


POINTER_SHARE_MAX = 0.9
"""The most of a token's probability the pointer may take (model.retrieval_pointer): what else predicts it (the
model, and the caches of model.retrieval_copy) keeps at least 10%, so a target the pointer misses keeps a finite
loss. Higher than COPY_SHARE_MAX: the pointer's share is decided per token, so where it points well it may take
nearly all."""


FOLLOW_SCALE = 10.0
"""The pointer's follow bonus is this times its weight: a weight that Adam moves by about the learning rate a step
moves the bonus by ten times that, so that within a short run it can grow to the few units of score that make
the next token of a copied name the pointer's choice (at 0 it adds nothing)."""


class NeighbourPointer(nn.Module):
    """A learned copy from the neighbours (model.retrieval_pointer; the pointer-generator of See et al. 2017, over
    RETRO's neighbours): token t scores each token j of the neighbours it sees (those of the last chunk that ends
    at or before it, as the cross-attention) by q(h_t) . k(m_j) / sqrt(d), with h_t its final hidden state and m_j
    the neighbours' encoder output, and mixes its next-token probability with the token it points at:

        p(y) = (1 - s_t) p(y) + s_t sum_j softmax_j(q(h_t) . k(m_j) / sqrt(d) + f [n_(j-1) = x_t]) [n_j = y]

    with s_t = w sigmoid(g . h_t + g_0) its share, w learned from 0 (at most POINTER_SHARE_MAX, through
    learned_share): a retrieval model starts as the model without it. d is the model's head size. f
    (FOLLOW_SCALE x a weight learned from 0) is a bonus for the neighbour tokens that follow a copy of the token
    x_t itself: the way on through a name of several tokens once its first is copied (an induction match, given
    as the bigram cache is). Its loss goes through the fused head as a TokenMixture, as NeighbourCopy's does."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.chunk, self.dim = args.retrieval_chunk, args.head_dim
        self.wq = nn.Linear(args.dim, args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.head_dim, bias=False)
        self.switch = nn.Linear(args.dim, 1)
        self.weight = nn.Parameter(torch.zeros(1))
        self.follow = nn.Parameter(torch.zeros(1))
        self.retriever = LearnedRetriever(args) if args.learns_retriever else None

    def _grouped(self, x: torch.Tensor, value: float = 0) -> torch.Tensor:
        """Per group row (B, T / c, c, ...) of per token (B, T, ...): row j of group u is token u c + c - 1 + j
        (ChunkedCrossAttention's rows), the rows past the end `value`."""
        c, (bsz, length) = self.chunk, x.shape[:2]
        pad = [0, 0] * (x.dim() - 2) + [0, c - 1]
        return F.pad(x[:, c - 1 :], pad, value=value).view(bsz, length // c, c, *x.shape[2:])

    def point(self, h, memory, tokens, neighbours) -> tuple[torch.Tensor, torch.Tensor]:
        """(the attention (B, T / c, c, k 2c), the share (B, T / c, c)) of the tokens that see each chunk's
        neighbours, in group rows (_grouped). Under tensor parallelism every tp rank computes it whole, alike
        (the hidden states gathered from their sequence shards, the parameters replicated: whole)."""
        shifted = self._grouped(whole(h))
        query, key = F.linear(shifted, whole(self.wq.weight)), F.linear(whole(memory), whole(self.wk.weight))
        scores = (query @ key.transpose(-1, -2)).float() / self.dim**0.5
        before = F.pad(neighbours[..., :-1], (1, 0), value=-1).flatten(2)  # each neighbour token's predecessor
        follows = before[:, :, None, :] == self._grouped(tokens, -2)[..., None]
        logits = scores + FOLLOW_SCALE * whole(self.follow).float() * follows
        if self.retriever is None:
            attention = torch.softmax(logits, -1)
        else:  # REALM: sum_z p(z | x) x the attention within neighbour z (plait.model.retrieval_learned)
            r = self.retriever
            prior = r.log_prior(tokens, neighbours, whole(r.table), whole(r.scale))  # (B, T / c, k)
            within = logits.unflatten(-1, neighbours.shape[-2:]).log_softmax(-1)  # (B, T / c, c, k, 2c)
            attention = (within + prior[:, :, None, :, None]).flatten(-2).exp()
        switch = F.linear(shifted, whole(self.switch.weight), whole(self.switch.bias))
        share = learned_share(self.weight, POINTER_SHARE_MAX) * torch.sigmoid(switch.float())
        return attention, share[..., 0]

    def _to_tokens(self, grouped: torch.Tensor, length: int) -> torch.Tensor:
        """Per token (B, T, ...) of per group row (B, T / c, c, ...): the first c - 1 tokens see no chunk (0)."""
        c = self.chunk
        flat = grouped.flatten(1, 2)
        pad = [0, 0] * (flat.dim() - 2) + [c - 1, 0]
        return F.pad(flat, pad)[:, :length]

    def mix(self, a, b, h, memory, tokens, neighbours, targets) -> tuple[torch.Tensor, torch.Tensor]:
        """The mixture (a, b) per token (B, T) of TokenMixture with the pointer added: (1 - s) a and (1 - s) b + s
        x the attention on the target's copies (with their gradients)."""
        length = targets.shape[1]
        attention, share = self.point(h, memory, tokens, neighbours)
        ids = neighbours.flatten(2)[:, :, None, :]  # (B, T / c, 1, k 2c)
        pointed = (attention * (ids == self._grouped(targets, IGNORE_INDEX)[..., None])).sum(-1)
        s, p = self._to_tokens(share, length), self._to_tokens(pointed, length)
        return (1 - s) * a, (1 - s) * b + s * p

    def log_probs(self, log_probs: torch.Tensor, h, memory, tokens, neighbours) -> torch.Tensor:
        """The mixed distribution's log-probabilities (B, T, vocab) of the model's (those of the copy, if any)."""
        attention, share = self.point(h, memory, tokens, neighbours)
        ids = neighbours.flatten(2)[:, :, None, :].expand_as(attention)
        vocab = log_probs.shape[-1]
        pointed = torch.zeros(*attention.shape[:-1], vocab, device=h.device).scatter_add_(-1, ids, attention)
        s = self._to_tokens(share, log_probs.shape[1])[..., None]
        return ((1 - s) * log_probs.float().exp() + s * self._to_tokens(pointed, log_probs.shape[1])).log()
