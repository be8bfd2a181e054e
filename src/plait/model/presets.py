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

PRESETS: dict[str, dict] = {
    # ~0.8M parameters: unit tests and parallel parity runs.
    "debug": dict(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=4096, multiple_of=32, max_seq_len=512),
    # ~3.4M parameters: the default `plait train` model, a few minutes on two CPU cores.
    "tiny": dict(dim=192, n_layers=4, n_heads=6, n_kv_heads=2, vocab_size=4096, max_seq_len=1024),
    # ~30M parameters.
    "small": dict(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, vocab_size=32000, max_seq_len=2048),
    # ~1.2B parameters: the single-GPU MFU benchmark (Llama 3.2 1B shape, untied).
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
}


def preset_args(name: str) -> ModelArgs:
    """The ModelArgs of a preset (KeyError for an unknown name; config validation reports it nicely)."""
    return ModelArgs(**PRESETS[name])
