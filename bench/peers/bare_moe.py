"""A hand-written mixture-of-experts training loop over torch._grouped_mm, for side-by-side timing on one GPU
(the 'bare PyTorch' anchor for MoE, as ../shared/gpu/bare_llama.py is for dense models).

Qwen3-MoE's block (optional per-head q/k RMSNorm, heads of their own width, GQA, RoPE) with a mixture of
SwiGLU experts in every block: softmax router, top-k, the k weights renormalised, tokens sorted by expert, the
gate and up projections as one grouped GEMM (E, dim, 2 x width) and the down projection as another, the
results gathered back by the inverse permutation. The group offsets stay on the device (no host sync, static
shapes). bf16 autocast over fp32 master weights (the grouped GEMM's operands cast as autocast would), fused
AdamW, clip 1.0, micro-batches with gradient accumulation, torch.compile of the whole model and its loss.

bench/gpu_peers.py (`--family moe`) passes the shape and computes MFU by plait's FLOPs rule; not project code.
`--device cpu --dtype fp32` runs it on a CPU (the grouped kernel takes fp32 there) to check it before a GPU.
Prints one JSON line: tokens/s (median step), first step, peak memory, loss.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from timing import job_parser, train  # this folder's

p = job_parser()
p.add_argument("--qk-norm", type=int, default=1)
p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="the matmuls' dtype (autocast)")
a = p.parse_args()
dev = torch.device(a.device)
low = torch.bfloat16 if a.dtype == "bf16" else torch.float32
hd, E, K = a.head_dim, a.experts, a.top_k


class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.w = nn.Parameter(torch.ones(d))

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + a.eps)).type_as(x) * self.w


def rope(x, cos, sin):
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return x * cos + torch.cat((-x2, x1), -1) * sin


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(a.dim, E, bias=False)
        scale = a.dim**-0.5
        self.w13 = nn.Parameter(torch.randn(E, a.dim, 2 * a.expert_width) * scale)  # gate | up
        self.w2 = nn.Parameter(torch.randn(E, a.expert_width, a.dim) * a.expert_width**-0.5)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, a.dim)
        probs = self.router(x).float().softmax(-1)
        weights, picked = probs.topk(K, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        flat = picked.reshape(-1)
        order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.zeros(E, dtype=torch.int32, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat, dtype=torch.int32)
        )
        offsets = counts.cumsum(0, dtype=torch.int32)
        xs = x[order // K].to(low)
        gate, up = torch._grouped_mm(xs, self.w13.to(low), offs=offsets).chunk(2, dim=-1)
        ys = torch._grouped_mm(F.silu(gate) * up, self.w2.to(low), offs=offsets)
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=x.device))
        mixed = ys[inverse].view(-1, K, a.dim)
        return (mixed * weights.to(mixed.dtype).unsqueeze(-1)).sum(1).type_as(x).view(shape)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq = nn.Linear(a.dim, a.heads * hd, bias=False)
        self.wk = nn.Linear(a.dim, a.kv * hd, bias=False)
        self.wv = nn.Linear(a.dim, a.kv * hd, bias=False)
        self.wo = nn.Linear(a.heads * hd, a.dim, bias=False)
        self.qn, self.kn = (RMSNorm(hd), RMSNorm(hd)) if a.qk_norm else (nn.Identity(), nn.Identity())
        self.n1, self.n2 = RMSNorm(a.dim), RMSNorm(a.dim)
        self.moe = Experts()

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        h = self.n1(x)
        q = self.qn(self.wq(h).view(B, T, a.heads, hd)).transpose(1, 2)
        k = self.kn(self.wk(h).view(B, T, a.kv, hd)).transpose(1, 2)
        v = self.wv(h).view(B, T, a.kv, hd).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.wo(o.transpose(1, 2).reshape(B, T, a.heads * hd))
        return x + self.moe(self.n2(x))


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(a.vocab, a.dim)
        self.blocks = nn.ModuleList(Block() for _ in range(a.layers))
        self.norm = RMSNorm(a.dim)
        self.out = nn.Linear(a.dim, a.vocab, bias=False)
        inv = 1.0 / (a.rope_theta ** (torch.arange(0, hd, 2).float() / hd))
        f = torch.outer(torch.arange(a.seq).float(), inv)
        f = torch.cat((f, f), -1)
        self.register_buffer("cos", f.cos(), persistent=False)
        self.register_buffer("sin", f.sin(), persistent=False)

    def forward(self, idx, tgt):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x, self.cos, self.sin)
        logits = self.out(self.norm(x))
        return F.cross_entropy(logits.float().reshape(-1, a.vocab), tgt.reshape(-1))


torch.manual_seed(0)
with dev:
    m = LM()


def micro_loss(forward, generator):
    t = torch.randint(0, a.vocab, (a.mb, a.seq + 1), device=dev, generator=generator)
    return forward(t[:, :-1], t[:, 1:])


train(m, micro_loss, dev, a, autocast=low == torch.bfloat16, side=f"bare-moe-{a.dtype}-compile{a.compile}")
