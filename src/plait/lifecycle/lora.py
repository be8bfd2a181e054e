"""LoRA adapters applied to a plain Transformer from outside; the model code knows nothing of them.

A target ``nn.Linear`` (``wq`` ... ``w3``, chosen by name) becomes a ``LoRALinear`` in place: the same object,
the same ``weight`` parameter, plus two new ones, ``lora_a`` (r, in) and ``lora_b`` (out, r)::

    y = x W^T + (alpha / r) * dropout(x) A^T B^T

Changing the class of the existing module rather than putting a new module in its place keeps everything
that refers to the module valid: parameter names (``layers.0.attention.wq.weight`` loads from any base
checkpoint; the adapters add ``...wq.lora_a`` / ``...wq.lora_b``), and the hooks and parameter registrations of
an FSDP2-sharded block, which swaps the gathered weight into this very module before each forward (FSDP2 itself
turns modules into FSDP subclasses the same way). B starts at zero, so a fresh adapter leaves the base model's
outputs bitwise unchanged.

An adapter is stored as a delta: a safetensors file of the LoRA tensors only, whose metadata names the hash
of the base weights it was trained on (``weights_hash``); loading it onto another base is refused.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor

from plait.config import LORA_TARGETS, FinetuneConfig
from plait.core.digest import sharded_weights_hash
from plait.core.digest import weights_hash as _weights_hash
from plait.core.errors import PlaitError
from plait.model.llama import canonical_name

ADAPTER_FORMAT = "plait-lora-v1"
ADAPTER_FILE = "adapter.safetensors"
_LORA_PARAMS = ("lora_a", "lora_b")


class LoRALinear(nn.Linear):
    """An ``nn.Linear`` with a low-rank trainable update; made from an existing one by ``adapt``."""

    lora_a: nn.Parameter  # (r, in_features)
    lora_b: nn.Parameter  # (out_features, r)
    scaling: float
    lora_dropout: float

    @classmethod
    def adapt(cls, linear: nn.Linear, rank: int, alpha: float, dropout: float, a_init: torch.Tensor) -> LoRALinear:
        """Turn ``linear`` into a LoRALinear in place (see the module docstring for why in place)."""
        if type(linear) is not nn.Linear:
            raise PlaitError(f"LoRA applies to plain nn.Linear modules, not {type(linear).__name__}")
        device = linear.weight.device
        linear.__class__ = cls
        linear.lora_a = nn.Parameter(a_init.to(device=device, dtype=torch.float32))
        linear.lora_b = nn.Parameter(torch.zeros(linear.out_features, rank, device=device))
        linear.scaling = alpha / rank
        linear.lora_dropout = dropout
        return linear  # type: ignore[return-value]

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        h = F.dropout(x, self.lora_dropout, self.training) if self.lora_dropout else x
        # Adapters stay fp32 parameters; under autocast or an FSDP bf16 policy x arrives in the compute dtype.
        delta = F.linear(F.linear(h, self.lora_a.to(x.dtype)), self.lora_b.to(x.dtype))  # (..., r) -> (..., out)
        return out + delta * self.scaling

    @torch.no_grad()
    def merge(self) -> nn.Linear:
        """Fold the update into the weight (W += (alpha / r) B A) and become a plain nn.Linear again."""
        self.weight += (self.lora_b @ self.lora_a).to(self.weight.dtype) * self.scaling
        for name in (*_LORA_PARAMS,):
            delattr(self, name)
        for name in ("scaling", "lora_dropout"):
            self.__dict__.pop(name, None)
        self.__class__ = nn.Linear
        return self

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, lora_rank={self.rank}, scaling={self.scaling:g}"


def parse_targets(targets: str | Iterable[str]) -> list[str]:
    names = [t.strip() for t in targets.split(",")] if isinstance(targets, str) else list(targets)
    names = [t for t in names if t]
    unknown = [t for t in names if t not in LORA_TARGETS]
    if not names or unknown:
        raise PlaitError(f"LoRA targets {names} must be chosen from {', '.join(LORA_TARGETS)}")
    return names


def is_lora_param(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in _LORA_PARAMS


def target_linears(model: nn.Module, targets: Iterable[str]) -> dict[str, nn.Linear]:
    """{canonical module name: module} of the linear layers named by targets (``wq`` matches ``*.wq``)."""
    wanted = set(targets)
    return {
        canonical_name(name): module
        for name, module in model.named_modules()
        if name.rsplit(".", 1)[-1] in wanted and isinstance(module, nn.Linear)
    }


def lora_a_init(name: str, rank: int, in_features: int, seed: int) -> torch.Tensor:
    """A's initial value: U(-1/sqrt(in), 1/sqrt(in)) (Kaiming-uniform with a=sqrt(5), as nn.Linear and PEFT
    use), drawn on the CPU from a generator seeded by (seed, module name): identical under every layout."""
    digest = hashlib.sha256(f"{seed}:lora:{name}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    bound = 1 / math.sqrt(in_features)
    return torch.empty(rank, in_features).uniform_(-bound, bound, generator=gen)


def apply_lora(
    model: nn.Module, rank: int, alpha: float, targets: str | Iterable[str], dropout: float = 0.0, seed: int = 0
) -> list[str]:
    """Give every target linear an adapter and freeze everything else; returns the adapted module names."""
    if rank < 1:
        raise PlaitError(f"LoRA rank must be at least 1, got {rank}")
    linears = target_linears(model, parse_targets(targets))
    if not linears:
        raise PlaitError(f"the model has no linear layers named {targets}")
    for name, linear in linears.items():
        if isinstance(linear, LoRALinear):
            raise PlaitError(f"{name} already has a LoRA adapter")
        LoRALinear.adapt(linear, rank, alpha, dropout, lora_a_init(name, rank, linear.in_features, seed))
    for name, param in model.named_parameters():
        param.requires_grad_(is_lora_param(name))
    return sorted(linears)


def apply_lora_config(model: nn.Module, cfg: FinetuneConfig, seed: int) -> list[str]:
    return apply_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets, cfg.lora_dropout, seed)


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    return {canonical_name(n): m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight: a plain Transformer again (exportable anywhere)."""
    for module in lora_modules(model).values():
        module.merge()
    for param in model.parameters():
        param.requires_grad_(True)
    return model


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
