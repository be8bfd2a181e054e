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
from plait.core.records import Record, first_line
from plait.interop.hf.names import layer_hf_name, layer_plait_name

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
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
    chat_template: str | None = None,
) -> Path:
    """Write plait's LoRA tensors (canonical names) as a PEFT adapter directory `out`; returns it. A chat
    template the adapter was trained with goes beside it as chat_template.jinja, where transformers'
    AutoTokenizer (and so PEFT's and vLLM's loaders) read it."""
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
    written = [out / WEIGHTS_FILE, out / CONFIG_FILE]
    if chat_template:
        (out / CHAT_TEMPLATE_FILE).write_text(chat_template, encoding="utf-8")
        written.append(out / CHAT_TEMPLATE_FILE)
    for path in written:
        os.chmod(path, 0o644)  # for others to load and serve
    return out


def publish_peft_adapter(
    out: Path,
    adapter: Path,
    meta: dict,
    tensors: dict[str, torch.Tensor],
    *,
    targets: list[str],
    dtype: torch.dtype,
    base: str,
    overwrite: bool,
) -> Path:
    """A plait adapter file's contents (its metadata and tensors, plait.lifecycle.lora.read_adapter) written
    as a PEFT adapter directory `out`, in `dtype`, published whole (core.publish.staged_dir: a replaced `out`
    is removed only after the rename). The chat template its run trained with comes along."""
    from plait.core.publish import staged_dir

    exists = ConfigError(f"{out} exists; pass --overwrite or choose another --out")
    with staged_dir(out, overwrite=overwrite, exists_error=exists) as tmp:
        write_peft_adapter(
            tmp,
            {k: v.to(dtype) for k, v in tensors.items()},
            rank=int(meta["rank"]),
            alpha=float(meta["alpha"]),
            dropout=float(meta.get("dropout", 0.0) or 0.0),
            targets=targets,
            base=base,
            metadata={"base_weights_hash": meta.get("base_weights_hash", ""), "plait_adapter": str(adapter)},
            chat_template=trained_chat_template(adapter),
        )
    return out


def trained_chat_template(adapter: Path) -> str | None:
    """The chat template a LoRA run's data was rendered with (its prepared directory's manifest records it under
    loss_mask.chat_template), for the PEFT export to carry; None when the run trained without one."""
    from plait.core.errors import PlaitError
    from plait.data.chat import load_chat_template
    from plait.data.loader import read_manifest
    from plait.engine.checkpoint import read_config, resolve_checkpoint

    run = adapter.parent.parent if adapter.parent.name == "adapters" else None
    try:
        source = Path(read_config(resolve_checkpoint(run)).data.source) if run is not None else None
        recorded = (read_manifest(source).get("loss_mask") or {}).get("chat_template") if source else None
    except PlaitError:  # a run without checkpoints, or data no longer here: nothing to carry
        return None
    chat = load_chat_template(source) if recorded and source is not None else None
    return chat.text if chat is not None else None


def check_peft_base(base: str) -> None:
    """A base named for adapter_config.json's base_model_name_or_path: a plait run or checkpoint, or a
    transformers directory, here (a typo would write a config nothing can load)."""
    path = Path(base).expanduser()
    if base.startswith("s3://"):
        return
    if not path.is_dir():
        raise ConfigError(f"--base {base} does not exist: give the base model's plait run or transformers directory")
    markers = ("config.json", "plait.json", "checkpoints")
    if not any((path / name).exists() for name in markers):
        raise ConfigError(
            f"--base {base} is not a model (no config.json, plait.json or checkpoints/): give the base model's "
            "plait run, checkpoint or transformers directory"
        )


@dataclass
class PeftSettings:
    """What plait reads of an adapter_config.json, each field checked (check_peft_config)."""

    rank: int
    alpha: float
    dropout: float
    targets: list[str]  # plait's names: wq, wk, ...
    base: str


def check_peft_config(config: object, path: Path | str) -> PeftSettings:
    """An adapter_config.json's settings, each of its kind and range (by name), and what plait's LoRA cannot
    compute refused naming the setting."""
    fix = "PEFT writes r (an integer >= 1), lora_alpha (a number) and target_modules (module names)"
    if not isinstance(config, dict):
        raise ConfigError(f"{path} holds a JSON {type(config).__name__}, not an object: {fix}")
    c = Record(config, path, fix)
    where = str(Path(path).parent)
    peft_type = c.string("peft_type", default="")
    if peft_type != "LORA":
        raise ConfigError(f"{where} is a PEFT {peft_type or None} adapter; plait continues LoRA adapters")
    for key in ("use_rslora", "use_dora", "fan_in_fan_out"):
        if config.get(key) not in (None, False):
            raise ConfigError(f"{where} sets {key}={config[key]}: plait's LoRA computes plain LoRA (alpha / r)")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform"):
        if config.get(key):
            raise ConfigError(f"{where} sets {key}: plait's LoRA takes one rank and scale for every target layer")
    if config.get("bias", "none") != "none":
        raise ConfigError(f"{where} trains biases (bias={config['bias']!r}): plait's LoRA trains only A and B")
    rank = c.integer("r", 1)
    leaves = {_leaf(t): t for t in ("wq", "wk", "wv", "wo", "w1", "w2", "w3")}
    modules = c.strings("target_modules", default=[])
    unknown = [m for m in modules if m not in leaves]
    if unknown or not modules:
        raise ConfigError(f"{where} targets {unknown or modules}: plait adapts {', '.join(leaves)}")
    base = config.get("base_model_name_or_path")
    return PeftSettings(
        rank=rank,
        alpha=c.number("lora_alpha", positive=True, default=rank),
        dropout=c.number("lora_dropout", below=1.0, default=0.0),
        targets=sorted({leaves[m] for m in modules}, key=list(leaves.values()).index),  # plait's order
        base=c.string("base_model_name_or_path") if base is not None else "",
    )


def read_peft_adapter(path: str | Path) -> PeftAdapter:
    """A PEFT LoRA adapter directory as plait's tensors and settings; its config is checked first
    (check_peft_config), and what plait's LoRA cannot compute is refused naming the setting."""
    root = Path(path)
    where = str(root)
    try:
        config = json.loads((root / CONFIG_FILE).read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ConfigError(f"{root / CONFIG_FILE} cannot be read as JSON ({first_line(e)})") from None
    settings = check_peft_config(config, root / CONFIG_FILE)
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
        rank=settings.rank,
        alpha=settings.alpha,
        dropout=settings.dropout,
        targets=settings.targets,
        tensors=tensors,
        base=settings.base,
        metadata=metadata,
    )
