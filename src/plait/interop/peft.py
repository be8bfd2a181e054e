"""LoRA adapters in PEFT's format, both ways: what `peft.PeftModel.from_pretrained`, vLLM and SGLang load.

A PEFT adapter directory holds `adapter_config.json` (peft_type LORA, r, lora_alpha, target_modules, ...) and
`adapter_model.safetensors`, whose tensors are named after the transformers model's modules:
`base_model.model.model.layers.<i>.self_attn.q_proj.lora_A.weight` (r, in) and `...lora_B.weight` (out, r).
plait's adapters are the same two matrices (`layers.<i>.attention.wq.lora_a` / `lora_b`) with the same scale
(lora_alpha / r), so the conversion is names only: the numbers are bitwise the same. Adapters PEFT configures
in ways plait's LoRA does not compute (rsLoRA, DoRA, per-layer ranks, trained biases, extra saved modules)
are refused by name on reading.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from plait.core.errors import ConfigError
from plait.interop.hf.names import layer_hf_name, layer_plait_name

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_PLAIT_TO_PEFT = {"lora_a": "lora_A.weight", "lora_b": "lora_B.weight"}


@dataclass
class PeftAdapter:
    rank: int
    alpha: float
    dropout: float
    targets: list[str]  # plait's names: wq, wk, ...
    tensors: dict[str, torch.Tensor]  # plait's names: layers.<i>.attention.wq.lora_a, ...
    base: str  # base_model_name_or_path
    metadata: dict[str, str]


def is_peft_adapter(path: str | Path) -> bool:
    return (Path(path) / CONFIG_FILE).is_file()


def _module(plait_module: str) -> str:
    """layers.<i>.attention.wq -> model.layers.<i>.self_attn.q_proj (transformers' module)."""
    return layer_hf_name(plait_module + ".weight").removesuffix(".weight")


def _leaf(target: str) -> str:
    probe = {"wq": "attention.wq", "wk": "attention.wk", "wv": "attention.wv", "wo": "attention.wo"}
    return _module(f"layers.0.{probe.get(target, 'feed_forward.' + target)}").rsplit(".", 1)[-1]


def write_peft_adapter(
    out: Path,
    tensors: dict[str, torch.Tensor],
    *,
    rank: int,
    alpha: float,
    dropout: float,
    targets: list[str],
    base: str,
    metadata: dict[str, str] | None = None,
) -> Path:
    """Write plait's LoRA tensors (canonical names) as a PEFT adapter directory `out`; returns it."""
    peft_tensors = {}
    for name, tensor in tensors.items():
        module, kind = name.rsplit(".", 1)
        peft_tensors[f"{_PREFIX}{_module(module)}.{_PLAIT_TO_PEFT[kind]}"] = tensor.detach().to("cpu").contiguous()
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": sorted({_leaf(t) for t in targets}),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
    }
    out.mkdir(parents=True, exist_ok=True)
    save_file(peft_tensors, out / WEIGHTS_FILE, metadata={"format": "pt", **(metadata or {})})
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    for path in (out / WEIGHTS_FILE, out / CONFIG_FILE):
        os.chmod(path, 0o644)  # for others to load and serve
    return out


def read_peft_adapter(path: str | Path) -> PeftAdapter:
    """A PEFT LoRA adapter directory as plait's tensors and settings; what plait's LoRA cannot compute is
    refused naming the setting."""
    root = Path(path)
    where = str(root)
    try:
        config = json.loads((root / CONFIG_FILE).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{root / CONFIG_FILE} cannot be read as JSON ({e})") from None
    if config.get("peft_type") != "LORA":
        raise ConfigError(f"{where} is a PEFT {config.get('peft_type')} adapter; plait continues LoRA adapters")
    for key, unsupported in (
        ("use_rslora", True), ("use_dora", True), ("fan_in_fan_out", True),
    ):  # fmt: skip
        if config.get(key) == unsupported:
            raise ConfigError(f"{where} sets {key}={unsupported}: plait's LoRA computes plain LoRA (alpha / r)")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform"):
        if config.get(key):
            raise ConfigError(f"{where} sets {key}: plait's LoRA takes one rank and scale for every target layer")
    if config.get("bias", "none") != "none":
        raise ConfigError(f"{where} trains biases (bias={config['bias']!r}): plait's LoRA trains only A and B")
    leaves = {_leaf(t): t for t in ("wq", "wk", "wv", "wo", "w1", "w2", "w3")}
    modules = config.get("target_modules") or []
    modules = [modules] if isinstance(modules, str) else modules
    unknown = [m for m in modules if m not in leaves]
    if unknown or not modules:
        raise ConfigError(f"{where} targets {unknown or modules}: plait adapts {', '.join(leaves)}")
    try:
        with safe_open(str(root / WEIGHTS_FILE), framework="pt") as f:
            raw = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (a safe_open handle is not a dict)
            metadata = f.metadata() or {}
    except (OSError, SafetensorError) as e:
        raise ConfigError(f"{root / WEIGHTS_FILE} cannot be read ({e}); PEFT writes {WEIGHTS_FILE}") from None
    tensors = {}
    for key, tensor in raw.items():
        kind = next((k for k, suffix in _PLAIT_TO_PEFT.items() if key.endswith("." + suffix)), None)
        if not key.startswith(_PREFIX) or kind is None:
            raise ConfigError(f"{where}: tensor {key} is not a LoRA A or B matrix of a transformers model")
        module = key.removeprefix(_PREFIX).removesuffix("." + _PLAIT_TO_PEFT[kind])
        plait = layer_plait_name(module + ".weight")
        if plait is None:
            raise ConfigError(f"{where}: tensor {key} adapts {module}, which plait's LoRA does not")
        tensors[f"{plait.removesuffix('.weight')}.{kind}"] = tensor.float()
    return PeftAdapter(
        rank=int(config["r"]),
        alpha=float(config.get("lora_alpha", config["r"])),
        dropout=float(config.get("lora_dropout", 0.0)),
        targets=sorted((leaves[m] for m in modules), key=list(leaves.values()).index),  # plait's order, not PEFT's set
        tensors=tensors,
        base=str(config.get("base_model_name_or_path") or ""),
        metadata=metadata,
    )
