"""Load any model artifact for evaluation, compression or serving, and find (or add) it in the lineage.

An artifact reference is one of: a plait checkpoint or run directory (LoRA runs included: base + adapters),
a Hugging Face directory, an adapter file (loaded onto the base it names, after checking the base's hash),
a plait safetensors export, or a quantized directory from ``plait compress quantize``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from safetensors import SafetensorError, safe_open

from plait.core.errors import PlaitError
from plait.core.storage import Location, RemotePath
from plait.lifecycle.lineage import Artifact, Registry
from plait.lifecycle.lora import ADAPTER_FORMAT, load_adapter, model_weights_hash
from plait.model.llama import Transformer


@dataclass
class Loaded:
    model: Transformer
    kind: str  # checkpoint | hf | adapter | safetensors | quantized
    path: Location  # local, or s3:// for a checkpoint there
    tokenizer: Path | None  # always local (fetched from S3 where need be)
    config: dict | None = None  # the plait config that made it, where known
    meta: dict[str, Any] = field(default_factory=dict)
    _hash: str | None = None

    def weights_hash(self) -> str:
        """Hash of all the model's weights (adapters included): what lineage records for this artifact."""
        if self._hash is None:
            if self.kind == "quantized":
                self._hash = self.meta["weights_hash"]
            elif self.kind == "adapter":  # an adapter's identity is its delta (its base has its own hash)
                from plait.lifecycle.lora import lora_tensors, weights_hash

                self._hash = weights_hash(lora_tensors(self.model))
            else:
                self._hash = model_weights_hash(self.model, include_lora=True)
        return self._hash


def safetensors_format(path: Path) -> str | None:
    try:
        with safe_open(str(path), framework="pt") as f:
            return (f.metadata() or {}).get("plait_format")
    except (SafetensorError, OSError):
        return None


def load_model(
    ref: str | Path | RemotePath, *, device: str | torch.device = "cpu", base: str | Path | None = None
) -> Loaded:
    """The model behind an artifact reference (see the module docstring), in fp32 on ``device``. An s3://
    reference is a plait checkpoint (or run / checkpoints prefix) there."""
    from plait.engine.checkpoint import resolve_checkpoint
    from plait.interop.hf import load_hf_model, load_safetensors

    if isinstance(ref, RemotePath) or str(ref).startswith("s3://"):
        return _load_checkpoint(resolve_checkpoint(ref), device)
    path = Path(ref).expanduser()
    if not path.exists():
        raise PlaitError(f"{path} does not exist: give a checkpoint, run, Hugging Face directory or adapter file")
    if path.is_file():
        fmt = safetensors_format(path)
        if fmt == ADAPTER_FORMAT:
            return _load_adapter(path, device, base)
        if fmt == "plait-safetensors-v1":
            tok = path.with_name("tokenizer.json")
            return Loaded(load_safetensors(path, device), "safetensors", path, tok if tok.is_file() else None)
        raise PlaitError(f"{path} is not a plait adapter or safetensors export")
    if (path / "model.safetensors").is_file() and not (path / "config.json").is_file():
        from plait.lifecycle.quantize import QUANT_FORMAT, load_quantized

        if safetensors_format(path / "model.safetensors") == QUANT_FORMAT:
            model, meta = load_quantized(path, device)
            return Loaded(model, "quantized", path, _tok(path), meta.get("config"), meta)
    if (path / "config.json").is_file() and not (path / "plait.json").is_file():
        return Loaded(load_hf_model(path, device), "hf", path, _tok(path))
    ckpt = resolve_checkpoint(path)
    return _load_checkpoint(ckpt, device)


def _tok(directory: Path) -> Path | None:
    tok = directory / "tokenizer.json"
    return tok if tok.is_file() else None


def _load_checkpoint(ckpt: Location, device) -> Loaded:
    from plait.config import to_dict
    from plait.engine.checkpoint import checkpoint_model, local_file, read_config, read_meta

    meta = read_meta(ckpt)
    cfg = read_config(ckpt)
    # a LoRA run's checkpoint: the base and its adapters (not merged); a plait Transformer either way
    model = cast(Transformer, checkpoint_model(ckpt, device))
    extra: dict[str, Any] = {k: meta[k] for k in ("imported_from", "weights_only", "train_state") if k in meta}
    return Loaded(model, "checkpoint", ckpt, local_file(ckpt / "tokenizer.json"), to_dict(cfg), extra)


def _load_adapter(path: Path, device, base: str | Path | None) -> Loaded:
    from plait.lifecycle.lora import read_adapter

    meta, _ = read_adapter(path)
    base_ref = base or meta.get("base_path")
    if not base_ref:
        raise PlaitError(f"adapter {path} does not record where its base is: pass the base model (--base)")
    loaded = load_model(base_ref, device=device)
    if loaded.kind == "quantized":
        raise PlaitError(f"adapter {path} needs an unquantized base; {base_ref} is quantized")
    load_adapter(loaded.model, path)  # refuses a base with other weights
    tok = loaded.tokenizer or _tok(path.parent)
    return Loaded(loaded.model, "adapter", path, tok, loaded.config, {"adapter": meta, "base": str(loaded.path)})


# -------------------------------------------------------------------------------------------------- lineage


def artifact_for(registry: Registry, loaded: Loaded) -> Artifact:
    """The registry's artifact for a loaded model: by path (if its weights still match), else by weights hash,
    else a new one (an HF directory counts as an import)."""
    found = registry.by_path(loaded.path)
    if found is not None and (found.weights_hash in (None, loaded.weights_hash())):
        return found
    found = registry.by_weights(loaded.weights_hash())
    if found is not None:
        return found
    kind = {"hf": "import", "adapter": "adapter", "quantized": "quantized", "safetensors": "export"}.get(
        loaded.kind, "import" if loaded.meta.get("imported_from") else "checkpoint"
    )
    aid = registry.record(
        kind,
        name=loaded.path.name if loaded.path.name not in ("adapter.safetensors",) else loaded.path.parent.name,
        path=loaded.path,
        weights_hash=loaded.weights_hash(),
        config=loaded.config,
        extra={"registered_by": "lookup", **{k: v for k, v in loaded.meta.items() if k == "imported_from"}},
    )
    return registry.get(aid)


def describe(loaded: Loaded) -> str:
    m = loaded.model.args
    return (
        f"{loaded.kind} {loaded.path} ({sum(p.numel() for p in loaded.model.parameters()) / 1e6:.2f}M parameters, "
        f"dim {m.dim}, {m.n_layers} layers, vocab {m.vocab_size})"
    )
