"""config.json both ways: the family that computes exactly what a plait model does (hf_family), its config, and
ModelArgs read back from a family's config, every setting checked."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from plait.core.errors import ConfigError, PlaitError
from plait.interop.hf.names import ARCHITECTURES, DTYPE_NAMES, SUPPORTED_MODEL_TYPES, hf_pieces, param_shapes
from plait.model.llama import ModelArgs


def hf_family(args: ModelArgs) -> str:
    """The transformers model type that computes exactly what a plait model of this shape does. Mixtures of
    experts: qwen3_moe with per-head q/k norms (softmax router, top-k renormalised or not, leading dense
    blocks allowed), else mixtral (softmax router, renormalised top-k, every block MoE); neither has shared
    experts. Dense: qwen3 with q/k norms, qwen2 with q/k/v biases (windowed or not), mistral with a sliding
    window, else llama."""
    if args.retrieval_ids:
        raise ConfigError(
            "a retrieval model (model.retrieval_layers) has no transformers format: its chunked cross-attention and "
            "neighbour encoder are plait's; export it with --format safetensors"
        )
    if args.moe_experts:
        qwen3 = args.qk_norm
        family = "qwen3_moe" if qwen3 else "mixtral"
        unlike = [
            reason
            for reason, differs in (
                (f"model.moe_shared_experts={args.moe_shared_experts}", args.moe_shared_experts),
                (f"model.moe_dense_layers={args.moe_dense_layers}", args.moe_dense_layers and not qwen3),
                (f"model.moe_score={args.moe_score!r}", args.moe_score != "softmax"),
                ("model.moe_norm_topk=false", not args.moe_norm_topk and not qwen3),
                ("model.qkv_bias=true", args.qkv_bias),
                (f"model.sliding_window={args.sliding_window}", args.sliding_window and qwen3),
            )
            if differs
        ]
        if unlike:
            name = {"mixtral": "Mixtral", "qwen3_moe": "Qwen3-MoE"}[family]
            raise ConfigError(
                f"this mixture-of-experts model has no Hugging Face family: {name}'s has no {', '.join(unlike)}; "
                "it trains, resumes and reshards as a plait checkpoint"
            )
        return family
    if args.qk_norm:
        if args.qkv_bias or args.sliding_window:
            raise ConfigError(
                "model.qk_norm=true with q/k/v biases or a sliding window has no Hugging Face family (Qwen3 has "
                "neither); it trains, resumes and reshards as a plait checkpoint"
            )
        return "qwen3"
    if args.qkv_bias:
        return "qwen2"
    return "mistral" if args.sliding_window else "llama"


def hf_config(
    args: ModelArgs, *, dtype: torch.dtype = torch.float32, bos_id: int | None = None, eos_id: int | None = None
) -> dict:
    """config.json of the ``hf_family`` model (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM) with
    this shape.

    Rotary settings use the long-standing keys (``rope_theta``, ``rope_scaling``), which every
    transformers version reads (v5 converts them to ``rope_parameters``).
    """
    rope_scaling = None
    if args.rope_scaling_factor > 0:
        rope_scaling = {
            "rope_type": "llama3",
            "factor": args.rope_scaling_factor,
            "low_freq_factor": args.rope_low_freq_factor,
            "high_freq_factor": args.rope_high_freq_factor,
            "original_max_position_embeddings": args.rope_original_max_seq_len,
        }
    family = hf_family(args)
    return {
        "architectures": [ARCHITECTURES[family]],
        "model_type": family,
        "hidden_size": args.dim,
        "intermediate_size": args.expert_hidden_dim if family == "mixtral" else args.hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings,
        **_attention_config(args, family),
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": DTYPE_NAMES[dtype],
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
    }


def _attention_config(args: ModelArgs, family: str) -> dict:
    """The family's own keys for the attention window and biases."""
    if family == "llama":
        return {"attention_bias": False, "mlp_bias": False}
    if family == "mistral":
        return {"sliding_window": args.sliding_window}  # MistralConfig defaults to 4096: always written
    if family in ("qwen3", "qwen3_moe"):
        config: dict[str, Any] = {
            "attention_bias": False,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": args.n_layers,
            "layer_types": ["full_attention"] * args.n_layers,
        }
        if family == "qwen3_moe":
            config.update(
                moe_intermediate_size=args.expert_hidden_dim,
                num_experts=args.moe_experts,
                num_experts_per_tok=args.moe_top_k,
                norm_topk_prob=args.moe_norm_topk,
                decoder_sparse_step=1,
                mlp_only_layers=list(range(args.moe_dense_layers)),
                output_router_logits=False,
                router_aux_loss_coef=0.0,  # plait's balancing loss is sequence-wise, not Qwen3-MoE's
            )
        return config
    if family == "mixtral":
        return {
            "sliding_window": args.sliding_window or None,
            "num_local_experts": args.moe_experts,
            "num_experts_per_tok": args.moe_top_k,
            "output_router_logits": False,
            "router_aux_loss_coef": 0.0,  # plait's balancing loss is sequence-wise, not Mixtral's
        }
    windowed = args.sliding_window > 0
    layer_type = "sliding_attention" if windowed else "full_attention"
    return {
        "use_sliding_window": windowed,
        "sliding_window": args.sliding_window if windowed else None,
        "max_window_layers": 0 if windowed else args.n_layers,  # Qwen2 windows layers from this index on
        "layer_types": [layer_type] * args.n_layers,
    }


def args_from_hf_config(config: Mapping, where: str = "config.json") -> ModelArgs:
    """ModelArgs of a Llama / Mistral / Qwen2 config.json; refuses what plait's model cannot express."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise PlaitError(
            f"{where}: model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if config.get("quantization_config"):
        raise PlaitError(f"{where}: quantized checkpoints are not supported; export it unquantized first")
    if config.get("hidden_act", "silu") != "silu":
        raise PlaitError(f"{where}: hidden_act {config['hidden_act']!r} is not supported; plait uses silu")
    dim, heads = _int(config, "hidden_size", where), _int(config, "num_attention_heads", where)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = config.get("head_dim")
    if head_dim is None and dim % heads:
        raise PlaitError(f"{where}: hidden_size={dim} is not divisible by num_attention_heads={heads}")
    if head_dim is not None and (not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim <= 0):
        raise PlaitError(f"{where}: head_dim must be a positive integer, got {head_dim!r}")
    size = head_dim or dim // heads
    if heads % kv_heads:
        raise PlaitError(f"{where}: num_key_value_heads={kv_heads} does not divide num_attention_heads={heads}")
    if size % 2:
        raise PlaitError(f"{where}: head size {size} must be even for rotary embeddings")
    theta, scaling = _rope_settings(config, where)
    n_layers = _int(config, "num_hidden_layers", where)
    extra: dict = {}  # mixtures of experts, Qwen3's q/k norms, a head size of its own
    if model_type == "mixtral":  # every block a softmax top-k mixture, weights renormalised
        extra = dict(
            moe_experts=_int(config, "num_local_experts", where),
            moe_top_k=_int(config, "num_experts_per_tok", where),
            moe_hidden_dim=_int(config, "intermediate_size", where),
        )
    if model_type == "qwen3_moe":
        extra = dict(
            moe_experts=_int(config, "num_experts" if "num_experts" in config else "num_local_experts", where),
            moe_top_k=_int(config, "num_experts_per_tok", where),
            moe_hidden_dim=_int(config, "moe_intermediate_size", where),
            moe_norm_topk=bool(config.get("norm_topk_prob", False)),
            moe_dense_layers=_qwen3_dense_layers(config, n_layers, where),
        )
    if head_dim is not None and head_dim != dim // heads:
        extra["attention_head_dim"] = head_dim
    if model_type in ("qwen3", "qwen3_moe"):
        extra["qk_norm"] = True
    return ModelArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=heads,
        n_kv_heads=kv_heads,
        vocab_size=_int(config, "vocab_size", where),
        ffn_hidden_dim=_int(config, "intermediate_size", where),
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        max_seq_len=_int(config, "max_position_embeddings", where),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        **scaling,
        **_attention_settings(config, model_type, n_layers, where),
        **extra,
    )


def _attention_settings(config: Mapping, model_type: str, n_layers: int, where: str) -> dict:
    """ModelArgs ``sliding_window`` and ``qkv_bias`` as transformers reads the config; refuses biases other
    than Qwen2's q/k/v ones, and a window on some layers only (plait has one attention pattern for all)."""
    if model_type == "llama":
        if config.get("attention_bias"):
            raise PlaitError(
                f"{where}: attention_bias=true puts biases on q/k/v and o_proj; plait's attention has q/k/v "
                f"biases only (Qwen2's layout), so this model is not supported"
            )
        if config.get("mlp_bias"):
            raise PlaitError(f"{where}: mlp_bias=true is not supported: plait's MLP has no biases")
        return {}
    if model_type in ("mistral", "mixtral"):  # one window for every layer: they read no layer_types
        return {"sliding_window": _window(config, where)}
    if model_type in ("qwen3", "qwen3_moe"):
        if config.get("attention_bias"):
            raise PlaitError(f"{where}: attention_bias=true is not supported for {model_type}: plait's has none")
        if config.get("use_sliding_window"):
            raise PlaitError(f"{where}: use_sliding_window=true is not supported for {model_type} yet")
        return {}
    return {"qkv_bias": True, "sliding_window": _qwen2_window(config, n_layers, where)}


def _qwen3_dense_layers(config: Mapping, n_layers: int, where: str) -> int:
    """Qwen3-MoE's dense blocks as plait's moe_dense_layers: they must be the first k (mlp_only_layers =
    [0, ..., k-1]) and every other block sparse (decoder_sparse_step = 1)."""
    step = config.get("decoder_sparse_step", 1)
    dense = sorted(config.get("mlp_only_layers") or [])
    if step != 1 or dense != list(range(len(dense))) or len(dense) >= n_layers:
        raise PlaitError(
            f"{where}: decoder_sparse_step={step} and mlp_only_layers={dense} are not supported: plait's dense "
            "blocks are the first k (mlp_only_layers = [0, ..., k-1], decoder_sparse_step = 1)"
        )
    return len(dense)


def _window(config: Mapping, where: str) -> int:
    window = config.get("sliding_window")
    if window is None:
        return 0
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        raise PlaitError(f"{where}: sliding_window must be a positive integer or null, got {window!r}")
    return window


def _qwen2_window(config: Mapping, n_layers: int, where: str) -> int:
    """Qwen2's window: none without use_sliding_window; with it, on the layers ``layer_types`` names
    'sliding_attention' or, where it is absent, on layers i >= max_window_layers (as Qwen2Config derives it)."""
    window = _window(config, where) if config.get("use_sliding_window") else 0
    types = config.get("layer_types")
    setting = "layer_types"
    if types is None:
        if not window:
            return 0
        first = config.get("max_window_layers", 28)  # Qwen2Config's default
        if not isinstance(first, int) or isinstance(first, bool):
            raise PlaitError(f"{where}: max_window_layers must be an integer, got {first!r}")
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(n_layers)]
        setting = f"max_window_layers={first}"
    if not isinstance(types, list) or len(types) != n_layers:
        raise PlaitError(f"{where}: layer_types must list one type per layer ({n_layers}), got {types!r}")
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise PlaitError(
            f"{where}: layer_types {unknown} are not supported; supported: sliding_attention, full_attention"
        )
    windowed = types.count("sliding_attention")
    if windowed and not window:
        raise PlaitError(
            f"{where}: layer_types names sliding_attention layers but use_sliding_window is false (or "
            f"sliding_window null), so they have no window; transformers cannot build this model either"
        )
    if windowed in (0, n_layers):
        return window if windowed else 0
    raise PlaitError(
        f"{where}: use_sliding_window with {setting} puts the sliding window on {windowed} of {n_layers} layers "
        f"(the others attend fully); plait uses one attention pattern in every layer, so it loads a window on "
        f"every layer (max_window_layers=0) or on none, not a mix"
    )


def _int(config: Mapping, key: str, where: str) -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise PlaitError(f"{where}: {key} must be a positive integer, got {value!r}")
    return value


def _rope_settings(config: Mapping, where: str) -> tuple[float, dict]:
    """(theta, ModelArgs rope scaling fields) from v5 ``rope_parameters`` or legacy ``rope_scaling``."""
    params = config.get("rope_parameters") or {}
    if any(isinstance(v, Mapping) for v in params.values()):
        raise PlaitError(f"{where}: per-layer-type rope_parameters are not supported")
    rope = {**(config.get("rope_scaling") or {}), **params}
    theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise PlaitError(f"{where}: partial_rotary_factor={partial} is not supported; plait rotates all dims")
    kind = rope.get("rope_type", rope.get("type")) or "default"
    if kind == "default":
        return theta, {}
    if kind != "llama3":
        raise PlaitError(f"{where}: rope_scaling type {kind!r} is not supported; supported: llama3, none")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    absent = [k for k in keys if k not in rope]
    if absent:
        raise PlaitError(f"{where}: llama3 rope_scaling lacks {', '.join(absent)}")
    return theta, {
        "rope_scaling_factor": float(rope["factor"]),
        "rope_low_freq_factor": float(rope["low_freq_factor"]),
        "rope_high_freq_factor": float(rope["high_freq_factor"]),
        "rope_original_max_seq_len": int(rope["original_max_position_embeddings"]),
    }


def hf_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Hugging Face name -> shape of every tensor of the ``hf_family`` checkpoint of a model of this shape."""
    out, family = {}, hf_family(args)
    for name, shape in param_shapes(args).items():
        for piece, index in hf_pieces(name, shape, family):
            out[piece] = tuple(shape[1:]) if index is not None else tuple(shape)
    return out
