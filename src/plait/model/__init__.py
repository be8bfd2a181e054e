from plait.model.llama import KVCache, ModelArgs, Transformer
from plait.model.presets import PRESETS, preset_args

__all__ = ["KVCache", "ModelArgs", "PRESETS", "Transformer", "preset_args"]
