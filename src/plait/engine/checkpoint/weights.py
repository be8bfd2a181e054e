"""Weights-only checkpoints: a directory holding a model and nothing of a run's progress (no optimizer state, no
data position), which training fine-tunes from step 0 (`plait ckpt import`, `plait finetune merge`, `plait
compress`). It is an ordinary checkpoint directory: the model's tensors under DCP (named as CheckpointManager
names them) and plait.json with ``"weights_only": true``; published whole (core.publish.staged_dir) so that a
crash leaves either no directory or a complete one.

Writing one from a Hugging Face directory, tensor by tensor, is interop's (plait.interop.hf.checkpoint): it
hands its own ``save`` to ``publish_weights``."""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import cast

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from plait.core.errors import ConfigError
from plait.core.publish import staged_dir
from plait.core.storage import Location, dcp_writer
from plait.data.chat import chat_files
from plait.engine.checkpoint.find import FORMAT, META
from plait.engine.checkpoint.load import checkpoint_model
from plait.model import Transformer


def load_checkpoint_model(ckpt: Location, device: str | torch.device = "cpu") -> Transformer:
    """The model of a checkpoint directory (its weights only, a LoRA run's adapters included), in fp32."""
    return cast(Transformer, checkpoint_model(ckpt, device))


def write_weights_checkpoint(
    model: Transformer, ckpt_dir: Path, *, config: dict, tokenizer_path: Path | None, extra: dict
) -> Path:
    """A checkpoint holding only the model: DCP tensors (as CheckpointManager names them) + plait.json.

    plait.json carries ``"weights_only": true`` and step 0; the directory is published whole."""
    state = {"model": get_model_state_dict(model)}

    def save(tmp: Path) -> dict:
        with warnings.catch_warnings():  # DCP 'assumes' a single process without a group: intended here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(state, storage_writer=dcp_writer(tmp), no_dist=True)
        return {}

    return publish_weights(ckpt_dir, save, config=config, tokenizer_path=tokenizer_path, extra=extra)


def publish_weights(
    ckpt_dir: Path, save: Callable[[Path], dict], *, config: dict, tokenizer_path: Path | None, extra: dict
) -> Path:
    """Run ``save(tmp)`` (which writes the tensors and returns more plait.json entries), write plait.json and
    the tokenizer, and publish the directory whole as ``ckpt_dir`` (core.publish.staged_dir, the one way).
    An existing non-empty ``ckpt_dir`` is refused (ConfigError), never replaced."""
    exists = ConfigError(f"{ckpt_dir} exists; choose another --out")
    with staged_dir(ckpt_dir, overwrite=False, exists_error=exists) as tmp:
        described = save(tmp)
        meta = {
            "format": FORMAT,
            "weights_only": True,
            "train_state": {"step": 0, "tokens": 0},
            "config": config,
            **extra,
            **described,
        }
        (tmp / META).write_text(json.dumps(meta, indent=1))
        if tokenizer_path is not None:
            shutil.copyfile(tokenizer_path, tmp / "tokenizer.json")
            for path in chat_files(tokenizer_path):  # an instruct model's chat template comes along
                shutil.copyfile(path, tmp / path.name)
    return ckpt_dir
