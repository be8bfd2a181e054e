"""A model written as a plait run directory: what `plait compress prune` (without a fine-tune) and `plait
finetune merge` make, so that train, generate and `plait ckpt export` take it as any run.

The directory holds the model as a weights-only checkpoint (``checkpoints/step_00000000``,
plait.engine.checkpoint.weights) and the run's ``config.toml``; it is written beside ``out`` and renamed into
place whole (core.publish.staged_dir): a crash on the way leaves no directory at all, never a run without its
config or a config without its checkpoint. (A compression that trains writes its run through plait's trainer,
as every run is written.)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from plait.config import Config, from_dict, to_dict, to_toml, validate
from plait.core.errors import ConfigError
from plait.core.publish import staged_dir
from plait.engine.checkpoint.weights import write_weights_checkpoint

if TYPE_CHECKING:
    from plait.lifecycle.models import Loaded

CHECKPOINT = Path("checkpoints") / "step_00000000"


def write_run(model, out: Path, source: Loaded, data_dir: Path | None, info: dict) -> Path:
    """The run directory `out` (absent or empty) holding `model` and the config of the model it was made from
    (`source`'s, with the new model's shape, on `data_dir` when given); `info` is recorded in the checkpoint's
    plait.json as ``compressed_from``. Returns the checkpoint."""
    cfg = from_dict(source.config) if source.config else Config()
    cfg.model = model.args
    cfg.finetune.init_from, cfg.finetune.lora_rank = "", 0
    cfg.run.name, cfg.run.out_dir = out.name, str(out.parent)
    cfg.data.seq_len = min(cfg.data.seq_len, model.args.max_seq_len)
    if data_dir is not None:
        cfg.data.source = str(data_dir)
    validate(cfg)
    exists = ConfigError(f"--out {out} exists and is not empty; choose another")
    with staged_dir(out, overwrite=False, exists_error=exists) as tmp:
        write_weights_checkpoint(
            model,
            tmp / CHECKPOINT,
            config=to_dict(cfg),
            tokenizer_path=source.tokenizer,
            extra={"compressed_from": {"path": str(source.path), **_jsonable(info)}},
        )
        (tmp / "config.toml").write_text(to_toml(cfg))
    return out / CHECKPOINT


def _jsonable(info: dict) -> dict:
    return json.loads(json.dumps(info, default=str))
