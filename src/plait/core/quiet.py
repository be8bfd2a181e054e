"""Library lines that look like failures but are not, kept off the user's screen where plait calls the library.

Nothing here is global: ``library_calm()`` changes the libraries' loggers, warnings and progress bars only while
plait is inside one of their calls, and puts everything back after. What it drops, and why each is harmless:
- torchao's "Failed to load .../_C_mxfp8...so" / "_C_cutlass_90a": optional CUDA kernels a CPU build (or an
  older GPU) cannot load; torchao runs without them and plait uses none of them there;
- torch's "<enum ...> is an Enum subclass ... register_constant() ... deprecated": torchao registers its enums
  for torch.compile the old way, once, at import;
- transformers' and huggingface_hub's per-file progress bars ("Loading weights", "Writing model shards") and
  their deprecation and future warnings: plait reports its own progress, and the warnings name arguments plait
  does not pass.
A real failure of these libraries still raises, and errors (not warnings) from their loggers still print.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

_HARMLESS = {  # logger name: start of a message that is not a failure (see the module docstring)
    "torchao": ("Failed to load",),
    "torch.utils._pytree": ("<enum",),
}
_CHATTY = ("transformers", "huggingface_hub", "accelerate", "peft")  # warnings and info: only errors pass


class _Drop(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefixes)


@contextmanager
def library_calm() -> Iterator[None]:
    """While active: the harmless lines of torchao, torch and transformers are not printed (module docstring)."""
    with ExitStack() as stack:
        for name, prefixes in _HARMLESS.items():
            logger, drop = logging.getLogger(name), _Drop(prefixes)
            logger.addFilter(drop)
            stack.callback(logger.removeFilter, drop)
        for name in _CHATTY:
            logger = logging.getLogger(name)
            stack.callback(logger.setLevel, logger.level)
            logger.setLevel(logging.ERROR)
        stack.enter_context(warnings.catch_warnings())
        for module in ("transformers", "huggingface_hub", "torchao"):
            warnings.filterwarnings("ignore", category=FutureWarning, module=module)
            warnings.filterwarnings("ignore", category=DeprecationWarning, module=module)
        stack.enter_context(_transformers_bars_off())
        yield


@contextmanager
def _transformers_bars_off() -> Iterator[None]:
    """transformers' own tqdm bars ("Loading weights") off, and as they were after. Its logging module is
    imported here (light: transformers loads its models lazily) so that the switch holds for what follows."""
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        yield
        return
    from transformers.utils import logging as tf_logging

    enabled = tf_logging.is_progress_bar_enabled()
    tf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            tf_logging.enable_progress_bar()
