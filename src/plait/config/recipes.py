"""The peak learning rate published for each large preset's model, or for the nearest published model of its
kind where its own is not published. Choosing the preset sets it; a TOML file or an override still wins
(plait.config.load). The small presets (debug, tiny, small, moe-debug) keep the optim section's defaults,
chosen on the default job by measurement (bench/schedule_sweep.py; docs/measurements.md: optim: the default
schedule)."""

from __future__ import annotations

PRESET_LR: dict[str, tuple[float, str]] = {
    "llama3-1b": (4e-4, "OLMo-1B and TinyLlama-1.1B, Llama-shaped 1B models trained from scratch"),
    "llama3-8b": (3e-4, "Llama 2 7B (Llama 3 8B's is not published)"),
    "llama3-70b": (1.5e-4, "Llama 2 70B (Llama 3 70B's is not published)"),
    "llama3-405b": (8e-5, "Llama 3 405B"),
    "qwen3-30b-a3b": (4.2e-4, "DeepSeek-V2-Lite, 16B parameters of which 2.4B active (Qwen3's is not published)"),
    "qwen3-moe-2.8b": (4e-4, "OLMoE-1B-7B: 64 experts, top 8, 1.3B of 6.9B parameters active"),
    "deepseek-v3-shaped": (2.2e-4, "DeepSeek-V3"),
}
"""preset -> (peak learning rate, whose published value it is)."""
