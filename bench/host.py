"""The line a bench writes beside its numbers to say where they were measured: the processor, its cores, the
torch version and the date (`python bench/X.py` puts bench/ on the import path, so a bench imports it as `host`)."""

from __future__ import annotations

import os
import platform
import time


def describe() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}"
