"""plait: train Llama-family language models across many accelerators."""

__version__ = "0.1.0"
