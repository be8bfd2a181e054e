"""A Llama-family decoder written plainly in PyTorch.

Nothing here knows about parallelism. Sub-modules carry stable names (``tok_embeddings``, ``layers.<i>``,
``attention.wq`` ...) so tensor-parallel plans and pipeline splits can be applied from outside, and every
top-level piece may be ``None`` so a pipeline stage can keep only its own layers.

The Mistral and Qwen2 variants are settings of the same model: a sliding attention window
(``ModelArgs.sliding_window``) and biases on the q/k/v projections (``ModelArgs.qkv_bias``).

Rotary embeddings use the "rotate half" layout (the one Hugging Face's Llama uses), so weights move to and
from that format without permuting q/k rows.
"""

from __future__ import annotations

import hashlib
import math
import os
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from plait.model.args import ModelArgs
from plait.model.head import TokenMixture, linear_cross_entropy
from plait.model.mlp import FeedForward
from plait.model.moe import MoE
from plait.model.retrieval import ChunkedCrossAttention, NeighbourCopy, split_retrieved
from plait.model.rope import apply_rope, rope_tables


def document_ids(tokens: torch.Tensor, eos: int) -> torch.Tensor:
    """(B, T) the index of each token's document within its row of packed documents: a document ends with
    (and includes) its EOS token, the next starts after it."""
    ends = (tokens == eos).to(torch.int32)
    return ends.cumsum(1) - ends


def document_positions(docs: torch.Tensor) -> torch.Tensor:
    """(B, T) each token's position within its document (0 at its first token)."""
    t = torch.arange(docs.shape[1], device=docs.device).expand_as(docs)
    first = torch.ones_like(docs, dtype=torch.bool)
    first[:, 1:] = docs[:, 1:] != docs[:, :-1]
    return t - torch.where(first, t, torch.zeros_like(t)).cummax(1).values


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return RMSNormFunction.apply(x, self.weight, self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class RMSNormFunction(torch.autograd.Function):
    """x / rms(x) * weight with the statistics in fp32, keeping for backward only its input as it came (bf16
    in a bf16 model) and the inverse RMS (one fp32 per row): backward recomputes the fp32 normalised value
    instead of autograd keeping an fp32 copy of the input and the normalised value as well (per element
    e + 4 + e bytes -> e; Megatron's fused norms keep the same)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # (..., 1)
        ctx.save_for_backward(x, weight, rstd)
        return (xf * rstd).type_as(x) * weight

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        normed = x.float() * rstd
        grad_weight = None
        if ctx.needs_input_grad[1]:
            dims = tuple(range(grad.dim() - 1))
            grad_weight = (grad * normed.type_as(x)).sum(dims).to(weight.dtype)
        g = (grad * weight).float()  # d loss / d normed
        grad_x = rstd * (g - normed * (g * normed).mean(-1, keepdim=True))
        return grad_x.to(x.dtype), grad_weight, None


class KVCache:
    """Keys and values of past positions for incremental decoding: one (B, max_len, n_kv, head_dim) pair
    per layer."""

    def __init__(self, args: ModelArgs, batch_size: int, max_len: int, device, dtype):
        shape = (batch_size, max_len, args.n_kv_heads, args.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(args.n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(args.n_layers)]
        self.pos = 0  # number of positions already stored

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = k.shape[1]
        self.k[layer][:, self.pos : self.pos + t] = k
        self.v[layer][:, self.pos : self.pos + t] = v
        return self.k[layer][:, : self.pos + t], self.v[layer][:, : self.pos + t]


def document_mask(docs: torch.Tensor, window: int) -> torch.Tensor:
    """(B, 1, T, T) boolean mask of packed documents: query i sees key j of the same document, causally (and
    within the sliding window)."""
    same = docs[:, :, None] == docs[:, None, :]
    return (same & attention_mask(0, docs.shape[1], docs.shape[1], window, docs.device))[:, None]


FLEX_VERIFIED_ON_CUDA: set[tuple[int, int]] = set()
"""torch releases on which a GPU session has run document masking through flex_attention against the masked
SDPA path, forward and backward (tests/test_document_mask.py, in bench/gpu_session.py part 2): none yet. Until
then CUDA keeps the masked SDPA path, which runs there already; PLAIT_FLEX_ATTENTION=1 turns flex on."""


def flex_runs(device: torch.device) -> bool:
    """Whether document masking runs torch's block-sparse attention (flex_attention) on this device: on CUDA,
    where its compiled kernel skips the blocks no document spans, forward and backward, once verified for this
    torch release (FLEX_VERIFIED_ON_CUDA) or asked for. Elsewhere (the CPU: flex_attention has no backward
    there) SDPA takes the (B, 1, T, T) mask."""
    if device.type != "cuda":
        return False
    release = tuple(int(x) for x in torch.__version__.split(".")[:2])
    return release in FLEX_VERIFIED_ON_CUDA or os.environ.get("PLAIT_FLEX_ATTENTION") == "1"


def document_block_mask(docs: torch.Tensor, window: int) -> BlockMask:
    """document_mask as flex_attention's block mask: built once per forward, shared by every layer."""
    batch, length = docs.shape

    def same_document(b, h, q, k):
        keep = (docs[b, q] == docs[b, k]) & (k <= q)
        return keep & (q - k < window) if window > 0 else keep

    return create_block_mask(same_document, batch, None, length, length, device=docs.device)


_flex_compiled = None


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask, gqa: bool) -> torch.Tensor:
    """flex_attention, compiled where it runs for speed (CUDA; torch's fused kernel), eager elsewhere."""
    global _flex_compiled
    if q.device.type != "cuda":
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=gqa)
    if _flex_compiled is None:
        _flex_compiled = torch.compile(flex_attention, dynamic=False)
    return _flex_compiled(q, k, v, block_mask=block_mask, enable_gqa=gqa)


def attention_mask(start: int, q_len: int, kv_len: int, window: int, device) -> torch.Tensor:
    """(q_len, kv_len) boolean mask, True where query i (at position start + i) may see key j: causally
    (j <= start + i) and, with a sliding window, within it (start + i - j < window: itself and the window - 1
    keys before it, as transformers' Mistral and Qwen2 masks). The same for every head, so it holds unchanged
    when tensor parallelism leaves each rank a subset of the heads."""
    pos = start + torch.arange(q_len, device=device)[:, None]  # (q_len, 1)
    keys = torch.arange(kv_len, device=device)[None, :]  # (1, kv_len)
    mask = keys <= pos
    if window > 0:
        mask &= pos - keys < window
    return mask


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.head_dim = args.head_dim
        self.n_rep = args.n_heads // args.n_kv_heads
        self.sliding_window = args.sliding_window
        kv_dim = args.n_kv_heads * args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=args.qkv_bias)
        self.wk = nn.Linear(args.dim, kv_dim, bias=args.qkv_bias)
        self.wv = nn.Linear(args.dim, kv_dim, bias=args.qkv_bias)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None = None, docs=None
    ) -> torch.Tensor:
        return self.wo(self.mix(x, cos, sin, cache, docs))

    def mix(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None = None, docs=None
    ) -> torch.Tensor:
        """Attention up to its output projection: (B, T, dim) -> (B, T, n_heads * head_dim). docs (B, T): the
        document of each token of packed sequences, attended each alone (document_mask)."""
        bsz, seqlen, _ = x.shape
        # Head counts come from the (possibly tensor-parallel, hence local) projection sizes: -1 below.
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)  # (B, T, n_heads, head_dim)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)  # (B, T, n_kv_heads, head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        if self.q_norm is not None:  # per head, before the rotation (Qwen3)
            assert self.k_norm is not None  # qk_norm sets both
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        start = 0
        if cache is not None:
            start = cache.pos
            k, v = cache.update(self.layer_id, k, v)  # (B, start + T, n_kv_heads, head_dim)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, T, head_dim)
        if docs is not None:
            out = self.within_documents(q, k, v, docs)
        elif start == 0 and not 0 < self.sliding_window < seqlen:  # plain causal: SDPA's fastest kernels
            out = self.causal(q, k, v)
        else:
            mask = attention_mask(start, seqlen, k.shape[2], self.sliding_window, x.device)
            out = F.scaled_dot_product_attention(q, *self.repeat_kv(k, v), attn_mask=mask)
        return out.transpose(1, 2).reshape(bsz, seqlen, -1)  # (B, T, n_heads * head_dim)

    def causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of the whole sequence: q (B, n_heads, T, head_dim), k / v with n_kv_heads.
        Context parallelism replaces it with the ring over the cp ranks (plait.parallel.context)."""
        return F.scaled_dot_product_attention(q, *self.repeat_kv(k, v), is_causal=True)

    def within_documents(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs) -> torch.Tensor:
        """Causal attention of packed documents, each alone: docs from `Transformer.documents`, the document
        ids (B, T) or their block mask (flex_runs). Context parallelism replaces it with the ring that skips
        the blocks no document spans (plait.parallel.context)."""
        if isinstance(docs, BlockMask):
            return _flex(q, k, v, docs, self.n_rep > 1)
        mask = document_mask(docs, self.sliding_window)
        return F.scaled_dot_product_attention(q, *self.repeat_kv(k, v), attn_mask=mask)

    def repeat_kv(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Grouped-query attention: each kv head serves n_rep query heads (B, heads, T, head_dim)."""
        if self.n_rep == 1:
            return k, v
        return k.repeat_interleave(self.n_rep, dim=1), v.repeat_interleave(self.n_rep, dim=1)


class BidirectionalAttention(Attention):
    """Attention of every token to every other (RETRO's neighbour encoder)."""

    def causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, *self.repeat_kv(k, v))


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
    # each of them as a unit (plait.parallel.parallelize.apply_ac): what a unit keeps for backward is its
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
        copy = self.neighbour_copy if retrieved is not None else None
        if targets is not None:
            if type(self.output).forward is not nn.Linear.forward:
                raise TypeError(f"the fused head takes a plain nn.Linear output, not {type(self.output).__name__}")
            if copy is None:
                return self.head_loss(h, self.output.weight, targets)
            a, b = copy.mixture(tokens, neighbour_ids, targets)
            mixture = TokenMixture(a.detach(), b.detach())
            loss = self.head_loss(h, self.output.weight, targets, mixture=mixture)
            return loss + copy.remainder(a, b, mixture, targets)
        logits = self.output(h)
        return logits if copy is None else copy.log_probs(logits, tokens, neighbour_ids)

    def embed_retrieved(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """RETRO: (the token ids (B, T), their embeddings, the encoded neighbours of each chunk (B, T / c, k 2c,
        dim)) of an input of token ids followed by the neighbours' (plait.model.retrieval). One embedding
        lookup for both (a sharded embedding gathers once)."""
        assert self.tok_embeddings is not None and self.retrieval_encoder is not None
        tokens, neighbours = split_retrieved(x, self.args)
        embedded = self.tok_embeddings(x)
        bsz, groups, k, width = neighbours.shape
        cos, sin = self.rope(0, width)  # each neighbour's own positions
        encoded = self.retrieval_encoder(
            embedded[:, tokens.shape[1] :].reshape(-1, width, embedded.shape[-1]), cos, sin
        )
        return tokens, embedded[:, : tokens.shape[1]], encoded.reshape(bsz, groups, k * width, -1)

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
        assign = assign or (lambda param, rows: param.copy_(rows(0, param.shape[0])))
        residual_std = 0.02 / math.sqrt(2 * self.args.n_layers)
        for name, param in self.named_parameters():
            name = canonical_name(name)
            if name.endswith("norm.weight"):
                rows = partial(_ones_rows, tuple(param.shape))
            elif name.endswith((".bias", "cross.gate.weight", "neighbour_copy.weight")):
                # RETRO's cross-attention starts shut and its copy at 0: the model starts as the one without
                # retrieval
                rows = partial(_zeros_rows, tuple(param.shape))
            else:
                std = residual_std if name.endswith(("wo.weight", "w2.weight", "experts.w2")) else 0.02
                rows = partial(init_rows, tuple(param.shape), std, _name_seed(seed, name))
            assign(param, rows)


INIT_BLOCK_ELEMENTS = 1 << 20
"""Rows are drawn in blocks of about this many values: small enough that a rank drawing only its shard
draws little beyond it, large enough that the per-block generator set-up costs nothing."""


def init_rows(shape: tuple[int, ...], std: float, seed: int, start: int, stop: int) -> torch.Tensor:
    """Rows start:stop of a parameter's initial value. Block b covers rows [b*R, (b+1)*R) with R fixed by the
    global shape, and is drawn from its own generator, so the result is the same whichever rows are asked.
    The blocks are drawn on torch's intra-op thread count of threads at once (each its own generator, so the
    values do not depend on the order): a CPU generator draws on one core, and one block after another was most
    of a 1B model's build (docs/measurements.md, "model build: weights drawn on every thread")."""
    row = math.prod(shape[1:])
    per_block = max(1, INIT_BLOCK_ELEMENTS // max(1, row))
    out = torch.empty((stop - start, *shape[1:]), dtype=torch.float32)

    def draw(b: int) -> None:
        lo, hi = b * per_block, min((b + 1) * per_block, shape[0])
        a, z = max(lo, start), min(hi, stop)
        if (a, z) == (lo, hi):  # the whole block: drawn in place
            _trunc_normal_(out[a - start : z - start], std, _name_seed(seed, f"block{b}"))
        else:
            block = _trunc_normal_(torch.empty((hi - lo, *shape[1:])), std, _name_seed(seed, f"block{b}"))
            out[a - start : z - start] = block[a - lo : z - lo]

    blocks = range(start // per_block, -(-stop // per_block))
    workers = min(len(blocks), torch.get_num_threads())
    if workers > 1:
        with ThreadPoolExecutor(workers, thread_name_prefix="plait-init") as pool:
            list(pool.map(draw, blocks))
    else:
        for b in blocks:
            draw(b)
    return out


def _ones_rows(shape: tuple[int, ...], start: int, stop: int) -> torch.Tensor:
    return torch.ones((stop - start, *shape[1:]))


def _zeros_rows(shape: tuple[int, ...], start: int, stop: int) -> torch.Tensor:
    return torch.zeros((stop - start, *shape[1:]))


def canonical_name(name: str) -> str:
    """A parameter's name without the prefixes wrappers add (activation checkpointing, torch.compile)."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def _name_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1


def _trunc_normal_(out: torch.Tensor, std: float, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return nn.init.trunc_normal_(out, std=std, a=-3 * std, b=3 * std, generator=gen)
