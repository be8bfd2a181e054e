"""plait checkpoints to and from Hugging Face directories, streamed (plait.interop.streaming): one tensor at a
time is read, converted and written, so memory is bounded by the largest tensor, not the model.

- import (`plait ckpt import`): a transformers directory becomes a weights-only checkpoint ``step_00000000``
  (plait.engine.checkpoint.weights) and, into a run directory, that run's ``config.toml`` to fine-tune from.
  The whole output (the run directory, or the checkpoint directory) is staged and published by one rename
  (core.publish.staged_dir), so a crash leaves the old output or the new one, never a half-written one.
- export (`plait ckpt export`): a checkpoint (a LoRA run's with its adapters folded in) becomes a transformers
  directory or a safetensors file, each published whole too.

Imported directly by its path (not re-exported by plait.interop.hf, which the streaming module imports)."""

from __future__ import annotations

import dataclasses
import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

import torch

from plait.config import Config, to_dict, to_toml, validate
from plait.core.errors import ConfigError, PlaitError
from plait.core.publish import is_nonempty, staged_dir
from plait.core.storage import Location
from plait.engine.checkpoint import read_config, read_meta
from plait.engine.checkpoint.weights import load_checkpoint_model, publish_weights
from plait.interop.hf import HFWeights, export_safetensors, hf_export, open_hf, param_shapes
from plait.interop.shards import DEFAULT_MAX_SHARD_SIZE
from plait.interop.streaming import CheckpointTensors, StreamedHash, checkpoint_sources, save_streamed
from plait.model import Transformer
from plait.model.lora import merge_lora

STEP_DIR = re.compile(r"^step_\d+$")
IMPORTED_STEP = "step_00000000"


# ------------------------------------------------------------------------------------------------- import


def write_imported_checkpoint(
    hf: HFWeights, ckpt_dir: Path, *, config: dict, tokenizer_path: Path | None, extra: dict
) -> str:
    """``write_weights_checkpoint`` of a Hugging Face directory's weights, streamed: each tensor is read
    (mapped), cast to fp32, hashed and written when DCP's writer reaches it, so the process never holds the
    model. Returns the weights hash (``plait.core.digest``), which plait.json carries as a trained checkpoint's
    does."""
    shapes, sources = param_shapes(hf.args), checkpoint_sources(hf.args)
    hashed = StreamedHash()

    def produce(key: str) -> torch.Tensor:
        tensor = hf.read(sources[key]).float()
        if sources[key] == key:  # not the tied output.weight, which repeats the embeddings
            hashed.add(key, tensor)
        return tensor

    def save(tmp: Path) -> dict:
        save_streamed(tmp, {key: shapes[src] for key, src in sources.items()}, produce)
        return {"weights_hash": hashed.hexdigest()}

    publish_weights(ckpt_dir, save, config=config, tokenizer_path=tokenizer_path, extra=extra)
    return read_meta(ckpt_dir)["weights_hash"]


@dataclasses.dataclass
class HFImport:
    """What an import writes, decided (and checked) before anything is: the source, the output (a run
    directory, or a ``step_<N>`` checkpoint directory), the checkpoint inside it and the run's config."""

    hf: HFWeights
    hf_dir: Path
    out: Path
    run_dir: Path | None  # None: out is the checkpoint directory itself
    cfg: Config

    @property
    def ckpt_dir(self) -> Path:
        return self.out if self.run_dir is None else self.out / "checkpoints" / IMPORTED_STEP

    @property
    def tokenizer(self) -> Path:
        return self.hf_dir / "tokenizer.json"


def plan_import(hf_dir: Path, out: Path) -> HFImport:
    """Open a Hugging Face directory (names and shapes checked; no tensor read) and make the config a run
    fine-tuning it starts from (validated)."""
    if not hf_dir.is_dir():
        raise PlaitError(f"{hf_dir} is not a directory: give a Hugging Face model directory")
    run_dir = None if STEP_DIR.match(out.name) else out
    hf = open_hf(hf_dir)  # checks names and shapes; reads no tensor
    cfg = Config()
    cfg.model = hf.args
    cfg.data.seq_len = min(cfg.data.seq_len, hf.args.max_seq_len)
    if run_dir is not None:
        cfg.run.name, cfg.run.out_dir = run_dir.name, str(run_dir.parent)
    validate(cfg)
    return HFImport(hf, hf_dir, out, run_dir, cfg)


def write_import(plan: HFImport, *, overwrite: bool, moved: Callable[[Path], None] = lambda backup: None) -> str:
    """Write the import into a staged copy of the output and publish it in one step (core.publish.staged_dir);
    returns the weights hash. With ``overwrite`` a non-empty output is kept as ``<out>.old-<time>`` (told to
    ``moved``) once the new one is in its place."""
    out = plan.out
    exists = ConfigError(f"{out} exists; pass --overwrite (it is moved aside) or choose another --out")
    tokenizer = plan.tokenizer if plan.tokenizer.is_file() else None
    backup = (
        out.with_name(f"{out.name}.old-{time.strftime('%Y%m%d-%H%M%S')}") if overwrite and is_nonempty(out) else None
    )
    with staged_dir(out, overwrite=overwrite, exists_error=exists, keep_old=backup) as tmp:
        ckpt = tmp if plan.run_dir is None else tmp / "checkpoints" / IMPORTED_STEP
        digest = write_imported_checkpoint(plan.hf, ckpt, config=to_dict(plan.cfg), tokenizer_path=tokenizer,
                                           extra={"imported_from": _imported_from(plan)})  # fmt: skip
        if plan.run_dir is not None:
            (tmp / "config.toml").write_text(to_toml(plan.cfg))
    if backup is not None:
        moved(backup)
    return digest


def _imported_from(plan: HFImport) -> dict:
    """Where imported weights came from, for their plait.json."""
    config = plan.hf.config
    return {
        "path": str(plan.hf_dir.resolve()),
        "model_type": config.get("model_type"),
        "architectures": config.get("architectures"),
        "dtype": config.get("dtype", config.get("torch_dtype")),
    }


# ------------------------------------------------------------------------------------------------- export


def export_checkpoint_hf(
    ckpt: Location,
    out: Path,
    *,
    tokenizer_path: Path | None,
    dtype: torch.dtype,
    overwrite: bool,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    hashed: bool = False,
) -> tuple[str, str] | None:
    """Stream a checkpoint's model into a Hugging Face directory, one tensor at a time (read in fp32, cast,
    written into its shard). With ``hashed``: (weights hash of the checkpoint, weights hash of the weights as
    written, which differs for bf16), for the lineage registry, taken in the same pass.

    A LoRA run's checkpoint is written as the model it trained: each adapter folded into its weight.

    The checkpoint's hash is the one its plait.json carries where it has one (taken from the weights as they
    were saved; not for a LoRA run, whose export is the merged weights, hashed as they are read)."""
    cfg = read_config(ckpt)
    args, tune = cfg.model, cfg.finetune
    lora = (tune.lora_rank, tune.lora_alpha, tune.lora_targets) if tune.lora_rank else None
    recorded = read_meta(ckpt).get("weights_hash") if lora is None else None
    source = CheckpointTensors(ckpt, args, lora)
    read_hash, written_hash = StreamedHash(), StreamedHash()
    with hf_export(
        out,
        args,
        order=list(param_shapes(args)),
        tokenizer_path=tokenizer_path,
        dtype=dtype,
        overwrite=overwrite,
        max_shard_size=max_shard_size,
    ) as write:
        for name in param_shapes(args):
            tensor = source.read(name)
            if hashed and not recorded:
                read_hash.add(name, tensor)
            tensor = tensor.to(dtype)
            if hashed and dtype != torch.float32:
                written_hash.add(name, tensor, as_dtype=torch.float32)  # the weights as a reader gets them
            write(name, tensor)  # meanwhile the digests run
            read_hash.wait()  # before the next read: one tensor at a time
            written_hash.wait()
            del tensor
    if not hashed:
        return None
    source_hash = recorded or read_hash.hexdigest()
    return source_hash, written_hash.hexdigest() if dtype != torch.float32 else source_hash


def export_checkpoint_safetensors(ckpt: Location, target: Path, *, dtype: torch.dtype, overwrite: bool) -> Transformer:
    """Write a checkpoint's model (a LoRA run's: its adapters folded in) as one safetensors file with plait's
    names (replaced by one rename); returns the model written, in fp32."""
    model = cast(Transformer, merge_lora(load_checkpoint_model(ckpt)))
    export_safetensors(model, target, dtype=dtype, overwrite=overwrite)
    return model


def write_retrieval_pointer(ckpt: Location, target: Path) -> Path:
    """Write `<weights>.retrieval.json` beside an exported retrieval model: the database it trained with
    (plait.data.retrieval.database_record), which generation reads (plait generate --data DIR)."""
    from plait.data.retrieval import database_record

    source = read_config(ckpt).data.source
    record = {"trained_on": source, **database_record(source)}
    pointer = target.with_name(f"{target.stem}.retrieval.json")
    pointer.write_text(json.dumps(record, indent=2) + "\n")
    return pointer
