"""A retriever that learns (model.retrieval_learned; REALM, Guu et al. 2020): a trainable encoder of chunks whose
scores of a chunk's neighbours weigh the pointer's copy from each, so the loss reaches the retriever.

The encoder is a learned table of token vectors (vocab, model.retrieval_dim), a chunk's embedding the weighted sum
of its tokens' rows, log(1 + tf) / tf at each position (a token counted log(1 + tf) times), L2-normalised:
`bag_embed`. A table of idf(t) x the lexical encoder's projection row of t is the lexical encoder itself
(plait.data.lexical), which is where a fresh run starts (plait.data.lexical.lexical_table): the learned retriever
begins as the frozen one and moves away from it only as far as the loss pays.

The likelihood is marginalised over the k neighbours (REALM's): the pointer's distribution is
sum_z p(z | x) ptr_z, with ptr_z its attention within neighbour z alone and

    p(z | x) = softmax_z(s cos(e(x), e(z)))

over the k neighbours of chunk x, e the encoder, s = RETRIEVER_SCALE x exp(w) with w learned from 0. Both
embeddings are computed fresh, with the table's current values (and their gradients): the index that chose the
k (plait.data.retrieval_live) is the table of a few steps ago, refreshed every model.retrieval_refresh_steps in
the background. The snapshots that index is built from are buffers of this module, so a checkpoint holds them
and a resumed run searches exactly what the uninterrupted one searched."""

from __future__ import annotations

import torch
from torch import nn

from plait.model.args import ModelArgs

RETRIEVER_SCALE = 10.0
"""The scale of the cosines in p(z | x) at the start (times exp(w), w learned from 0). Cosines of a chunk's
neighbours differ by a few tenths (the lexical encoder's, on the facts bench): times 10 that is a few nats, so
the prior starts informative without being certain."""


def bag_embed(tokens: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Unit vectors (..., d) of chunks (..., c) of token ids: sum over positions of log(1 + tf) / tf x table[id],
    tf the id's count in its chunk, normalised (the lexical encoder's weighting, with the table's rows)."""
    tf = (tokens[..., :, None] == tokens[..., None, :]).sum(-1).to(table.dtype)
    rows = tokens.reshape(-1, tokens.shape[-1])  # one bag a chunk: no (..., c, d) gather held
    vectors = nn.functional.embedding_bag(rows, table, per_sample_weights=(torch.log1p(tf) / tf).reshape(rows.shape),
                                          mode="sum")  # fmt: skip
    return nn.functional.normalize(vectors, dim=-1, eps=1e-12).reshape(*tokens.shape[:-1], table.shape[1])


class LearnedRetriever(nn.Module):
    """The learned encoder's table, its scale, and the snapshots of the table the live index searches with
    (buffers: `index_table` the one searched now, from the end of step index_steps[0]; `pending_table` the one
    being indexed in the background, from the end of step index_steps[1], -1 when none; index_steps[0] = -1:
    a fresh model, whose table the run sets to the lexical encoder's before its first step)."""

    index_table: torch.Tensor
    pending_table: torch.Tensor
    index_steps: torch.Tensor

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.chunk = args.retrieval_chunk
        self.table = nn.Parameter(torch.empty(args.vocab_size, args.retrieval_dim))
        self.scale = nn.Parameter(torch.zeros(1))
        self.register_buffer("index_table", torch.zeros(args.vocab_size, args.retrieval_dim))
        self.register_buffer("pending_table", torch.zeros(args.vocab_size, args.retrieval_dim))
        self.register_buffer("index_steps", torch.full((2,), -1, dtype=torch.int64))

    def log_prior(self, tokens: torch.Tensor, neighbours: torch.Tensor, table: torch.Tensor, scale) -> torch.Tensor:
        """log p(z | x) (B, T / c, k) of each chunk's k neighbours: chunks of `tokens` (B, T), `neighbours`
        (B, T / c, k, 2c) (a neighbour's first c tokens are the chunk retrieved), with `table` and `scale` (this
        module's, whole on this rank)."""
        bsz, length = tokens.shape
        query = bag_embed(tokens.reshape(bsz, length // self.chunk, self.chunk), table.float())
        keys = bag_embed(neighbours[..., : self.chunk], table.float())
        cosines = (keys @ query[..., None])[..., 0]
        return torch.log_softmax(RETRIEVER_SCALE * torch.exp(scale.float()) * cosines, -1)
