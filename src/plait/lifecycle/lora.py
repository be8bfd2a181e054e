"""LoRA adapters as artifacts: adapter files (a delta of the LoRA tensors only, whose metadata names the hash of
the base weights it was trained on; loading one onto another base is refused), weights hashes, and the
fine-tuning run's wiring. The layer itself (``LoRALinear``, applying and merging) lives in ``plait.model.lora``,
re-exported here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor

from plait.config import FinetuneConfig
from plait.core.digest import sharded_weights_hash
from plait.core.digest import weights_hash as _weights_hash
from plait.core.errors import PlaitError
from plait.model.llama import canonical_name
from plait.model.lora import (  # noqa: F401 (re-exported: the layer, for users of plait.lifecycle.lora)
    LORA_TARGETS,
    LoRALinear,
    apply_lora,
    fold,
    is_lora_param,
    lora_a_init,
    lora_modules,
    lora_shapes,
    merge_lora,
    parse_targets,
    target_linears,
)

ADAPTER_FORMAT = "plait-lora-v1"
ADAPTER_FILE = "adapter.safetensors"


def apply_lora_config(model: nn.Module, cfg: FinetuneConfig, seed: int) -> list[str]:
    return apply_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets, cfg.lora_dropout, seed)


# ------------------------------------------------------------------------------------------ weights and hashes


def _full(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.full_tensor() if isinstance(t, DTensor) else t


def lora_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters only: ``<module>.lora_a`` / ``<module>.lora_b``, canonical names."""
    return {canonical_name(n): _full(p) for n, p in model.named_parameters() if is_lora_param(n)}


def weights_hash(tensors: Mapping[str, torch.Tensor]) -> str:
    """The identity of a set of weights (``plait.core.digest``: per-tensor digests of name, position and value
    bits, combined with SHA-256). Checkpoints store fp32 parameters, so the hash of a model in memory equals
    that of the checkpoint it was loaded from (and of a Hugging Face import, cast to fp32 on the way in)."""
    return _weights_hash(tensors)


def model_weights_hash(model: nn.Module, *, include_lora: bool = False) -> str:
    """``weights_hash`` of a model's parameters (without adapters unless asked), from the shards each rank
    holds: nothing is gathered, one small all-reduce. With FSDP / TP every rank must call this."""
    params = {canonical_name(n): p for n, p in model.named_parameters() if include_lora or not is_lora_param(n)}
    return sharded_weights_hash(sorted(params.items()))


def base_weights_hash(model: nn.Module) -> str:
    return model_weights_hash(model)


# ---------------------------------------------------------------------------------------------- adapter files


def save_adapter(
    model: nn.Module,
    path: str | Path,
    *,
    base_hash: str,
    rank: int,
    alpha: float,
    targets: str | Iterable[str],
    base_path: str | None = None,
    extra: Mapping[str, str] | None = None,
) -> Path:
    """Write the adapters of ``model`` (not the base) to a safetensors file that names its base."""
    tensors = {k: v.to("cpu", torch.float32).contiguous() for k, v in lora_tensors(model).items()}
    if not tensors:
        raise PlaitError("the model has no LoRA adapters to save")
    args = getattr(model, "args", None)
    metadata = {
        "format": "pt",
        "plait_format": ADAPTER_FORMAT,
        "base_weights_hash": base_hash,
        "base_path": base_path or "",
        "rank": str(rank),
        "alpha": repr(float(alpha)),
        "targets": ",".join(parse_targets(targets)),
        "adapter_hash": weights_hash(tensors),
        "model_args": json.dumps(args.__dict__) if args is not None else "",
        **(extra or {}),
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(tensors, tmp, metadata=metadata)
    os.chmod(tmp, 0o644)  # safetensors writes 0600: an adapter is for others to load (and serve), as published dirs
    tmp.replace(path)
    return path


def resolve_adapter(path: str | Path) -> Path:
    """An adapter file itself, or the newest one of a LoRA run directory (``<run>/adapters/step_<N>.safetensors``)."""
    path = Path(path).expanduser()
    if path.is_dir():
        found = sorted((path / "adapters").glob("step_*.safetensors")) or sorted(path.glob(ADAPTER_FILE))
        if not found:
            raise PlaitError(f"{path} holds no adapter (looked for adapters/step_*.safetensors and {ADAPTER_FILE})")
        return found[-1]
    if not path.is_file():
        raise PlaitError(
            f"{path} does not exist: give an adapter file (a LoRA run writes <run>/adapters/step_N.safetensors)"
        )
    return path


def read_adapter(path: str | Path) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """(metadata, tensors) of an adapter file; refuses anything else."""
    path = resolve_adapter(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("plait_format") != ADAPTER_FORMAT:
                raise PlaitError(f"{path} is not a plait LoRA adapter (no {ADAPTER_FORMAT} metadata)")
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (a safe_open handle is not a dict)
    except SafetensorError as e:
        raise PlaitError(f"cannot read {path}: {e}") from None
    return meta, tensors


def check_base(meta: Mapping[str, str], base_hash: str, where: str) -> None:
    """Refuse an adapter whose recorded base is not the given weights."""
    expected = meta.get("base_weights_hash", "")
    if expected != base_hash:
        origin = f" (it was trained on {meta['base_path']})" if meta.get("base_path") else ""
        raise PlaitError(
            f"adapter {where} belongs to base weights {expected[:12]}{origin}, but this model's weights hash to "
            f"{base_hash[:12]}: load the adapter onto its own base (`plait lineage show {where}` names it)"
        )


def load_adapter(model: nn.Module, path: str | Path, *, base_hash: str | None = None) -> dict[str, str]:
    """Verify that ``model`` is the adapter's base, then add the adapter (unmerged). Returns its metadata."""
    meta, tensors = read_adapter(path)
    check_base(meta, base_hash or base_weights_hash(model), str(path))
    rank, alpha = int(meta["rank"]), float(meta["alpha"])
    apply_lora(model, rank, alpha, meta["targets"])
    own = dict(model.named_parameters())
    expected = {canonical_name(n): tuple(p.shape) for n, p in own.items() if is_lora_param(n)}
    found = {k: tuple(v.shape) for k, v in tensors.items()}
    if found != expected:
        missing = sorted(set(expected) - set(found))[:3]
        extra = sorted(set(found) - set(expected))[:3]
        raise PlaitError(f"adapter {path} does not fit this model (missing {missing}, unexpected {extra})")
    params = {canonical_name(n): p for n, p in own.items()}
    with torch.no_grad():
        for name, value in tensors.items():
            params[name].copy_(value)
    return meta
