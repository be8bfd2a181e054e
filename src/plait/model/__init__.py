"""The model family. `ModelArgs` and the presets load without torch; the modules on first use."""

from plait.model.args import ModelArgs
from plait.model.presets import PRESETS, preset_args

__all__ = ["KVCache", "ModelArgs", "PRESETS", "Transformer", "preset_args"]


def __getattr__(name: str):
    if name in ("KVCache", "Transformer"):
        from plait.model import llama

        return getattr(llama, name)
    raise AttributeError(f"module 'plait.model' has no attribute {name!r}")
