"""Names and shapes: plait's parameters and the Hugging Face families' tensors, one to one (or one to many:
stacked experts).

Names, plait -> Hugging Face (per layer ``i``):

    tok_embeddings.weight                 model.embed_tokens.weight
    layers.i.attention.w{q,k,v,o}.weight  model.layers.i.self_attn.{q,k,v,o}_proj.weight
    layers.i.attention.w{q,k,v}.bias      model.layers.i.self_attn.{q,k,v}_proj.bias (qkv_bias: Qwen2)
    layers.i.feed_forward.w1/w3/w2        model.layers.i.mlp.gate_proj/up_proj/down_proj
    layers.i.attention_norm.weight        model.layers.i.input_layernorm.weight
    layers.i.ffn_norm.weight              model.layers.i.post_attention_layernorm.weight
    norm.weight                           model.norm.weight
    output.weight                         lm_head.weight (absent when the embeddings are tied)

Settings, plait -> config.json (plait.interop.hf.config):

    sliding_window                        mistral: sliding_window; qwen2: use_sliding_window, sliding_window,
                                          max_window_layers=0 (every layer windowed); llama: none (0)
    qkv_bias                              qwen2 (whose q/k/v projections always have biases)
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import torch
from torch import nn

from plait.core.errors import PlaitError
from plait.model.llama import ModelArgs, Transformer

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

EXPERT_NAMES = ("feed_forward.experts.w1", "feed_forward.experts.w2", "feed_forward.experts.w3")

_NOT_IN_HF = "feed_forward.expert_bias"  # loss-free balancing state: Mixtral has none (exported only if zero)

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}

BOS_TOKENS = ("<|begin_of_text|>", "<s>", "<bos>")

PAD_TOKENS = ("<|pad|>", "<pad>")

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def hf_name(name: str, family: str = "llama") -> str:
    """The Hugging Face name of a plait parameter held as one tensor there too."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    _, layer, rest = name.split(".", 2)  # layers.<i>.<rest>
    return f"model.layers.{layer}.{_MOE_NAMES.get(family, {}).get(rest) or _LAYER_NAMES[rest]}"


def layer_hf_name(name: str) -> str:
    """The Hugging Face name of a block's dense tensor: layers.<i>.attention.wq.weight ->
    model.layers.<i>.self_attn.q_proj.weight (the same in every family plait exports)."""
    _, layer, rest = name.split(".", 2)
    return f"model.layers.{layer}.{_LAYER_NAMES[rest]}"


def layer_plait_name(name: str) -> str | None:
    """layer_hf_name's inverse; None for a name that is not one of a block's dense tensors."""
    parts = name.split(".", 3)
    if len(parts) != 4 or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
        return None
    rest = {hf: plait for plait, hf in _LAYER_NAMES.items()}.get(parts[3])
    return f"layers.{parts[2]}.{rest}" if rest else None


def hf_pieces(name: str, shape: Sequence[int], family: str = "llama") -> list[tuple[str, int | None]]:
    """The Hugging Face tensors a plait tensor is made of: [(name, None)] for one tensor; [(expert e's name, e)]
    for stacked experts (plait's (experts, ...) is one tensor per expert in Mixtral's and Qwen3-MoE's files);
    [] for the MoE routing bias, which those formats do not have."""
    _, layer, rest = name.split(".", 2) if name.startswith("layers.") else ("", "", name)
    if rest == _NOT_IN_HF:
        return []
    if rest in EXPERT_NAMES:
        pattern = _MOE_NAMES[family][rest]
        return [(f"model.layers.{layer}." + pattern.format(e=e), e) for e in range(shape[0])]
    return [(hf_name(name, family), None)]


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
        problems.append(f"missing tensors: {first_few(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {first_few(unexpected)}")
    if mismatched:
        problems.append(f"shape mismatches: {first_few(mismatched)}")
    if problems:
        raise PlaitError(f"{where} does not match the model its config describes: {'; '.join(problems)}")


def first_few(items: Sequence[str], n: int = 4) -> str:
    more = f", ... ({len(items) - n} more)" if len(items) > n else ""
    return ", ".join(items[:n]) + more
