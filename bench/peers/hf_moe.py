"""Hugging Face transformers' own mixture-of-experts model, trained the way a transformers user writes it:
Qwen3MoeForCausalLM (q/k norms, wide heads; the `qwen3-moe-2.8b` shape) or MixtralForCausalLM (Llama attention;
the 1.91B MoE of the GPU-speed issue), SDPA, transformers' default experts implementation (grouped_mm where
torch can run it), torch.compile, fused AdamW, clip 1.0, gradient accumulation, no router auxiliary loss (as
plait's presets). `--weights fp32` trains bf16 autocast over fp32 weights (plait's recipe); `--weights bf16`
keeps the weights in bf16 (transformers' grouped_mm then runs natively, also under compile).

The peer of `plait bench` for MoE in bench/gpu_peers.py (`--family moe`), which passes the shape; not project
code. Prints one JSON line: tokens/s (median step), first step, peak memory, loss. MFU is the driver's, by
plait's own FLOPs rule for the same shape.
"""

import torch
from timing import job_parser, train  # this folder's

p = job_parser()
p.add_argument("--arch", choices=["qwen3_moe", "mixtral"], default="qwen3_moe")
p.add_argument("--weights", choices=["fp32", "bf16"], default="fp32")
a = p.parse_args()

import transformers  # noqa: E402
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402

common = dict(
    vocab_size=a.vocab,
    hidden_size=a.dim,
    num_hidden_layers=a.layers,
    num_attention_heads=a.heads,
    num_key_value_heads=a.kv,
    head_dim=a.head_dim,
    max_position_embeddings=a.seq,
    rms_norm_eps=a.eps,
    rope_theta=a.rope_theta,  # transformers 5 turns it into rope_parameters; 4.x reads it as it is
    num_experts_per_tok=a.top_k,
    output_router_logits=False,
    tie_word_embeddings=False,
    attn_implementation="sdpa",
)
if a.arch == "qwen3_moe":
    cfg = Qwen3MoeConfig(
        **common,
        intermediate_size=a.expert_width,  # dense MLP width: no block is dense here (mlp_only_layers empty)
        moe_intermediate_size=a.expert_width,
        num_experts=a.experts,
        norm_topk_prob=True,
        decoder_sparse_step=1,
    )
    build = Qwen3MoeForCausalLM
else:
    cfg = MixtralConfig(**common, intermediate_size=a.expert_width, num_local_experts=a.experts)
    build = MixtralForCausalLM

dev = torch.device(a.device)
torch.manual_seed(0)
with dev:
    m = build(cfg)
if a.weights == "bf16":
    m = m.to(torch.bfloat16)
m.train()


def micro_loss(forward, generator):
    t = torch.randint(0, a.vocab, (a.mb, a.seq), device=dev, generator=generator)
    return forward(input_ids=t, labels=t).loss


train(
    m,
    micro_loss,
    dev,
    a,
    autocast=a.weights == "fp32" and dev.type == "cuda",
    side=f"hf-{a.arch}-{a.weights}-compile{a.compile}",
    transformers=transformers.__version__,
    experts_implementation=getattr(m.config, "_experts_implementation", None),  # 4.x: a loop over experts
)
