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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from plait.model.args import ModelArgs
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
