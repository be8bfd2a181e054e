"""What the model-lifecycle commands (`plait lineage`, `eval`, `compress`, `finetune`) share: the lineage
registry they record in and the data a model was trained on (writing a model as a plait run directory is
plait.lifecycle.model_run's).

MODEL is a checkpoint or run directory, a Hugging Face directory, an adapter file or a quantized directory.
Every command that makes or evaluates a model records it in the lineage registry that covers its input
(``lineage.sqlite`` in or above it), or in ``--registry FILE``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

console = Console(width=120)


def registry_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--registry", help="The lineage registry (SQLite); default: lineage.sqlite in or above the input.")


def open_registry_near(explicit: str | None, near, *, create: bool = False):
    from plait.lifecycle.lineage import open_registry

    return open_registry(explicit, near, create=create)


def data_dir_of(explicit: str | None, config: dict | None, vocab: int) -> Path | None:
    """--data, else the data the model was trained on (when it still exists); None when neither is known."""
    from plait.data import ensure_prepared

    if explicit:
        return ensure_prepared(explicit, "~/.cache/plait/data", vocab)
    data = (config or {}).get("data") or {}
    source = data.get("source")
    if not source:
        console.print("no --data and no training data recorded: perplexity skipped")
        return None
    if source != "shakespeare" and not Path(source).is_dir():
        console.print(f"the training data {source} is gone: perplexity skipped (pass --data)")
        return None
    return ensure_prepared(source, Path(data.get("cache_dir", "~/.cache/plait/data")).expanduser(), vocab)
