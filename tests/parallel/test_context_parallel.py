"""Context parallelism's pieces: the load-balanced sequence split and the ring attention, forward and backward,
against SDPA over the whole sequence on real gloo groups (cp = 1, 2, 4; grouped-query heads; both block
kernels: torch's flash attention for CPU and the fp32 math one the other devices use); with packed documents
(data.document_mask), against SDPA under the documents' mask, skipping the blocks no document spans.

Tolerance 1e-5 absolute on values and gradients of order 1 (fp32): the ring sums the same softmax in blocks
(merged through their log-sum-exp), so it moves results by fp32 rounding only."""

from __future__ import annotations

import pytest
import torch

from parallel_harness import free_port, join_as_rank, run_ranks
from plait.model.llama import document_ids, document_mask
from plait.parallel.context import (
    MASKED,
    SKIP,
    WHOLE,
    block_kinds,
    chunks_of,
    local_positions,
    shard_sequence,
    unshard_sequence,
)

ATOL = 1e-5


def test_each_rank_holds_a_head_and_a_tail_chunk():
    assert [chunks_of(r, 4) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert local_positions(4, 2, 0).tolist() == [0, 1, 6, 7]
    assert local_positions(4, 2, 1).tolist() == [2, 3, 4, 5]
    x = torch.arange(16).view(2, 8)
    parts = [shard_sequence(x, 2, r) for r in range(2)]
    assert sorted(torch.cat(parts, 1)[0].tolist()) == list(range(8))
    assert shard_sequence(x, 1, 0) is x
    for cp in (1, 2, 4):
        y = torch.arange(3 * 8 * cp).view(3, 8 * cp)
        assert torch.equal(unshard_sequence([shard_sequence(y, cp, r) for r in range(cp)], cp), y)


def test_blocks_are_skipped_where_no_document_spans_them():
    # cp = 2: four chunks of 3 tokens. Row 0: documents [0..2] [3..7] [8..11]; row 1: one document.
    docs = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2], [0] * 12])
    kinds = block_kinds(docs, 2)
    assert kinds[1][0] == MASKED  # skipped by row 0 but spanned by row 1: computed, masked
    docs[1] = docs[0]
    kinds = block_kinds(docs, 2)
    assert [kinds[i][i] for i in range(4)] == [WHOLE, WHOLE, MASKED, WHOLE]
    assert (kinds[1][0], kinds[2][1], kinds[3][2]) == (SKIP, MASKED, MASKED)
    assert (kinds[2][0], kinds[3][0], kinds[3][1]) == (SKIP, SKIP, SKIP)


def _ring_vs_sdpa(rank: int, world: int, port: int, math_kernel: bool, device: str = "cpu") -> None:
    join_as_rank(rank, world, port)
    import torch.distributed as dist
    import torch.nn.functional as F

    from plait.parallel import context

    dist.init_process_group("gloo" if device == "cpu" else "nccl", rank=rank, world_size=world)
    torch.set_default_device(device)
    if math_kernel:
        context._flash = lambda x: False
    from plait.parallel.env import register_group

    group = dist.new_group(list(range(world)))
    register_group(group)
    gen = torch.Generator(device).manual_seed(0)
    B, H, KV, T, D = 2, 4, 2, 8 * world, 16
    q, k, v = (torch.randn(B, h, T, D, generator=gen, requires_grad=True) for h in (H, KV, KV))
    dout = torch.randn(B, H, T, D, generator=gen)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    ref.backward(dout)
    local = [shard_sequence(t.detach(), world, rank, dim=2).requires_grad_() for t in (q, k, v)]
    out = context.ring_causal(*local, ring=group.group_name)
    out.backward(shard_sequence(dout, world, rank, dim=2))
    torch.testing.assert_close(out, shard_sequence(ref, world, rank, dim=2), atol=ATOL, rtol=0)
    for got, full in zip(local, (q, k, v), strict=True):
        torch.testing.assert_close(got.grad, shard_sequence(full.grad, world, rank, dim=2), atol=ATOL, rtol=0)
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("math_kernel", [False, True], ids=["flash-cpu", "math"])
def test_ring_attention_equals_sdpa_forward_and_backward(world, math_kernel):
    run_ranks(_ring_vs_sdpa, (world, free_port(), math_kernel), world)


def _ring_documents_vs_sdpa(rank: int, world: int, port: int, math_kernel: bool, short: bool) -> None:
    """Packed documents of random lengths (some crossing chunks and ranks; `short`: each inside one chunk, so
    every block but the diagonal ones is skipped), against SDPA under the documents' mask."""
    join_as_rank(rank, world, port)
    import torch.distributed as dist
    import torch.nn.functional as F

    from plait.parallel import context

    dist.init_process_group("gloo", rank=rank, world_size=world)
    if math_kernel:
        context._flash = lambda x: False
    from plait.parallel.env import register_group

    group = dist.new_group(list(range(world)))
    register_group(group)
    gen = torch.Generator().manual_seed(0)
    B, H, KV, T, D = 2, 4, 2, 8 * world, 16
    eos = torch.zeros(B, T, dtype=torch.long)
    if short:
        eos[:, 3::4] = 1  # documents of 4 tokens, one per chunk
    else:
        eos[0] = (torch.rand(T, generator=gen) < 0.2).long()  # row 1: one document throughout
    docs = document_ids(eos, 1)
    q, k, v = (torch.randn(B, h, T, D, generator=gen, requires_grad=True) for h in (H, KV, KV))
    dout = torch.randn(B, H, T, D, generator=gen)
    mask = document_mask(docs, 0)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask)
    ref.backward(dout)
    blocks = []
    forward = context._block_forward
    context._block_forward = lambda *a: blocks.append(a[-1] is not None) or forward(*a)
    local = [shard_sequence(t.detach(), world, rank, dim=2).requires_grad_() for t in (q, k, v)]
    out = context.ring_documents(*local, docs, ring=group.group_name)
    out.backward(shard_sequence(dout, world, rank, dim=2))
    torch.testing.assert_close(out, shard_sequence(ref, world, rank, dim=2), atol=ATOL, rtol=0)
    for got, full in zip(local, (q, k, v), strict=True):
        torch.testing.assert_close(got.grad, shard_sequence(full.grad, world, rank, dim=2), atol=ATOL, rtol=0)
    if short:  # the two diagonal blocks, each one document: nothing else computed, nothing masked
        assert blocks == [False, False], blocks
    else:
        assert len(blocks) <= 2 * world + 1 and (world == 1 or any(blocks)), blocks
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("math_kernel", [False, True], ids=["flash-cpu", "math"])
@pytest.mark.parametrize("short", [False, True], ids=["crossing", "short"])
def test_ring_attention_with_documents_equals_masked_sdpa(world, math_kernel, short):
    run_ranks(_ring_documents_vs_sdpa, (world, free_port(), math_kernel, short), world)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the GPU sessions run it)")
def test_cuda_ring_attention_at_cp_1_equals_sdpa():
    """The CUDA path of the ring (its fp32 math block kernel, NCCL) against CUDA SDPA, forward and backward."""
    run_ranks(_ring_vs_sdpa, (1, free_port(), False, "cuda"), 1)
