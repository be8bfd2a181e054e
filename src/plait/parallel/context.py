"""Context parallelism: every sequence split over the ``cp`` ranks, attention computed exactly as a ring.

Layout. A sequence of T tokens is cut into 2 x cp equal chunks; cp rank r holds chunk r and its mirror
2 cp - 1 - r (a head chunk and a tail chunk), so under causal attention every rank does the same work (the
load balancing of Megatron's and torchtitan's CP). Inputs, targets and rotary positions are sharded alike
(`shard_sequence`, `apply_cp`); everything but attention is position-wise and runs on the local tokens as is.

Ring attention (`ring_attention`, an opaque torch op so activation checkpointing keeps its output and
torch.compile leaves it whole). Forward: each rank's keys and values travel once round the ring (cp - 1
point-to-point hops, the next hop overlapping the current block's compute); each block of (query chunk, key
chunk) that causality allows is computed with its log-sum-exp, and the blocks are merged with the online
softmax, so the result is exact softmax attention over the whole sequence. Backward: the keys and values go
round again, followed one step behind by their fp32 gradient accumulators (cp hops, each overlapping the next
block's compute but the last, which brings them home);
each block's gradients come from the attention kernel's own backward given the merged output and
log-sum-exp (flash attention's recomputation), so they too are exact.

Document masking (data.document_mask). Document ids come from the whole sequence: each rank's token ids go
round the cp group once per forward (an all-gather of B x T/cp ints), so a document may start on one rank and
end on another, and positions restart per document as in one process. The ring then classifies every block
of (query chunk, key chunk) from the chunks' first and last document ids (ids grow along a sequence): a
block no document spans is skipped, forward and backward (no kernel; the keys still travel the ring: most
blocks once documents are shorter than a chunk); a block inside one document runs the plain kernel; the rest
run the fp32 math kernel with the block's document mask. The classification is one small table per forward,
read to the host once and kept for every layer and the backward while the same document ids are alive. No
document length rule: a document may be any length, cross chunks and ranks.

Kernels: on the CPU the blocks run torch's flash attention for CPU (the kernel SDPA itself uses there, so
at cp = 1 the ring is SDPA); elsewhere a plain fp32 matmul/log-sum-exp kernel computes the same. Grouped-query
attention: keys and values travel with n_kv_heads (n_heads / n_kv_heads times fewer bytes) and are repeated
per block.
"""

from __future__ import annotations

import math
import weakref
from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor, nn

from plait.core import torch_private
from plait.parallel.env import register_group, registered_group


def chunks_of(rank: int, cp: int) -> tuple[int, int]:
    """The two chunks (of 2 x cp) of every sequence that cp rank `rank` holds: a head one and its mirror."""
    return rank, 2 * cp - 1 - rank


def shard_sequence(x: Tensor, cp: int, rank: int, dim: int = 1) -> Tensor:
    """This cp rank's part of x along `dim` (the sequence): its two chunks, head first."""
    if cp == 1:
        return x
    parts = x.chunk(2 * cp, dim)
    return torch.cat([parts[i] for i in chunks_of(rank, cp)], dim)


def local_positions(length: int, cp: int, rank: int, device=None) -> Tensor:
    """Positions (in the whole sequence) of the `length` tokens this cp rank holds."""
    return shard_sequence(torch.arange(length * cp, device=device), cp, rank, dim=0)


def context_shard(meshes, *tensors: Tensor) -> tuple[Tensor, ...]:
    """(B, T) batches (inputs, targets) cut to this rank's part of each sequence; unchanged at cp = 1."""
    cp = meshes.dims.cp
    if cp == 1:
        return tensors
    rank = meshes.cp.get_local_rank()
    return tuple(shard_sequence(t, cp, rank) for t in tensors)


def apply_cp(model: nn.Module, cp_mesh) -> None:
    """Attention of every block as the ring over cp_mesh, and the rotary tables indexed by the positions this
    rank holds (plait's Transformer: `Attention.causal` and `Transformer.rope` are the seams)."""
    from plait.model.llama import Transformer, TransformerBlock

    ring = register_group(cp_mesh.get_group())
    if not isinstance(model, Transformer):
        raise TypeError("context parallelism splits plait's Transformer")
    cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    for block in model.layers.values():
        assert isinstance(block, TransformerBlock)
        setattr(block.attention, "causal", partial(ring_causal, ring=ring))  # noqa: B010 - the seam's method
        setattr(block.attention, "within_documents", partial(ring_documents, ring=ring))  # noqa: B010
    setattr(model, "rope", partial(_local_rope, model, cp, rank))  # noqa: B010
    setattr(model, "documents", partial(_whole_documents, model, ring, cp, rank))  # noqa: B010


def _whole_documents(model, ring: str, cp: int, rank: int, ids: Tensor) -> tuple[Tensor, Tensor]:
    """`Transformer.documents` under context parallelism: the document ids of the whole sequences (B, T) from
    this rank's token ids (B, T / cp) and the other ranks', and the positions of this rank's tokens in theirs."""
    from plait.model.llama import document_ids, document_positions

    parts = [torch.empty_like(ids) for _ in range(cp)]
    dist.all_gather(parts, ids.contiguous(), group=registered_group(ring))
    docs = document_ids(unshard_sequence(parts, cp), model.document_eos)
    return docs, shard_sequence(document_positions(docs), cp, rank)


def unshard_sequence(parts: list[Tensor], cp: int, dim: int = 1) -> Tensor:
    """The whole sequences from every cp rank's part (`shard_sequence`'s inverse): parts[r] is rank r's."""
    chunks: list[Tensor] = [parts[0]] * (2 * cp)
    for r, part in enumerate(parts):
        head, tail = part.chunk(2, dim)
        first, mirror = chunks_of(r, cp)
        chunks[first], chunks[mirror] = head, tail
    return torch.cat(chunks, dim)


def _local_rope(model, cp: int, rank: int, start: int, seqlen: int) -> tuple[Tensor, Tensor]:
    if start:
        raise ValueError("context parallelism runs whole sequences (no KV cache)")
    positions = local_positions(seqlen, cp, rank, device=model.rope_cos.device)
    return model.rope_cos[positions], model.rope_sin[positions]


def ring_causal(q: Tensor, k: Tensor, v: Tensor, *, ring: str) -> Tensor:
    """`Attention.causal` under context parallelism: q (B, n_heads, L, hd), k / v (B, n_kv_heads, L, hd),
    this rank's L tokens of each sequence."""
    return torch.ops.plait.ring_attention(q.contiguous(), k.contiguous(), v.contiguous(), ring)[0]


def ring_documents(q: Tensor, k: Tensor, v: Tensor, docs: Tensor, *, ring: str) -> Tensor:
    """`Attention.within_documents` under context parallelism: as ring_causal, each token attending only its
    own document; docs (B, T) the document ids of the whole sequences (`_whole_documents`)."""
    return torch.ops.plait.ring_attention(q.contiguous(), k.contiguous(), v.contiguous(), ring, docs)[0]


# ---- document blocks: which (query chunk, key chunk) blocks a run of packed documents leaves

SKIP, MASKED, WHOLE = 0, 1, 2  # no document spans the block / some do / one document holds all of it


def block_kinds(docs: Tensor, cp: int) -> list[list[int]]:
    """(2 cp x 2 cp) the kind of block (query chunk i, key chunk j) of sequences whose document ids (B, T)
    grow along T: SKIP where every row's query chunk starts after its key chunk's last document ends, WHOLE
    where every row's two chunks lie in one document, MASKED otherwise. (Only j <= i are ever asked for.)"""
    ends = docs.reshape(docs.shape[0], 2 * cp, -1)
    first, last = ends[:, :, 0], ends[:, :, -1]  # (B, 2 cp)
    skip = (first[:, :, None] > last[:, None, :]).all(0)
    whole = (last[:, :, None] == first[:, None, :]).all(0)
    kinds = torch.where(skip, SKIP, torch.where(whole, WHOLE, MASKED))
    return kinds.tolist()  # the one host read of a forward's document layout


_kinds_seen: tuple[weakref.ref, int, int, list[list[int]]] | None = None


def _kinds(docs: Tensor, cp: int) -> list[list[int]]:
    """block_kinds, read once per document ids tensor: every layer, forward and backward, takes the same."""
    global _kinds_seen
    seen = _kinds_seen
    if seen is not None and seen[0]() is docs and seen[1] == torch_private.version_counter(docs) and seen[2] == cp:
        return seen[3]
    kinds = block_kinds(docs, cp)
    _kinds_seen = (weakref.ref(docs), torch_private.version_counter(docs), cp, kinds)
    return kinds


def _block_mask(docs: Tensor, c: int, i: int, j: int, causal: bool) -> Tensor:
    """(B, 1, c, c) True where a query of chunk i and a key of chunk j (chunks of c tokens) share a document,
    and, within one chunk, the key is not after the query."""
    mask = docs[:, i * c : (i + 1) * c, None] == docs[:, None, j * c : (j + 1) * c]
    if causal:
        mask &= torch.ones(c, c, dtype=torch.bool, device=docs.device).tril()
    return mask[:, None]


# ---- block kernels: one (query chunk, key chunk) pair; causal means the two chunks are the same positions


def _repeat(x: Tensor, heads: int) -> Tensor:
    rep = heads // x.shape[1]
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)


def _fold(grad: Tensor, kv_heads: int) -> Tensor:
    """Gradient of repeated keys/values (B, H, c, hd) summed back to their n_kv_heads."""
    b, h, c, d = grad.shape
    return grad if h == kv_heads else grad.view(b, kv_heads, h // kv_heads, c, d).sum(2)


def _flash(x: Tensor) -> bool:
    """Whether a block runs torch's flash attention kernel (on the CPU) rather than the fp32 math one."""
    return x.device.type == "cpu"


def _block_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """One block's output and log-sum-exp; mask (B, 1, c, c): its documents, None where one holds it all."""
    k, v = _repeat(k, q.shape[1]), _repeat(v, q.shape[1])
    if _flash(q) and mask is None:
        out, lse = torch_private.cpu_flash_attention(q, k, v, causal)
        return out, lse.float()
    scores = _scores(q, k, causal, mask)
    lse = scores.logsumexp(-1)
    return ((scores - lse[..., None]).exp() @ v.float()).to(q.dtype), lse


def _block_backward(dout, q, k, v, out, lse, causal: bool, mask: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one block given the merged output and log-sum-exp of its query rows: its exact share."""
    kv_heads = k.shape[1]
    k, v = _repeat(k, q.shape[1]), _repeat(v, q.shape[1])
    if _flash(q) and mask is None:
        dq, dk, dv = torch_private.cpu_flash_attention_backward(dout, q, k, v, out, lse, causal)
    else:
        p = (_scores(q, k, causal, mask) - lse[..., None]).exp()
        dout32 = dout.float()
        dv = p.transpose(-1, -2) @ dout32
        dp = dout32 @ v.float().transpose(-1, -2)
        ds = p * (dp - (dout32 * out.float()).sum(-1, keepdim=True)) / math.sqrt(q.shape[-1])
        dq, dk = ds @ k.float(), ds.transpose(-1, -2) @ q.float()
    return dq.float(), _fold(dk.float(), kv_heads), _fold(dv.float(), kv_heads)


# A masked score: exp of it less any log-sum-exp is exactly 0, and a row of a block with every key masked
# (a document that starts after the block's keys end) is finite: its weight in the merge is then exactly 0.
_MASKED_SCORE = -1e30


def _scores(q: Tensor, k: Tensor, causal: bool, mask: Tensor | None = None) -> Tensor:
    s = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if mask is not None:  # the documents' mask (causal already on the diagonal block)
        return s.masked_fill(~mask, _MASKED_SCORE)
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril(), float("-inf"))
    return s


def _blocks(rank: int, source: int, cp: int, docs: Tensor | None, c: int):
    """(query chunk slot, key chunk slot, causal, mask) for the blocks that causality (and the documents, if
    any) leave between this rank's query chunks and the source rank's key chunks (slot 0: the head chunk, 1:
    the tail chunk); mask None where the block runs unmasked."""
    mine, theirs = chunks_of(rank, cp), chunks_of(source, cp)
    kinds = _kinds(docs, cp) if docs is not None else None
    for qs, i in enumerate(mine):
        for ks, j in enumerate(theirs):
            kind = WHOLE if kinds is None else kinds[i][j]
            if j > i or kind == SKIP:
                continue
            yield qs, ks, j == i, _block_mask(docs, c, i, j, j == i) if docs is not None and kind == MASKED else None


class _Ring:
    """Point-to-point hops to the next cp rank (receiving from the previous), overlapping compute."""

    def __init__(self, ring: str):
        self.group = registered_group(ring)
        self.cp, self.rank = self.group.size(), self.group.rank()
        self.next = dist.get_global_rank(self.group, (self.rank + 1) % self.cp)
        self.prev = dist.get_global_rank(self.group, (self.rank - 1) % self.cp)

    def shift(self, x: Tensor, tag: int = 0):
        """Start sending x on and receiving the previous rank's; returns (received buffer, wait). Messages of
        one kind share a tag (keys and values 0, their gradients 1), so two kinds in flight never cross."""
        got = torch.empty_like(x)
        ops = [
            dist.P2POp(dist.isend, x, self.next, self.group, tag=tag),
            dist.P2POp(dist.irecv, got, self.prev, self.group, tag=tag),
        ]
        reqs = dist.batch_isend_irecv(ops)
        return got, lambda: [r.wait() for r in reqs]


def ring_forward(q: Tensor, k: Tensor, v: Tensor, ring: str, docs: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Exact causal attention of this rank's queries over every rank's keys: (output (B, H, L, hd),
    log-sum-exp (B, H, L) fp32); with docs (B, cp x L), each query only over its own document's keys."""
    net = _Ring(ring)
    c = q.shape[2] // 2
    q_slots = (q[:, :, :c], q[:, :, c:])
    out = [torch.zeros_like(s, dtype=torch.float32) for s in q_slots]
    lse = [torch.full(s.shape[:3], float("-inf"), device=q.device) for s in q_slots]
    kv = torch.stack([k, v])
    for step in range(net.cp):
        source = (net.rank - step) % net.cp
        if step < net.cp - 1:
            incoming, wait = net.shift(kv)
        for qs, ks, causal, mask in _blocks(net.rank, source, net.cp, docs, c):
            o, l = _block_forward(
                q_slots[qs], kv[0][:, :, ks * c : (ks + 1) * c], kv[1][:, :, ks * c : (ks + 1) * c], causal, mask
            )
            merged = torch.logaddexp(lse[qs], l)
            out[qs] = out[qs] * (lse[qs] - merged).exp()[..., None] + o.float() * (l - merged).exp()[..., None]
            lse[qs] = merged
        if step < net.cp - 1:
            wait()
            kv = incoming
    result = _heads_inner(q)
    result.copy_(torch.cat(out, dim=2))
    return result, torch.cat(lse, dim=2)


def _heads_inner(q: Tensor) -> Tensor:
    """An empty (B, H, L, hd) tensor laid out as (B, L, H, hd), as SDPA returns its output: the output
    projection's input (B, L, H x hd) is then a view of it, not a copy kept for backward beside it."""
    b, h, n, d = q.shape
    return q.new_empty((b, n, h, d)).transpose(1, 2)


ring_attention = torch.library.custom_op("plait::ring_attention", ring_forward, mutates_args=())


@ring_attention.register_fake
def _(q, k, v, ring, docs=None):
    return _heads_inner(q), q.new_empty(q.shape[:3], dtype=torch.float32)


def ring_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, ring: str, docs: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of q, k, v from the output's gradient, the merged output and log-sum-exp."""
    net = _Ring(ring)
    c = q.shape[2] // 2
    slot = lambda x, s: x[:, :, s * c : (s + 1) * c]  # noqa: E731
    dq = torch.zeros_like(q, dtype=torch.float32)
    kv = torch.stack([k, v])
    arriving = None  # the gradient of the keys held now, summed by the ranks that held them before
    for step in range(net.cp):
        source = (net.rank - step) % net.cp
        if step < net.cp - 1:
            incoming, wait = net.shift(kv)
        dkv = torch.zeros_like(kv, dtype=torch.float32)
        for qs, ks, causal, mask in _blocks(net.rank, source, net.cp, docs, c):
            g = _block_backward(
                *(slot(dout, qs), slot(q, qs), slot(kv[0], ks), slot(kv[1], ks), slot(out, qs), slot(lse, qs)),
                causal,
                mask,
            )
            slot(dq, qs).add_(g[0])
            slot(dkv[0], ks).add_(g[1])
            slot(dkv[1], ks).add_(g[2])
        if arriving is not None:  # it travelled while this step computed
            buffer, wait_grad = arriving
            wait_grad()
            dkv += buffer
        if net.cp > 1:  # on to the next holder; after the last step that is the keys' owner
            arriving = net.shift(dkv, tag=1)
        if step < net.cp - 1:
            wait()
            kv = incoming
    if arriving is not None:
        dkv, wait_grad = arriving
        wait_grad()
    return dq.to(q.dtype), dkv[0].to(k.dtype, copy=True), dkv[1].to(v.dtype, copy=True)  # own storage each


ring_attention_backward = torch.library.custom_op("plait::ring_attention_backward", ring_backward, mutates_args=())


@ring_attention_backward.register_fake
def _(dout, q, k, v, out, lse, ring, docs=None):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, ring, docs = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, docs)
    ctx.ring = ring
    ctx.set_materialize_grads(True)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, docs = ctx.saved_tensors
    dq, dk, dv = torch.ops.plait.ring_attention_backward(dout.contiguous(), q, k, v, out, lse, ctx.ring, docs)
    return dq, dk, dv, None, None


ring_attention.register_autograd(_backward, setup_context=_setup_context)
