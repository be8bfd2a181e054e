"""Hand models over: Hugging Face Llama, Mistral and Qwen2 directories, and plain safetensors files.

``export_hf`` writes what ``transformers.AutoModelForCausalLM.from_pretrained`` reads, as the family that
computes exactly what the plait model does (``hf_family``): LlamaForCausalLM (full causal attention, no
biases), MistralForCausalLM (a sliding window, no biases) or Qwen2ForCausalLM (q/k/v biases, with or without
a window). ``import_hf`` / ``load_hf_model`` read those three back. Only safetensors are read, never pickle.
Every tensor is checked against the shape the config implies before any is used: a load either matches
exactly or fails naming the missing, unexpected and mis-shaped tensors.

Both directions stream: ``open_hf`` reads one tensor (or one rank's box of one) at a time, and the weights are
written tensor by tensor into ``model.safetensors`` or, past ``max_shard_size``, into shards
``model-0000i-of-0000N.safetensors`` with ``model.safetensors.index.json``, split and named as transformers'
``save_pretrained`` does (``plait.interop.shards``). Neither holds more than one tensor of the model at a time
(``import_hf`` does hand back all of them at once: for small models and tests).

Names, plait -> Hugging Face (per layer ``i``):

    tok_embeddings.weight                 model.embed_tokens.weight
    layers.i.attention.w{q,k,v,o}.weight  model.layers.i.self_attn.{q,k,v,o}_proj.weight
    layers.i.attention.w{q,k,v}.bias      model.layers.i.self_attn.{q,k,v}_proj.bias (qkv_bias: Qwen2)
    layers.i.feed_forward.w1/w3/w2        model.layers.i.mlp.gate_proj/up_proj/down_proj
    layers.i.attention_norm.weight        model.layers.i.input_layernorm.weight
    layers.i.ffn_norm.weight              model.layers.i.post_attention_layernorm.weight
    norm.weight                           model.norm.weight
    output.weight                         lm_head.weight (absent when the embeddings are tied)

Settings, plait -> config.json:

    sliding_window                        mistral: sliding_window; qwen2: use_sliding_window, sliding_window,
                                          max_window_layers=0 (every layer windowed); llama: none (0)
    qkv_bias                              qwen2 (whose q/k/v projections always have biases)

q/k rows are not permuted: plait's rotary embedding already uses the "rotate half" layout of HF's Llama.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor

from plait.core.errors import ConfigError, PlaitError
from plait.core.publish import staged_dir
from plait.interop.shards import DEFAULT_MAX_SHARD_SIZE, SafetensorsShards, parse_shard_size
from plait.model.llama import ModelArgs, Transformer, rope_tables

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe")
SAFETENSORS_FORMAT = "plait-safetensors-v1"

_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
}
_MOE_NAMES = {  # per family: the router; experts are stacked (experts, ...) in plait, one tensor each in the files
    "mixtral": {
        "feed_forward.router.weight": "block_sparse_moe.gate.weight",
        "feed_forward.experts.w1": "block_sparse_moe.experts.{e}.w1.weight",
        "feed_forward.experts.w2": "block_sparse_moe.experts.{e}.w2.weight",
        "feed_forward.experts.w3": "block_sparse_moe.experts.{e}.w3.weight",
    },
    "qwen3_moe": {
        "feed_forward.router.weight": "mlp.gate.weight",
        "feed_forward.experts.w1": "mlp.experts.{e}.gate_proj.weight",
        "feed_forward.experts.w2": "mlp.experts.{e}.down_proj.weight",
        "feed_forward.experts.w3": "mlp.experts.{e}.up_proj.weight",
    },
}
_EXPERT_NAMES = ("feed_forward.experts.w1", "feed_forward.experts.w2", "feed_forward.experts.w3")
_NOT_IN_HF = "feed_forward.expert_bias"  # loss-free balancing state: Mixtral has none (exported only if zero)
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
_BOS_TOKENS = ("<|begin_of_text|>", "<s>", "<bos>")
_PAD_TOKENS = ("<|pad|>", "<pad>")
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


# ------------------------------------------------------------------------------------------- names, shapes


def hf_name(name: str, family: str = "llama") -> str:
    """The Hugging Face name of a plait parameter held as one tensor there too."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    _, layer, rest = name.split(".", 2)  # layers.<i>.<rest>
    return f"model.layers.{layer}.{_MOE_NAMES.get(family, {}).get(rest) or _LAYER_NAMES[rest]}"


def hf_pieces(name: str, shape: Sequence[int], family: str = "llama") -> list[tuple[str, int | None]]:
    """The Hugging Face tensors a plait tensor is made of: [(name, None)] for one tensor; [(expert e's name, e)]
    for stacked experts (plait's (experts, ...) is one tensor per expert in Mixtral's and Qwen3-MoE's files);
    [] for the MoE routing bias, which those formats do not have."""
    _, layer, rest = name.split(".", 2) if name.startswith("layers.") else ("", "", name)
    if rest == _NOT_IN_HF:
        return []
    if rest in _EXPERT_NAMES:
        pattern = _MOE_NAMES[family][rest]
        return [(f"model.layers.{layer}." + pattern.format(e=e), e) for e in range(shape[0])]
    return [(hf_name(name, family), None)]


def hf_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Hugging Face name -> shape of every tensor of the ``hf_family`` checkpoint of a model of this shape."""
    out, family = {}, hf_family(args)
    for name, shape in param_shapes(args).items():
        for piece, index in hf_pieces(name, shape, family):
            out[piece] = tuple(shape[1:]) if index is not None else tuple(shape)
    return out


def param_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """plait name -> shape of every tensor a model of this shape is made of (`saved_tensors`)."""
    with torch.device("meta"):
        model = Transformer(args)
    return {name: tuple(t.shape) for name, t in saved_tensors(model)}


def saved_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """A model's parameters (tied weights once) and persistent buffers (an MoE block's routing bias, which
    decides what the model computes): what a checkpoint, an export and an import carry."""
    yield from model.named_parameters()
    persistent = set(model.state_dict(keep_vars=True))
    yield from ((name, b) for name, b in model.named_buffers() if name in persistent)


def check_tensors(found: Mapping[str, Sequence[int]], expected: Mapping[str, Sequence[int]], where: str) -> None:
    """Raise PlaitError listing every missing, unexpected and mis-shaped tensor; never load a part."""
    missing = [k for k in expected if k not in found]
    unexpected = [k for k in found if k not in expected]
    mismatched = [
        f"{k} {tuple(found[k])} (expected {tuple(expected[k])})"
        for k in expected
        if k in found and tuple(found[k]) != tuple(expected[k])
    ]
    problems = []
    if missing:
        problems.append(f"missing tensors: {_first(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {_first(unexpected)}")
    if mismatched:
        problems.append(f"shape mismatches: {_first(mismatched)}")
    if problems:
        raise PlaitError(f"{where} does not match the model its config describes: {'; '.join(problems)}")


def _first(items: Sequence[str], n: int = 4) -> str:
    more = f", ... ({len(items) - n} more)" if len(items) > n else ""
    return ", ".join(items[:n]) + more


# -------------------------------------------------------------------------------------------------- config


def hf_family(args: ModelArgs) -> str:
    """The transformers model type that computes exactly what a plait model of this shape does. Mixtures of
    experts: qwen3_moe with per-head q/k norms (softmax router, top-k renormalised or not, leading dense
    blocks allowed), else mixtral (softmax router, renormalised top-k, every block MoE); neither has shared
    experts. Dense: qwen3 with q/k norms, qwen2 with q/k/v biases (windowed or not), mistral with a sliding
    window, else llama."""
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
        "architectures": [_ARCHITECTURES[family]],
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
        "torch_dtype": _DTYPE_NAMES[dtype],
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
        config = {
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


# -------------------------------------------------------------------------------------------------- export


def model_tensors(model: Transformer) -> dict[str, torch.Tensor]:
    """One full tensor per parameter and persistent buffer (`saved_tensors`), plait names (tied weights once,
    as tok_embeddings.weight).

    Sharded (DTensor) parameters are gathered: with FSDP / TP every rank must call this.
    """
    tensors = {}
    for name, param in saved_tensors(model):
        t = param.detach()
        tensors[name] = t.full_tensor() if isinstance(t, DTensor) else t
    check_tensors({k: v.shape for k, v in tensors.items()}, param_shapes(model.args), "the model")
    return tensors


def export_hf(
    model: Transformer,
    out_dir: str | Path,
    *,
    tokenizer_path: Path | None,
    dtype: torch.dtype = torch.float32,
    overwrite: bool = False,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> Path:
    """Write a Hugging Face directory (of the ``hf_family`` of the model's shape): config.json, the weights
    (``model.safetensors``, or shards of at most ``max_shard_size`` with their index), generation_config.json
    and, given a tokenizer.json, the tokenizer (tokenizer.json + tokenizer_config.json).

    One parameter at a time is gathered (DTensors: every rank must call this), converted and written.
    Written to a temporary sibling directory and renamed into place; an existing non-empty ``out_dir`` is
    replaced only with ``overwrite=True``.
    """
    hf_family(model.args)  # refuses what no transformers family computes
    found = {name: tuple(p.shape) for name, p in saved_tensors(model)}  # a DTensor's shape is the full one
    check_tensors(found, param_shapes(model.args), "the model")
    with hf_export(
        out_dir,
        model.args,
        order=list(found),
        tokenizer_path=tokenizer_path,
        dtype=dtype,
        overwrite=overwrite,
        max_shard_size=max_shard_size,
    ) as write:
        for name, param in saved_tensors(model):
            t = param.detach()
            write(name, t.full_tensor() if isinstance(t, DTensor) else t)
    return Path(out_dir)


@contextlib.contextmanager
def hf_export(
    out_dir: str | Path,
    args: ModelArgs,
    *,
    order: Sequence[str],
    tokenizer_path: Path | None,
    dtype: torch.dtype = torch.float32,
    overwrite: bool = False,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> Iterator[Callable[[str, torch.Tensor], None]]:
    """Stage a Hugging Face directory for a model of shape ``args`` and yield ``write(name, tensor)``, which
    takes every parameter (plait names), one at a time in any order, and writes it at once. ``order`` is the
    order the shards are cut in (transformers cuts its state dict's order). On a clean exit the config,
    generation config and tokenizer files are added and the directory is renamed into place."""
    family = hf_family(args)  # refuses what no transformers family computes, before anything is staged
    if dtype not in _DTYPE_NAMES:
        raise PlaitError(f"dtype {dtype} is not supported for export; use torch.float32 or torch.bfloat16")
    max_bytes = parse_shard_size(max_shard_size)
    shapes = param_shapes(args)
    if sorted(order) != sorted(shapes):
        raise PlaitError(f"the export order names {sorted(set(order) ^ set(shapes))[:4]}, not the model's tensors")
    out = Path(out_dir)
    special = _special_tokens(Path(tokenizer_path)) if tokenizer_path is not None else {}
    with _staged_dir(out, overwrite) as tmp:
        pieces = {n: hf_pieces(n, shapes[n], family) for n in order}
        writer = SafetensorsShards(
            tmp,
            {p: tuple(shapes[n][1:]) if i is not None else shapes[n] for n in order for p, i in pieces[n]},
            dtype,
            max_bytes,
        )

        def write(name: str, tensor: torch.Tensor) -> None:
            if not pieces[name] and tensor.any():
                raise PlaitError(
                    f"{name} is not zero: this model balanced its experts with routing biases "
                    "(model.moe_bias_rate), which Mixtral's format cannot hold; the export would route differently"
                )
            for piece, index in pieces[name]:
                writer.add(piece, tensor if index is None else tensor[index])

        yield write
        writer.finish()
        _write_hf_files(tmp, args, special, tokenizer_path, dtype)


def _write_hf_files(
    tmp: Path, args: ModelArgs, special: dict[str, tuple[str, int]], tokenizer_path: Path | None, dtype: torch.dtype
) -> None:
    """config.json, generation_config.json and the tokenizer files of an export."""
    bos, eos, pad = special.get("bos_token"), special.get("eos_token"), special.get("pad_token")
    config = hf_config(args, dtype=dtype, bos_id=bos[1] if bos else None, eos_id=eos[1] if eos else None)
    if pad:
        config["pad_token_id"] = pad[1]
    _write_json(tmp / "config.json", config)
    generation = {  # greedy, as transformers' own default: sampling is the caller's choice
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": config["eos_token_id"],
        **({"pad_token_id": pad[1]} if pad else {}),
        "do_sample": False,
    }
    _write_json(tmp / "generation_config.json", generation)
    if tokenizer_path is not None:
        shutil.copyfile(tokenizer_path, tmp / "tokenizer.json")
        tok_config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": args.max_seq_len,
            "clean_up_tokenization_spaces": False,
            **{key: token for key, (token, _) in special.items()},
        }
        _write_json(tmp / "tokenizer_config.json", tok_config)


def _special_tokens(tokenizer_path: Path) -> dict[str, tuple[str, int]]:
    """{'eos_token' / 'bos_token' / 'pad_token': (text, id)} for those the tokenizer has."""
    from plait.core.errors import ConfigError
    from plait.data import eos_id, load_tokenizer

    tok = load_tokenizer(tokenizer_path)
    found = {}
    with contextlib.suppress(ConfigError):
        eos = eos_id(tok)
        found["eos_token"] = (tok.id_to_token(eos), eos)
    for key, candidates in (("bos_token", _BOS_TOKENS), ("pad_token", _PAD_TOKENS)):
        for text in candidates:
            if (idx := tok.token_to_id(text)) is not None:
                found[key] = (text, idx)
                break
    if "bos_token" not in found and "eos_token" in found:
        # No dedicated BOS (plait's own byte-level BPE, GPT-2's): plait's data puts EOS between documents, so
        # EOS is what precedes every document; GPT-2's config names <|endoftext|> as both, likewise.
        found["bos_token"] = found["eos_token"]
    return found


def export_safetensors(
    model: Transformer, path: str | Path, *, dtype: torch.dtype = torch.float32, overwrite: bool = False
) -> Path:
    """One safetensors file with plait's parameter names; the ModelArgs travel as JSON in its metadata."""
    path = Path(path)
    if path.is_dir():
        raise PlaitError(f"{path} is a directory; give a file path such as {path / 'model.safetensors'}")
    if path.exists() and not overwrite:
        raise PlaitError(f"{path} exists; pass overwrite=True (--overwrite) to replace it")
    tensors = {k: v.to("cpu", dtype).contiguous() for k, v in model_tensors(model).items()}
    metadata = {
        "format": "pt",
        "plait_format": SAFETENSORS_FORMAT,
        "model_args": json.dumps(dataclasses.asdict(model.args)),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        save_file(tensors, tmp, metadata=metadata)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


# -------------------------------------------------------------------------------------------------- import


@dataclasses.dataclass(frozen=True)
class HFWeights:
    """A Hugging Face directory whose config and tensor names and shapes are checked, read one tensor (or one
    box of one) at a time. A read opens its file with safetensors, which maps it: the tensor returned is a
    view of the mapping, so the process holds only the pages that are touched, and only while the tensor (or
    a copy made from it, e.g. ``.float()``) is alive."""

    path: Path
    args: ModelArgs
    config: dict
    locations: dict[str, list[tuple[Path, str]]]  # plait name -> its (file, Hugging Face name) pieces
    shapes: dict[str, tuple[int, ...]]  # plait name -> full shape

    def read(self, name: str, offset: Sequence[int] | None = None, shape: Sequence[int] | None = None) -> torch.Tensor:
        """Parameter ``name`` (plait's name) in its stored dtype; with ``offset`` and ``shape`` only that box
        of it (one rank's shard), read without the rest. Stacked experts are read expert by expert (only those
        in the box); the MoE routing bias, absent from Hugging Face files, reads as zeros."""
        full = self.shapes[name]
        shape = tuple(shape) if shape is not None else full
        offset = tuple(offset) if offset is not None else (0,) * len(full)
        box = tuple(zip(offset, shape, strict=True))
        pieces = self.locations[name]
        if not pieces:
            return torch.zeros(shape)
        if not name.endswith(tuple(_EXPERT_NAMES)):
            file, key = pieces[0]
            return _read_tensor(file, key, None if shape == full else box)
        return torch.stack([_read_tensor(*pieces[e], box[1:]) for e in range(offset[0], offset[0] + shape[0])])


def _read_tensor(file: Path, key: str, box: Sequence[tuple[int, int]] | None = None) -> torch.Tensor:
    """One tensor of a safetensors file, or the box (offset, size) per dimension of it."""
    try:
        with safe_open(str(file), framework="pt") as f:
            if box is None:
                return f.get_tensor(key)
            return f.get_slice(key)[tuple(slice(o, o + n) for o, n in box)]
    except (SafetensorError, OSError) as e:
        raise PlaitError(f"cannot read {key} from {file}: {e}") from None


def open_hf(hf_dir: str | Path) -> HFWeights:
    """Check a Hugging Face directory (config.json, the safetensors files, every tensor's name and shape)
    without reading any tensor, except to compare lm_head with the embeddings of a tied config.

    The tensors are ``Transformer.named_parameters``: with tied embeddings no ``output.weight``; Qwen2's q/k/v
    biases included; ``rotary_emb.inv_freq`` buffers of old checkpoints are ignored (they are derived).
    """
    hf_dir = Path(hf_dir)
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise PlaitError(f"{hf_dir} has no config.json: give a Hugging Face model directory")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PlaitError(f"{config_path} is not valid JSON: {e}") from None
    args = args_from_hf_config(config, str(config_path))
    expected = hf_shapes(args)
    where = str(hf_dir)
    found: dict[str, tuple[Path, tuple[int, ...]]] = {}  # HF name -> (file, shape)
    for file in _weight_files(hf_dir):
        try:
            with safe_open(str(file), framework="pt") as handle:
                entries = [(n, tuple(handle.get_slice(n).get_shape())) for n in handle.keys()]  # noqa: SIM118
        except (SafetensorError, OSError) as e:
            raise PlaitError(f"cannot read {file}: {e}") from None
        for name, shape in entries:
            if name in found:
                raise PlaitError(f"{where}: tensor {name} appears in more than one file")
            if not name.endswith("rotary_emb.inv_freq"):
                found[name] = (file, shape)
    if args.tie_embeddings and "lm_head.weight" in found:
        embed, head = "model.embed_tokens.weight", "lm_head.weight"
        if embed in found and not torch.equal(_read_tensor(found[head][0], head), _read_tensor(found[embed][0], embed)):
            raise PlaitError(
                f"{where}: tie_word_embeddings is true but lm_head.weight differs from {embed}; "
                f"set tie_word_embeddings to false in config.json if the output projection is separate"
            )
        del found["lm_head.weight"]
    check_tensors({n: shape for n, (_, shape) in found.items()}, expected, where)
    shapes = param_shapes(args)
    family = hf_family(args)
    locations = {name: [(found[p][0], p) for p, _ in hf_pieces(name, shape, family)] for name, shape in shapes.items()}
    return HFWeights(hf_dir, args, config, locations, shapes)


def import_hf(hf_dir: str | Path) -> tuple[ModelArgs, dict[str, torch.Tensor]]:
    """(ModelArgs, plait-named tensors in their stored dtype) from a Hugging Face directory: every tensor
    at once, as views of the mapped files (``open_hf`` reads them one at a time)."""
    hf = open_hf(hf_dir)
    return hf.args, {name: hf.read(name) for name in param_shapes(hf.args)}


def _weight_files(hf_dir: Path) -> list[Path]:
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise PlaitError(f"{index} is not a valid safetensors index: {e!r}") from None
        files = [hf_dir / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise PlaitError(f"{index} names shards that are missing: {_first(absent)}")
        return files
    if (hf_dir / "model.safetensors").is_file():
        return [hf_dir / "model.safetensors"]
    pickles = sorted(p.name for p in hf_dir.iterdir() if p.name.endswith(_PICKLE_SUFFIXES))
    if pickles:
        raise PlaitError(
            f"{hf_dir} holds only PyTorch pickle weights ({_first(pickles)}); plait reads safetensors and "
            f"never unpickles: convert it to safetensors first, where you trust the file (e.g. "
            f"AutoModelForCausalLM.from_pretrained(dir).save_pretrained(out_dir))"
        )
    raise PlaitError(f"{hf_dir} has no model.safetensors or model.safetensors.index.json")


def load_hf_model(hf_dir: str | Path, device: str | torch.device = "cpu") -> Transformer:
    """A plait Transformer (fp32) holding the weights of a Hugging Face directory, read one tensor at a time
    into it."""
    hf = open_hf(hf_dir)
    model = empty_model(hf.args, device)
    with torch.no_grad():
        for name, tensor in saved_tensors(model):
            tensor.copy_(hf.read(name))
    return model


def load_safetensors(path: str | Path, device: str | torch.device = "cpu") -> Transformer:
    """A plait Transformer from a file written by ``export_safetensors``."""
    path = Path(path)
    if not path.is_file():
        raise PlaitError(f"{path} does not exist: give a .safetensors file written by plait")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("plait_format") != SAFETENSORS_FORMAT or "model_args" not in meta:
                raise PlaitError(
                    f"{path} is not a plait safetensors export (no model_args in its metadata); "
                    f"for a Hugging Face directory use load_hf_model"
                )
            args = _args_from_json(meta["model_args"], path)
            names = list(f.keys())
            check_tensors({n: f.get_slice(n).get_shape() for n in names}, param_shapes(args), str(path))
            tensors = {n: f.get_tensor(n) for n in names}
    except SafetensorError as e:
        raise PlaitError(f"cannot read {path}: {e}") from None
    return build_from_tensors(args, tensors, device)


def _args_from_json(text: str, where: Path) -> ModelArgs:
    values = json.loads(text)
    known = {f.name for f in dataclasses.fields(ModelArgs)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise PlaitError(f"{where}: unknown model settings {', '.join(unknown)} (written by a newer plait?)")
    return ModelArgs(**values)


def empty_model(args: ModelArgs, device: str | torch.device = "cpu") -> Transformer:
    """A Transformer with uninitialised parameters and correct rotary tables, to load weights into.

    Skips ``init_weights``: drawing random values for billions of parameters that are overwritten at
    once would cost minutes on a CPU.
    """
    with torch.device("meta"):
        model = Transformer(args)
    device = torch.device(device)
    model.to_empty(device=device)
    model.tie_weights()  # to_empty unties
    with torch.no_grad():
        for buffer in model.buffers():  # MoE balancing state and statistics start at zero
            buffer.zero_()
        cos, sin = rope_tables(args, device=device)
        model.rope_cos.copy_(cos)
        model.rope_sin.copy_(sin)
    return model


def build_from_tensors(
    args: ModelArgs, tensors: Mapping[str, torch.Tensor], device: str | torch.device = "cpu"
) -> Transformer:
    """A Transformer of shape ``args`` holding ``tensors`` (checked names and shapes, cast to fp32)."""
    check_tensors({k: v.shape for k, v in tensors.items()}, param_shapes(args), "the given tensors")
    model = empty_model(args, device)
    state = dict(tensors)
    if args.tie_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    model.load_state_dict(state, strict=True)
    return model


# --------------------------------------------------------------------------------------------------- files


def _staged_dir(out: Path, overwrite: bool):
    exists = PlaitError(f"{out} exists and is not empty; pass overwrite=True (--overwrite) to replace it")
    return staged_dir(out, overwrite=overwrite, exists_error=exists)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
