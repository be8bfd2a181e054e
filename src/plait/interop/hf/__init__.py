"""Hand models over: Hugging Face Llama, Mistral, Qwen2/3 and their MoE families' directories, and plain
safetensors files, both ways and streaming (one tensor at a time): names and shapes (names), config.json
(config), writing (export), reading, safetensors only (load).

``export_hf`` writes what ``transformers.AutoModelForCausalLM.from_pretrained`` reads, as the family that
computes exactly what the plait model does (``hf_family``); ``open_hf`` / ``load_hf_model`` read those back.
Every tensor is checked against the shape the config implies before any is used: a load either matches
exactly or fails naming the missing, unexpected and mis-shaped tensors. q/k rows are not permuted: plait's
rotary embedding already uses the "rotate half" layout of HF's Llama.
"""

from plait.interop.hf.config import args_from_hf_config, hf_config, hf_family, hf_shapes
from plait.interop.hf.export import export_hf, export_safetensors, hf_export, model_tensors
from plait.interop.hf.load import (
    HFWeights,
    build_from_tensors,
    empty_model,
    import_hf,
    load_hf_model,
    load_safetensors,
    open_hf,
)
from plait.interop.hf.names import SUPPORTED_MODEL_TYPES, check_tensors, hf_name, hf_pieces, param_shapes, saved_tensors

__all__ = [
    "HFWeights", "SUPPORTED_MODEL_TYPES", "args_from_hf_config", "build_from_tensors", "check_tensors", "empty_model",
    "export_hf", "export_safetensors", "hf_config", "hf_export", "hf_family", "hf_name", "hf_pieces", "hf_shapes",
    "import_hf", "load_hf_model", "load_safetensors", "model_tensors", "open_hf", "param_shapes", "saved_tensors",
]  # fmt: skip
