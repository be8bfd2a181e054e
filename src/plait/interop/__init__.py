"""Model hand-over: Hugging Face Llama-format directories and plain safetensors files."""

from plait.interop.hf import (
    export_hf,
    export_safetensors,
    import_hf,
    load_hf_model,
    load_safetensors,
    open_hf,
)

__all__ = ["export_hf", "export_safetensors", "import_hf", "load_hf_model", "load_safetensors", "open_hf"]
