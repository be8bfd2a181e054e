"""Weight-only quantization: int8 with one absmax scale per output channel, or int4 with one absmax scale per
group of ``group_size`` input columns (two values per byte), in two formats.

- torchao's (the default of ``plait compress quantize``): the same schemes through torchao (int8 weight-only
  per channel, ``Int8WeightOnlyConfig``; int4 weight-only per group of ``group_size``, ``IntxWeightOnlyConfig``)
  on the block linears (the output projection and embeddings stay fp32, as transformers' TorchAoConfig leaves
  them). Written as a transformers directory whose config.json carries the quantization config and whose
  safetensors hold torchao's tensors: ``AutoModelForCausalLM.from_pretrained`` loads it quantized (vLLM reads
  the same). plait measures it with the same torchao quantization of its own model: the same weights, the same
  kernels, so both give the same greedy tokens.
- plait's own (``plait-quant-v1``, ``--format plait``): every linear layer becomes a QuantLinear (the output
  projection too unless it is tied to the embedding); embeddings and norms stay fp32. Weights are dequantized
  on the fly: the gain is memory, not speed (weight-only int8 kernels pay off on GPUs with bf16 activations).
  The result (``model.safetensors`` + ``tokenizer.json``) is a format plait loads; transformers has no loader
  for it.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from plait.core.errors import ConfigError, PlaitError
from plait.model.llama import ModelArgs, Transformer

QUANT_FORMAT = "plait-quant-v1"
BLOCK_LINEARS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")


# -------------------------------------------------------------------------------------------- quantization


class QuantLinear(nn.Module):
    """A linear layer whose weight is stored as int8 (per-output-channel scales) or packed int4 (per-group
    scales) and dequantized when used. A bias (Qwen2's q/k/v) stays in fp32: out_features values, nothing
    to gain from quantizing them."""

    # Buffers (register_buffer), declared for the type checker.
    qweight: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self, in_features: int, out_features: int, bits: int, group_size: int = 0, device=None, bias: bool = False
    ):
        super().__init__()
        if bits not in (4, 8):
            raise PlaitError(f"bits={bits}: choose 8 or 4")
        self.in_features, self.out_features, self.bits = in_features, out_features, bits
        # A layer whose width group_size does not divide uses the largest group that divides both.
        self.group_size = math.gcd(group_size, in_features) if bits == 4 else in_features
        if self.group_size % 2:
            raise PlaitError(f"group_size={group_size}: groups of a layer with {in_features} inputs would be odd")
        groups = in_features // self.group_size
        if bits == 8:
            self.register_buffer("qweight", torch.empty(out_features, in_features, dtype=torch.int8, device=device))
            self.register_buffer("scales", torch.empty(out_features, device=device))
        else:
            self.register_buffer(
                "qweight", torch.empty(out_features, in_features // 2, dtype=torch.uint8, device=device)
            )
            self.register_buffer("scales", torch.empty(out_features, groups, device=device))
        self.register_buffer("bias", torch.empty(out_features, device=device) if bias else None)

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear, bits: int, group_size: int) -> QuantLinear:
        w = linear.weight.detach().float()
        q = cls(
            linear.in_features, linear.out_features, bits, group_size, device=w.device, bias=linear.bias is not None
        )
        if linear.bias is not None:
            assert q.bias is not None  # made with bias=True just above
            q.bias.copy_(linear.bias.detach().float())
        if bits == 8:
            scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127  # (out,)
            q.qweight.copy_(torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
            q.scales.copy_(scale)
        else:
            g = w.view(w.shape[0], -1, q.group_size)  # (out, groups, G)
            scale = g.abs().amax(dim=2).clamp(min=1e-12) / 7  # (out, groups)
            codes = (torch.round(g / scale[..., None]).clamp(-8, 7) + 8).to(torch.uint8).view(w.shape[0], -1)
            q.qweight.copy_(codes[:, 0::2] | (codes[:, 1::2] << 4))  # two 4-bit codes per byte
            q.scales.copy_(scale)
        return q

    def dequantize(self) -> torch.Tensor:
        if self.bits == 8:
            return self.qweight.float() * self.scales[:, None]
        low, high = self.qweight & 0xF, self.qweight >> 4
        codes = torch.stack([low, high], dim=-1).view(self.out_features, -1).float() - 8  # (out, in)
        g = codes.view(self.out_features, -1, self.group_size) * self.scales[..., None]
        return g.view(self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Dequantize, then one dense matmul: torch._weight_int8pack_mm is slower than the dense matmul on a CPU
        # (docs/measurements.md, "compress: int8 weights dequantized").
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantize().to(x.dtype), bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, int{self.bits}, group={self.group_size}"


def _quant_targets(model: Transformer) -> list[str]:
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] in BLOCK_LINEARS]
    if model.output is not None and not model.args.tie_embeddings:
        names.append("output")
    return names


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def quantize_model(model: Transformer, bits: int, group_size: int = 64) -> Transformer:
    """Replace every target linear by a QuantLinear (in place); returns the model."""
    for name in _quant_targets(model):
        _set_module(model, name, QuantLinear.from_linear(cast(nn.Linear, model.get_submodule(name)), bits, group_size))
    return model


def torchao_config(bits: int, group_size: int):
    """torchao's config of a weight-only scheme: int8 per output channel, or int4 per group of input columns."""
    try:
        from torchao.quantization import Int8WeightOnlyConfig, IntxWeightOnlyConfig
        from torchao.quantization.granularity import PerGroup
    except ImportError:
        raise ConfigError("--format torchao needs torchao and transformers: pip install 'plait[quant]'") from None
    if bits == 8:
        return Int8WeightOnlyConfig()
    return IntxWeightOnlyConfig(
        weight_dtype=torch.int4,  # type: ignore[attr-defined]  # torch's stubs lack the sub-byte dtypes
        granularity=PerGroup(group_size),
    )


def check_torchao(model: Transformer, bits: int, group_size: int) -> None:
    """What torchao's format cannot hold, refused before any work."""
    if model.args.moe_experts:
        raise ConfigError("--format torchao quantizes dense models; a mixture of experts quantizes with --format plait")
    widths = {cast(nn.Linear, model.get_submodule(n)).in_features for n in _quant_targets(model) if n != "output"}
    if bits == 4 and any(w % group_size for w in widths):
        raise ConfigError(
            f"--group-size={group_size} must divide every quantized layer's input width ({sorted(widths)}), e.g. 32"
        )


def torchao_quantize(model: Transformer, bits: int, group_size: int) -> Transformer:
    """The block linears of `model` quantized in place by torchao, as transformers' TorchAoConfig quantizes
    the exported model's; returns the model."""
    from torchao.quantization import quantize_

    targets = {n for n in _quant_targets(model) if n != "output"}
    quantize_(model, torchao_config(bits, group_size), filter_fn=lambda module, fqn: fqn in targets)
    return model


def save_torchao(
    model: Transformer, out_dir: Path, *, bits: int, group_size: int, tokenizer: Path | None
) -> tuple[int, str]:
    """Write `model` (float) as a torchao-quantized transformers directory; returns its weight files' bytes and
    their sha256 (the artifact's content hash)."""
    import hashlib
    import tempfile

    try:
        from transformers import AutoModelForCausalLM, TorchAoConfig
    except ImportError:
        raise ConfigError("--format torchao needs torchao and transformers: pip install 'plait[quant]'") from None
    from plait.interop.hf import export_hf

    with tempfile.TemporaryDirectory(prefix="plait-quant-") as tmp:
        export_hf(model, Path(tmp) / "float", tokenizer_path=tokenizer)
        config = TorchAoConfig(quant_type=torchao_config(bits, group_size), modules_to_not_convert=["lm_head"])
        hf = AutoModelForCausalLM.from_pretrained(Path(tmp) / "float", dtype=torch.float32, quantization_config=config)
        hf.save_pretrained(out_dir)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if (Path(tmp) / "float" / name).is_file():
                shutil.copyfile(Path(tmp) / "float" / name, out_dir / name)
    files = sorted(out_dir.glob("model*.safetensors"))
    for path in out_dir.iterdir():  # safetensors writes 0600: a published model is for others to read
        path.chmod(0o644)
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.read_bytes())
    return sum(p.stat().st_size for p in files), digest.hexdigest()


def save_quantized(
    model: Transformer, out_dir: Path, *, bits: int, group_size: int, meta: dict, tokenizer: Path | None
) -> str:
    """Write model.safetensors (plait-quant-v1) and tokenizer.json; returns the content hash of the tensors."""
    from plait.lifecycle.lora import weights_hash

    tensors = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items() if not k.startswith("rope_")}
    if model.args.tie_embeddings:
        tensors.pop("output.weight", None)
    digest = weights_hash(tensors)
    out_dir.mkdir(parents=True, exist_ok=True)
    metadata = {
        "format": "pt",
        "plait_format": QUANT_FORMAT,
        "bits": str(bits),
        "group_size": str(group_size),
        "model_args": json.dumps(asdict(model.args)),
        "weights_hash": digest,
        "meta": json.dumps(meta, default=str),
    }
    save_file(tensors, out_dir / "model.safetensors", metadata=metadata)
    if tokenizer is not None:
        shutil.copyfile(tokenizer, out_dir / "tokenizer.json")
    return digest


def load_quantized(path: str | Path, device: str | torch.device = "cpu") -> tuple[Transformer, dict[str, Any]]:
    from plait.interop.hf import empty_model

    path = Path(path)
    file = path / "model.safetensors" if path.is_dir() else path
    with safe_open(str(file), framework="pt") as f:
        md = f.metadata() or {}
        if md.get("plait_format") != QUANT_FORMAT:
            raise PlaitError(f"{file} is not a plait quantized model")
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    args = ModelArgs(**json.loads(md["model_args"]))
    bits, group = int(md["bits"]), int(md["group_size"])
    with torch.device("meta"):
        skeleton = Transformer(args)
    targets = _quant_targets(skeleton)
    model = empty_model(replace(args, n_layers=0), device)  # embeddings, norm, output, rope tables
    model.args = args
    model.layers = skeleton.layers.to_empty(device=device)
    for name in targets:
        lin = cast(nn.Linear, skeleton.get_submodule(name))
        quant = QuantLinear(lin.in_features, lin.out_features, bits, group, device=device, bias=lin.bias is not None)
        _set_module(model, name, quant)
    if args.tie_embeddings:
        tensors["output.weight"] = tensors["tok_embeddings.weight"]
    model.load_state_dict(tensors, strict=False)
    missing = {k for k in model.state_dict() if not k.startswith("rope_")} - set(tensors)
    if missing:
        raise PlaitError(f"{file} lacks tensors: {sorted(missing)[:4]}")
    model.tie_weights()
    meta = json.loads(md.get("meta", "{}"))
    return model.eval(), {**meta, "bits": bits, "group_size": group, "weights_hash": md["weights_hash"]}
