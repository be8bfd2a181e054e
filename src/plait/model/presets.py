"""Model shapes by name. The small ones train on a laptop CPU; the Llama 3 ones are for planning."""

from __future__ import annotations

from plait.model.args import ModelArgs

_LLAMA3_ROPE = dict(
    rope_theta=500000.0,
    rope_scaling_factor=8.0,
    rope_low_freq_factor=1.0,
    rope_high_freq_factor=4.0,
    rope_original_max_seq_len=8192,
)

_QWEN3_30B_A3B = dict(
    dim=2048,
    n_layers=48,
    n_heads=32,
    n_kv_heads=4,
    attention_head_dim=128,
    qk_norm=True,
    vocab_size=151936,
    ffn_hidden_dim=6144,
    norm_eps=1e-6,
    rope_theta=1e6,
    max_seq_len=40960,
    moe_experts=128,
    moe_top_k=8,
    moe_hidden_dim=768,
    moe_norm_topk=True,
)  # fmt: skip
"""Qwen3-30B-A3B's shape, which qwen3-moe-2.8b scales down."""


PRESETS: dict[str, dict] = {
    # 0.72M parameters: unit tests and parallel parity runs.
    "debug": dict(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=4096, multiple_of=32, max_seq_len=512),
    # 3.15M parameters: the default `plait train` model, a few minutes on two CPU cores.
    "tiny": dict(dim=192, n_layers=4, n_heads=6, n_kv_heads=2, vocab_size=4096, max_seq_len=1024),
    # 56.4M parameters.
    "small": dict(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, vocab_size=32000, max_seq_len=2048),
    # 1.50B parameters: the single-GPU MFU benchmark (Llama 3.2 1B shape, untied).
    "llama3-1b": dict(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_hidden_dim=8192,
        max_seq_len=8192,
        **_LLAMA3_ROPE,
    ),
    "llama3-8b": dict(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_dim_multiplier=1.3,
        multiple_of=1024,
        max_seq_len=131072,  # Llama 3.1: rope scaled to 128K tokens
        **_LLAMA3_ROPE,
    ),
    "llama3-70b": dict(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_dim_multiplier=1.3,
        multiple_of=4096,
        max_seq_len=131072,  # Llama 3.1: rope scaled to 128K tokens
        **_LLAMA3_ROPE,
    ),
    "llama3-405b": dict(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_dim_multiplier=1.2,
        multiple_of=4096,
        max_seq_len=131072,  # Llama 3.1: rope scaled to 128K tokens
        **_LLAMA3_ROPE,
    ),
    # The debug model with mixture-of-experts blocks after a dense first one: 8 experts, top 2, a shared expert,
    # both balancing methods (CPU tests of MoE).
    "moe-debug": dict(
        dim=64,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=4096,
        multiple_of=32,
        max_seq_len=512,
        moe_experts=8,
        moe_top_k=2,
        moe_hidden_dim=32,
        moe_shared_experts=1,
        moe_dense_layers=1,
        moe_aux_loss=0.01,
        moe_bias_rate=1e-3,
    ),  # fmt: skip
    # Qwen3-30B-A3B's shape (128 experts, top 8, q/k norms, head size 128): 30.5B parameters, 3.3B active.
    "qwen3-30b-a3b": _QWEN3_30B_A3B,
    # Qwen3-MoE's block (q/k norms, head size 128, 8 of 64 experts of width 768, normalised top-k) at a size that
    # trains on one GPU with AdamW, the MoE of the GPU benchmarks (bench/gpu_session.py):
    # 2.81B parameters, 0.70B active.
    "qwen3-moe-2.8b": dict(
        _QWEN3_30B_A3B,
        dim=1024,
        n_layers=16,
        n_heads=16,
        ffn_hidden_dim=3072,
        max_seq_len=4096,
        moe_experts=64,
    ),  # fmt: skip
    # DeepSeek-V3's MoE shape for planning (256 routed experts, top 8, one shared, 3 dense first blocks, sigmoid
    # router, loss-free balancing) with grouped-query attention in place of its multi-head latent attention:
    # 675B parameters, 41B active (DeepSeek-V3: 671B, 37B).
    "deepseek-v3-shaped": dict(
        dim=7168,
        n_layers=61,
        n_heads=128,
        n_kv_heads=8,
        attention_head_dim=128,
        vocab_size=129280,
        ffn_hidden_dim=18432,
        norm_eps=1e-6,
        rope_theta=10000.0,
        max_seq_len=131072,
        moe_experts=256,
        moe_top_k=8,
        moe_hidden_dim=2048,
        moe_shared_experts=1,
        moe_dense_layers=3,
        moe_score="sigmoid",
        moe_norm_topk=True,
        moe_bias_rate=1e-3,
    ),  # fmt: skip
}


def preset_args(name: str) -> ModelArgs:
    """The ModelArgs of a preset (KeyError for an unknown name; config validation reports it nicely)."""
    return ModelArgs(**PRESETS[name])
