"""A Llama-family decoder written plainly in PyTorch.

Nothing here knows about parallelism. Sub-modules carry stable names (``tok_embeddings``, ``layers.<i>``,
``attention.wq`` ...) so tensor-parallel plans and pipeline splits can be applied from outside, and every
top-level piece may be ``None`` so a pipeline stage can keep only its own layers.

The Mistral and Qwen2 variants are settings of the same model: a sliding attention window
(``ModelArgs.sliding_window``) and biases on the q/k/v projections (``ModelArgs.qkv_bias``).

The model's parts live beside it: attention and document masking (plait.model.attention), RMSNorm
(plait.model.norm), the initial weights' values (plait.model.init); their names stay importable from here.

Rotary embeddings use the "rotate half" layout (the one Hugging Face's Llama uses), so weights move to and
from that format without permuting q/k rows.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any, cast

import torch
from torch import nn
from torch.nn.attention.flex_attention import BlockMask

from plait.model.args import ModelArgs
from plait.model.attention import (
    FLEX_VERIFIED_ON_CUDA,
    Attention,
    BidirectionalAttention,
    KVCache,
    _flex,
    attention_mask,
    document_block_mask,
    document_ids,
    document_mask,
    document_positions,
    flex_runs,
)
from plait.model.head import TokenMixture, linear_cross_entropy
from plait.model.init import (
    INIT_BLOCK_ELEMENTS,
    _name_seed,
    _ones_rows,
    _zeros_rows,
    canonical_name,
    init_rows,
)
from plait.model.mlp import FeedForward
from plait.model.moe import MoE
from plait.model.norm import RMSNorm, RMSNormFunction
from plait.model.retrieval import (
    ChunkedCrossAttention,
    NeighbourCopy,
    NeighbourPointer,
    mixture_remainder,
    split_retrieved,
)
from plait.model.retrieval_learned import LearnedRetriever
from plait.model.rope import apply_rope, rope_tables

__all__ = [  # the model's own names, and its parts' that callers import from here
    "FLEX_VERIFIED_ON_CUDA",
    "INIT_BLOCK_ELEMENTS",
    "Attention",
    "BidirectionalAttention",
    "BlockMask",
    "KVCache",
    "ModelArgs",
    "NeighbourEncoder",
    "RMSNorm",
    "RMSNormFunction",
    "Transformer",
    "TransformerBlock",
    "_flex",
    "apply_rope",
    "attention_mask",
    "canonical_name",
    "document_block_mask",
    "document_ids",
    "document_mask",
    "document_positions",
    "flex_runs",
    "init_rows",
    "rope_tables",
]


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int, bidirectional: bool = False):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = (BidirectionalAttention if bidirectional else Attention)(args, layer_id)
        # RETRO (model.retrieval_layers): chunked cross-attention to the encoded neighbours (plait.model.retrieval)
        retrieves = layer_id in args.retrieval_ids and not bidirectional
        self.cross_norm = RMSNorm(args.dim, args.norm_eps) if retrieves else None
        self.cross = ChunkedCrossAttention(args) if retrieves else None
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward: FeedForward | MoE = (
            MoE(args) if args.is_moe_layer(layer_id) else FeedForward(args.dim, args.hidden_dim)
        )

    def forward(self, x, cos, sin, cache: KVCache | None = None, docs=None, retrieved=None, neighbour_rope=None):
        h = x + self.attention.wo(self.attend(x, cos, sin, cache, docs))
        if self.cross is not None and retrieved is not None:
            assert self.cross_norm is not None  # set with cross
            h = h + self.cross(self.cross_norm(h), retrieved, *neighbour_rope)
        if isinstance(self.feed_forward, MoE):
            return h + self.feed_forward(self.ffn_norm(h))
        return h + self.feed_forward.w2(self.gated(h))

    # The block's two halves up to their output projections. Selective activation checkpointing recomputes
    # each of them as a unit (plait.parallel.activation_checkpoint.apply_ac): what a unit keeps for backward is its
    # input and its matmul and attention outputs, never the projection's partial sums.
    def attend(self, x, cos, sin, cache: KVCache | None = None, docs=None):
        return self.attention.mix(self.attention_norm(x), cos, sin, cache, docs)

    def gated(self, h):
        # Only a dense block's: an MoE layer's forward does not come here
        return cast(FeedForward, self.feed_forward).gate(self.ffn_norm(h))


class NeighbourEncoder(nn.Module):
    """RETRO's encoder: bidirectional blocks over each neighbour's 2c embedded tokens, then a norm
    (plait.model.retrieval)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        plain = args.neighbour_encoder_args()
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(plain, i, bidirectional=True) for i in range(args.retrieval_encoder_layers)}
        )
        self.norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        for block in self.layers.values():
            h = block(h, cos, sin)
        return self.norm(h)


class Transformer(nn.Module):
    """Token ids (B, T) -> logits (B, T, vocab), or with targets (B, T) the summed next-token loss through the
    fused head (plait.model.head: no (B, T, vocab) logits). Build it under ``torch.device("meta")``, then
    ``to_empty(device=...)`` and ``init_weights()``."""

    rope_cos: torch.Tensor  # buffers (register_buffer in __init__)
    rope_sin: torch.Tensor

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        # A dict keyed by the global layer index keeps parameter names stable when a pipeline stage
        # deletes the layers it does not own.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args, i) for i in range(args.n_layers)})
        self.retrieval_encoder: NeighbourEncoder | None = NeighbourEncoder(args) if args.retrieval_ids else None
        copies = args.retrieval_ids and args.retrieval_copy
        self.neighbour_copy: NeighbourCopy | None = NeighbourCopy(args) if copies else None
        points = args.retrieval_ids and args.retrieval_pointer
        self.neighbour_pointer: NeighbourPointer | None = NeighbourPointer(args) if points else None
        self.norm: RMSNorm | None = RMSNorm(args.dim, args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tie_weights()
        # head_loss(h, output weight, targets) -> summed loss; tensor parallelism swaps in its vocabulary-split
        # collectives (plait.parallel.head), the trainer its chunk size.
        self.head_loss = linear_cross_entropy
        cos, sin = rope_tables(args)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        # Document masking (data.document_mask): with an EOS id here, each packed document of a training or
        # validation sequence is attended alone, its positions from 0 (a run's setting, not the model's).
        self.document_eos: int | None = None

    def tie_weights(self) -> None:
        """Share the embedding with the output projection (again after ``to_empty``, which unties them)."""
        if self.args.tie_embeddings and self.output is not None and self.tok_embeddings is not None:
            self.output.weight = self.tok_embeddings.weight

    def forward(
        self,
        tokens: torch.Tensor,
        cache: KVCache | None = None,
        targets: torch.Tensor | None = None,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # A pipeline stage without the embedding receives hidden states (B, T, dim) instead of ids; under
        # document masking it is also given the ids (`documents`), which say where each document starts.
        retrieved = neighbour_ids = None
        if self.retrieval_encoder is not None and cache is not None:
            raise NotImplementedError(
                "a retrieval model decodes without a KV cache: each token sees the neighbours of the chunks "
                "before it (plait.engine.generate generates with them)"
            )
        if self.retrieval_encoder is not None:  # RETRO: the tokens, then their chunks' neighbours
            neighbour_ids = split_retrieved(tokens, self.args)[1]
            tokens, h, retrieved = self.embed_retrieved(tokens)
        else:
            h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        seqlen = tokens.shape[1]  # sequence parallelism may shard h on T: the length is the ids
        ids = documents if documents is not None else tokens if self.tok_embeddings is not None else None
        docs = None
        if self.document_eos is not None and cache is None and ids is not None:
            docs, positions = self.documents(ids)
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]  # (B, T, head_dim)
        else:
            cos, sin = self.rope(cache.pos if cache is not None else 0, seqlen)
        # RETRO: the rotary tables of a neighbour's positions 0 .. 2c - 1, for the cross-attention
        neighbour_rope = self.rope(0, 2 * self.args.retrieval_chunk) if retrieved is not None else None
        for layer in self.layers.values():
            kwargs: dict[str, Any] = {"docs": docs} if docs is not None else {}
            if retrieved is not None and layer.cross is not None:
                kwargs["retrieved"], kwargs["neighbour_rope"] = retrieved, neighbour_rope
            h = layer(h, cos, sin, cache=cache, **kwargs)
        if cache is not None:
            cache.pos += seqlen
        h = self.norm(h) if self.norm is not None else h
        if self.output is None:
            return h
        mixes = retrieved is not None and (self.neighbour_copy is not None or self.neighbour_pointer is not None)
        if targets is not None:
            if type(self.output).forward is not nn.Linear.forward:
                raise TypeError(f"the fused head takes a plain nn.Linear output, not {type(self.output).__name__}")
            if not mixes:
                return self.head_loss(h, self.output.weight, targets)
            a, b = self.copied(h, tokens, neighbour_ids, retrieved, targets)
            mixture = TokenMixture(a.detach(), b.detach())
            loss = self.head_loss(h, self.output.weight, targets, mixture=mixture)
            return loss + mixture_remainder(a, b, mixture, targets)
        logits = self.output(h)
        return self.copied_log_probs(logits, h, tokens, neighbour_ids, retrieved) if mixes else logits

    def copied(self, h, tokens, neighbour_ids, retrieved, targets) -> tuple[torch.Tensor, torch.Tensor]:
        """RETRO's copies (model.retrieval_copy, model.retrieval_pointer): each token's mixture (a, b) per token
        (B, T), its loss -log(a p + b) with p the model's probability of the target (TokenMixture)."""
        a, b = torch.ones_like(tokens, dtype=torch.float32), torch.zeros_like(tokens, dtype=torch.float32)
        if self.neighbour_copy is not None:
            a, b = self.neighbour_copy.mixture(tokens, neighbour_ids, targets)
        if self.neighbour_pointer is not None:
            a, b = self.neighbour_pointer.mix(a, b, h, retrieved, tokens, neighbour_ids, targets)
        return a, b

    def copied_log_probs(self, logits, h, tokens, neighbour_ids, retrieved) -> torch.Tensor:
        """The copies' mixed distribution's log-probabilities (B, T, vocab): what generation samples from."""
        if self.neighbour_copy is not None:
            log_probs = self.neighbour_copy.log_probs(logits, tokens, neighbour_ids)
        else:
            log_probs = torch.log_softmax(logits.float(), -1)
        if self.neighbour_pointer is not None:
            log_probs = self.neighbour_pointer.log_probs(log_probs, h, retrieved, tokens, neighbour_ids)
        return log_probs

    def embed_retrieved(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """RETRO: (the token ids (B, T), their embeddings, the encoded neighbours of each chunk (B, T / c, k 2c,
        dim)) of an input of token ids followed by the neighbours' (plait.model.retrieval). One embedding
        lookup for both (a sharded embedding gathers once)."""
        assert self.tok_embeddings is not None and self.retrieval_encoder is not None
        tokens, neighbours = split_retrieved(x, self.args)
        embedded = self.tok_embeddings(x)
        bsz, groups, k, width = neighbours.shape
        cos, sin = self.rope(0, width)  # each neighbour's own positions
        # Each part a copy of its own: a view would keep the whole row's storage alive for as long as the first
        # block or the encoder keeps its input (a whole row on every tp rank where a block is checkpointed).
        length = tokens.shape[1]
        own, retrieved = embedded[:, :length].clone(), embedded[:, length:].clone()
        encoded = self.retrieval_encoder(retrieved.view(-1, width, embedded.shape[-1]), cos, sin)
        return tokens, own, encoded.reshape(bsz, groups, k * width, -1)

    def documents(self, ids: torch.Tensor) -> tuple[torch.Tensor | BlockMask, torch.Tensor]:
        """Document masking: (what the attention takes: the document ids, or their block mask where
        flex_attention runs; each token's position in its document) of token ids (B, T). Context parallelism
        replaces it: its ranks hold parts of each sequence, and the ids are then those of the whole sequence
        (plait.parallel.context)."""
        assert self.document_eos is not None
        docs = document_ids(ids, self.document_eos)
        positions = document_positions(docs)
        if flex_runs(docs.device):
            return document_block_mask(docs, self.args.sliding_window), positions
        return docs, positions

    def rope(self, start: int, seqlen: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary tables (cos, sin) of positions start .. start + seqlen - 1. Context parallelism replaces
        it with the positions its rank holds (plait.parallel.context)."""
        return self.rope_cos[start : start + seqlen], self.rope_sin[start : start + seqlen]

    @torch.no_grad()
    def init_weights(self, seed: int = 0, assign=None) -> None:
        """Deterministic initialisation: each parameter's values depend only on (seed, its name), so a
        pipeline stage holding a subset of the layers initialises them exactly as the full model would.

        Values are drawn on the CPU in fp32 and copied in, so they are the same on every device. They are
        drawn per block of rows (about INIT_BLOCK_ELEMENTS values each, from a generator of its own), so any
        range of rows can be produced without drawing the rest: ``assign(param, rows)`` receives
        ``rows(start, stop)``, the parameter's rows start:stop, and a parallelised model passes one that draws
        only the rows of its local shard (start-up cost and memory independent of the full model's size).
        Linear and embedding weights ~ N(0, 0.02) truncated at 3 sigma; the projections that write into
        the residual stream (wo, w2) are scaled by 1/sqrt(2 n_layers) (GPT-2); norms start at one, biases at zero,
        and RETRO's cross-attention gates at zero (a retrieval model starts as the same model without retrieval,
        and learns how much to take from its neighbours).
        """
        self.tie_weights()
        cos, sin = rope_tables(self.args, device=self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        for module in self.modules():
            if isinstance(module, MoE):  # balancing state starts neutral
                for buffer in (module.expert_bias, module.load, module.aux_total):
                    buffer.zero_()
            if isinstance(module, LearnedRetriever):  # no index yet: the run builds the first at its start
                module.index_table.zero_()
                module.pending_table.zero_()
                module.index_steps.fill_(-1)
        assign = assign or (lambda param, rows: param.copy_(rows(0, param.shape[0])))
        residual_std = 0.02 / math.sqrt(2 * self.args.n_layers)
        for name, param in self.named_parameters():
            name = canonical_name(name)
            if name.endswith("norm.weight"):
                rows = partial(_ones_rows, tuple(param.shape))
            elif name.endswith(
                (
                    ".bias",
                    "cross.gate.weight",
                    "neighbour_copy.weight",
                    "neighbour_pointer.weight",
                    "pointer.follow",
                    "retriever.scale",
                )
            ):
                # RETRO's cross-attention starts shut and its copy at 0: the model starts as the one without
                # retrieval
                rows = partial(_zeros_rows, tuple(param.shape))
            else:
                std = residual_std if name.endswith(("wo.weight", "w2.weight", "experts.w2")) else 0.02
                rows = partial(init_rows, tuple(param.shape), std, _name_seed(seed, name))
            assign(param, rows)
