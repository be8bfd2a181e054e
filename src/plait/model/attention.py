"""Causal self-attention of the Llama family: grouped-query heads, rotary embeddings, optional q/k norms
(Qwen3), a sliding window (Mistral, Qwen2), a KV cache for decoding, and document masking of packed sequences
(the (B, 1, T, T) mask SDPA takes, or flex_attention's block mask where that runs). Nothing here knows about
parallelism: tensor parallelism splits the projections from outside, context parallelism replaces `causal`
and `within_documents` (plait.parallel.context)."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from plait.model.args import ModelArgs
from plait.model.norm import RMSNorm
from plait.model.rope import apply_rope


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
SDPA path, forward and backward (tests/parallel/test_document_mask.py, in bench/gpu_session.py part 2): none yet. Until
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
