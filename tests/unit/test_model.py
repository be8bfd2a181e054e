"""The model alone: shapes, causality, rotary embeddings, GQA, KV cache, initialisation, FLOP formula."""

import math

import pytest
import torch

from plait.engine.generate import generate, sample_next
from plait.engine.trainer import build_model
from plait.model import KVCache, ModelArgs, Transformer, preset_args
from plait.model.llama import apply_rope, attention_mask, rope_tables

ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, multiple_of=16, max_seq_len=64)
QWEN2_LIKE = ModelArgs(**{**ARGS.__dict__, "sliding_window": 4, "qkv_bias": True})


def make(args=ARGS, seed=0):
    return build_model(args, torch.device("cpu"), seed)


@pytest.mark.parametrize("args", [ARGS, QWEN2_LIKE], ids=["llama", "qwen2-like"])
def test_output_shape_and_param_count(args):
    model = make(args)
    x = torch.randint(0, args.vocab_size, (3, 17))
    assert model(x).shape == (3, 17, args.vocab_size)
    assert sum(p.numel() for p in model.parameters()) == args.num_params()


def test_causal_masking():
    """Changing a later token must not change logits at earlier positions."""
    model = make()
    x = torch.randint(0, ARGS.vocab_size, (1, 20))
    y = x.clone()
    y[0, 12:] = (y[0, 12:] + 1) % ARGS.vocab_size
    a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :12], b[:, :12], rtol=0, atol=0)
    assert not torch.allclose(a[:, 12:], b[:, 12:])


def test_sliding_window_limits_what_each_position_sees():
    """With a window of 4 a position sees 3 earlier ones per layer, so after 2 layers position p depends on
    tokens p-6..p only (transformers' Mistral: key j is visible to query i when 0 <= i - j < window)."""
    assert attention_mask(0, 6, 6, 4, "cpu").tolist()[5] == [False, False, True, True, True, True]
    model = make(QWEN2_LIKE)
    x = torch.randint(0, ARGS.vocab_size, (1, 20))
    y = x.clone()
    y[0, 3] = (y[0, 3] + 1) % ARGS.vocab_size
    a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :3], b[:, :3], rtol=0, atol=0)
    assert not torch.allclose(a[:, 9], b[:, 9])  # 9 - 3 = 6: the farthest position it still reaches
    torch.testing.assert_close(a[:, 10:], b[:, 10:], rtol=0, atol=0)


def test_biases_start_at_zero():
    model = make(QWEN2_LIKE)
    biases = {n: p for n, p in model.named_parameters() if n.endswith(".bias")}
    assert len(biases) == 3 * QWEN2_LIKE.n_layers and all(not p.any() for p in biases.values())


def test_init_is_deterministic_and_per_name():
    a, b, c = make(seed=1), make(seed=1), make(seed=2)
    for (n, p), (_, q), (_, r) in zip(a.named_parameters(), b.named_parameters(), c.named_parameters(), strict=True):
        assert torch.equal(p, q), n
        if not n.endswith("norm.weight"):
            assert not torch.equal(p, r), n
    # A parameter's values depend on its name only: a deeper model shares the first layers' weights.
    deeper = make(ModelArgs(**{**ARGS.__dict__, "n_layers": 3}), seed=1)
    torch.testing.assert_close(deeper.layers["1"].attention.wq.weight, a.layers["1"].attention.wq.weight)


def test_rope_is_a_rotation_and_relative():
    cos, sin = rope_tables(ARGS)
    q = torch.randn(1, 10, 1, ARGS.head_dim)
    k = torch.randn(1, 10, 1, ARGS.head_dim)
    rq = apply_rope(q, cos[:10], sin[:10])
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1))  # rotations keep length
    # The score between positions i and j depends only on i - j: shift both by 5 positions.
    qi, kj = q[:, 3:4].expand(1, 2, 1, -1), k[:, 1:2].expand(1, 2, 1, -1)
    s1 = (apply_rope(qi[:, :1], cos[3:4], sin[3:4]) * apply_rope(kj[:, :1], cos[1:2], sin[1:2])).sum()
    s2 = (apply_rope(qi[:, :1], cos[8:9], sin[8:9]) * apply_rope(kj[:, :1], cos[6:7], sin[6:7])).sum()
    torch.testing.assert_close(s1, s2)


def test_llama3_rope_scaling_changes_only_low_frequencies():
    base = ModelArgs(dim=128, n_heads=1, n_kv_heads=1, rope_theta=500000.0, max_seq_len=32)
    scaled = ModelArgs(**{**base.__dict__, "rope_scaling_factor": 8.0})
    (_, s0), (_, s1) = rope_tables(base), rope_tables(scaled)
    half = base.head_dim // 2
    assert torch.equal(s0[:, 0], s1[:, 0])  # the highest frequency is kept
    inv_low = 1 / 500000.0 ** ((half - 1) / half)  # the lowest is divided by the factor
    torch.testing.assert_close(s0[31, half - 1], torch.tensor(math.sin(31 * inv_low)))
    torch.testing.assert_close(s1[31, half - 1], torch.tensor(math.sin(31 * inv_low / 8.0)))


def test_gqa_with_groups_equal_heads_is_mha():
    """With n_kv_heads = n_heads GQA is plain multi-head attention; and GQA equals MHA with each kv head
    repeated for its query group."""
    mha_args = ModelArgs(**{**ARGS.__dict__, "n_kv_heads": 4})
    mha = make(mha_args)
    x = torch.randint(0, ARGS.vocab_size, (2, 9))
    out = mha(x)
    # Reference attention written out by hand for layer 0.
    gqa = make()
    with torch.no_grad():
        for name, p in mha.named_parameters():
            src = dict(gqa.named_parameters())[name]
            if name.endswith(("wk.weight", "wv.weight")):
                heads = src.view(ARGS.n_kv_heads, ARGS.head_dim, ARGS.dim)
                p.copy_(heads.repeat_interleave(ARGS.n_heads // ARGS.n_kv_heads, dim=0).reshape_as(p))
            else:
                p.copy_(src)
    torch.testing.assert_close(mha(x), gqa(x), rtol=1e-5, atol=1e-5)
    assert out.shape == (2, 9, ARGS.vocab_size)


@pytest.mark.parametrize("window", [0, 3])
def test_attention_matches_naive_softmax(window):
    model = make(ModelArgs(**{**ARGS.__dict__, "n_layers": 1, "n_kv_heads": 4, "sliding_window": window}))
    attn = model.layers["0"].attention
    x = torch.randn(2, 7, ARGS.dim)
    cos, sin = model.rope_cos[:7], model.rope_sin[:7]
    q = apply_rope(attn.wq(x).view(2, 7, 4, -1), cos, sin).transpose(1, 2)
    k = apply_rope(attn.wk(x).view(2, 7, 4, -1), cos, sin).transpose(1, 2)
    v = attn.wv(x).view(2, 7, 4, -1).transpose(1, 2)
    scores = q @ k.transpose(-1, -2) / math.sqrt(ARGS.head_dim)
    hidden = torch.ones(7, 7, dtype=torch.bool).triu(1)  # the future
    if window:
        hidden |= torch.ones(7, 7, dtype=torch.bool).tril(-window)  # and what is window or more behind
    scores = scores.masked_fill(hidden, float("-inf"))
    ref = attn.wo((scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 7, -1))
    torch.testing.assert_close(attn(x, cos, sin), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("args", [ARGS, QWEN2_LIKE], ids=["llama", "qwen2-like"])
def test_kv_cache_matches_full_forward(args):
    """The prefill (5 positions) is longer than the window of 4, and the decoding steps reach past it."""
    model = make(args)
    x = torch.randint(0, ARGS.vocab_size, (2, 12))
    full = model(x)
    cache = KVCache(args, 2, 12, "cpu", torch.float32)
    parts = [model(x[:, :5], cache=cache), model(x[:, 5:6], cache=cache), model(x[:, 6:], cache=cache)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-5, atol=1e-5)


def test_greedy_generation_equals_argmax_of_full_forward():
    model = make()
    prompt = [[1, 2, 3, 4]]
    out = generate(model, prompt, max_new_tokens=6, temperature=0)[0]
    seq = torch.tensor([out[:4]])
    for _ in range(6):
        seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert out == seq[0].tolist()


def test_top_k_and_top_p_restrict_the_choice():
    gen = torch.Generator().manual_seed(0)
    logits = torch.tensor([[5.0, 4.0, 1.0, 0.0, -1.0]]).repeat(200, 1)
    picks = sample_next(logits, 1.0, 2, 1.0, gen)
    assert set(picks.tolist()) <= {0, 1}
    picks = sample_next(logits, 1.0, 0, 0.5, gen)  # token 0 alone has p ~ 0.71 > 0.5
    assert set(picks.tolist()) == {0}


def test_tied_embeddings_share_storage():
    model = make(ModelArgs(**{**ARGS.__dict__, "tie_embeddings": True}))
    assert model.output.weight is model.tok_embeddings.weight
    assert sum(p.numel() for p in model.parameters()) == model.args.num_params()


@pytest.mark.parametrize("name,expected", [("llama3-8b", 8.03e9), ("llama3-70b", 70.55e9), ("llama3-405b", 405.85e9)])
def test_presets_match_published_sizes(name, expected):
    assert preset_args(name).num_params() == pytest.approx(expected, rel=2e-3)


def test_flops_formula_matches_flop_counter():
    """6N + attention against torch's own FLOP counter for one forward+backward."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    model = make(ModelArgs(**{**ARGS.__dict__, "vocab_size": 512}))
    seq = 32
    x = torch.randint(0, 512, (2, seq))
    # The math backend makes attention plain matmuls the counter sees (CPU's fused kernel is not counted).
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(x).float().sum().backward()
    predicted = model.args.flops_per_token(seq) * x.numel()
    # The formula counts the full (unmasked) attention matrix, as the math kernel computes it; it also counts
    # norm weights in N (0.6% of this tiny model), which do no matmul.
    assert counter.get_total_flops() == pytest.approx(predicted, rel=0.02)


def test_meta_build_allocates_nothing():
    with torch.device("meta"):
        model = Transformer(preset_args("llama3-8b"))
    assert all(p.is_meta for p in model.parameters())


def test_the_preset_comments_give_the_presets_sizes():
    """`# 56.4M parameters.` above a preset is what it counts, within the last digit written."""
    import re
    from pathlib import Path

    from plait.model.args import ModelArgs
    from plait.model.presets import PRESETS

    source = Path(__file__).resolve().parents[2].joinpath("src/plait/model/presets.py").read_text()
    said = re.findall(r"# ([\d.]+)([MB]) parameters.*\n\s+\"([\w-]+)\"", source)
    assert len(said) >= 4, said
    for number, unit, name in said:
        actual = ModelArgs(**PRESETS[name]).num_params() / (1e6 if unit == "M" else 1e9)
        digits = len(number.split(".")[1]) if "." in number else 0
        assert abs(actual - float(number)) <= 0.5 * 10**-digits, (
            f"{name}: the comment says {number}{unit}, it has {actual:.3f}"
        )
