"""Compression: weight-only quantization, pruning (with a fine-tune after) and knowledge distillation.

Each operation measures the model before and after on the same footing: size of the weights, forward
throughput (tokens/s on a fixed batch) and perplexity on held-out data, and reports the deltas.

- ``quantize``: int8 with one absmax scale per output channel, or int4 with one absmax scale per group of
  ``group_size`` input columns (two values per byte). Every linear layer is quantized (the output projection
  too unless it is tied to the embedding); embeddings and norms stay fp32. Weights are dequantized on the fly:
  the gain is memory, not speed (weight-only int8 kernels pay off on GPUs with bf16 activations). The result
  is a plait format (``model.safetensors`` + ``tokenizer.json``) that plait loads; transformers has no loader
  for it.
- ``prune``: 'magnitude' zeroes the smallest weights of every block linear (unstructured, per layer);
  'structured' removes the least important SwiGLU channels (the same number in every layer), which gives a
  smaller dense model. Either can be fine-tuned for a few steps afterwards (magnitude pruning keeps its zeros).
- ``distill``: train a smaller plait student on a plait teacher's logits: KL(teacher || student) at a
  temperature T, times T^2, optionally mixed with the usual next-token loss.

Pruned and distilled models are ordinary plait runs (weights-only checkpoint + config.toml: train, generate,
``plait ckpt export`` as usual) and can be written as Hugging Face Llama directories at once (``hf_out``).
"""

from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from plait.core.errors import PlaitError
from plait.model.llama import ModelArgs, Transformer

QUANT_FORMAT = "plait-quant-v1"
BLOCK_LINEARS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")


# -------------------------------------------------------------------------------------------- quantization


class QuantLinear(nn.Module):
    """A linear layer whose weight is stored as int8 (per-output-channel scales) or packed int4 (per-group
    scales) and dequantized when used. A bias (Qwen2's q/k/v) stays in fp32: out_features values, nothing
    to gain from quantizing them."""

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
        _set_module(model, name, QuantLinear.from_linear(model.get_submodule(name), bits, group_size))
    return model


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
        lin = skeleton.get_submodule(name)
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


# ------------------------------------------------------------------------------------------------ measuring


def weights_bytes(model: nn.Module) -> int:
    """Bytes of the stored weights (parameters and quantized buffers; tied tensors once; no rotary tables)."""
    seen, total = set(), 0
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if name.startswith("rope_") or id(t) in seen:
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total


@torch.no_grad()
def throughput(model: nn.Module, seq_len: int = 128, batch: int = 4, repeats: int = 3) -> float:
    """Forward tokens per second on a fixed random batch (best of ``repeats`` after one warm-up)."""
    args = model.args
    seq_len = min(seq_len, args.max_seq_len)
    device = next(iter(model.state_dict().values())).device
    x = torch.randint(0, args.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(0)).to(device)
    model.eval()
    model(x)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        model(x)
        best = min(best, time.perf_counter() - start)
    return batch * seq_len / best


def measure(model: nn.Module, data_dir: Path | None, *, seq_len: int, batches: int) -> dict[str, float]:
    from plait.lifecycle.evaluate import perplexity

    quant = [m for m in model.modules() if isinstance(m, QuantLinear)]
    logical = sum(m.in_features * m.out_features for m in quant)  # a quantized weight still counts as weights
    out = {
        "size_mb": weights_bytes(model) / 2**20,
        "params_m": (sum(p.numel() for p in model.parameters()) + logical) / 1e6,
        "nonzero_m": (sum(int((p != 0).sum()) for p in model.parameters()) + logical) / 1e6,
        "tokens_per_s": throughput(model, seq_len),
    }
    if data_dir is not None:
        out["perplexity"] = perplexity(model, data_dir, seq_len=seq_len, max_batches=batches)["perplexity"]
    return out


def compare(before: dict[str, float], after: dict[str, float]) -> dict[str, dict[str, float]]:
    rows = {}
    for key in before:
        if key in after:
            b, a = before[key], after[key]
            rows[key] = {"before": b, "after": a, "delta": a - b, "ratio": a / b if b else math.nan}
    return rows


def print_comparison(title: str, rows: dict[str, dict[str, float]], console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=120)
    labels = {
        "size_mb": "weights (MiB)",
        "params_m": "parameters (M)",
        "nonzero_m": "non-zero parameters (M)",
        "tokens_per_s": "forward tokens/s",
        "perplexity": "perplexity (val)",
    }
    table = Table(title=title, title_justify="left")
    for col in ("metric", "before", "after", "delta", "after / before"):
        table.add_column(col, justify="right" if col != "metric" else "left")
    for key, r in rows.items():
        table.add_row(
            labels.get(key, key),
            f"{r['before']:,.3f}",
            f"{r['after']:,.3f}",
            f"{r['delta']:+,.3f}",
            f"{r['ratio']:.3f}",
        )
    console.print(table)


# ------------------------------------------------------------------------------------------------- pruning


@torch.no_grad()
def magnitude_prune(model: Transformer, sparsity: float) -> dict[str, torch.Tensor]:
    """Zero the fraction ``sparsity`` of smallest-magnitude weights in every block linear; returns the masks
    (1 = kept) so a fine-tune can keep the zeros."""
    if not 0 < sparsity < 1:
        raise PlaitError(f"sparsity={sparsity} must be between 0 and 1, e.g. 0.5")
    masks = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in BLOCK_LINEARS:
            w = module.weight
            k = int(sparsity * w.numel())
            if k == 0:
                continue
            threshold = w.abs().flatten().kthvalue(k).values
            mask = (w.abs() > threshold).to(w.dtype)
            w.mul_(mask)
            masks[f"{name}.weight"] = mask
    return masks


@torch.no_grad()
def structured_prune(model: Transformer, sparsity: float, multiple_of: int = 8) -> Transformer:
    """A smaller dense model without the least important SwiGLU channels of every layer.

    Channel j of a layer's MLP matters by the product of the norms of its three weights (w1 row, w3 row,
    w2 column): the size of its contribution for inputs of unit norm. Each layer keeps its best
    ``(1 - sparsity) * hidden`` channels, rounded to a multiple of ``multiple_of`` (the same count in every
    layer: the model's shape has one ffn_hidden_dim)."""
    from plait.interop.hf import empty_model

    if not 0 < sparsity < 1:
        raise PlaitError(f"sparsity={sparsity} must be between 0 and 1, e.g. 0.25")
    hidden = model.args.hidden_dim
    keep = max(multiple_of, int(round(hidden * (1 - sparsity) / multiple_of)) * multiple_of)
    keep = min(keep, hidden)
    args = replace(model.args, ffn_hidden_dim=keep)
    small = empty_model(args, next(model.parameters()).device)
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("rope_")}
    for i, block in model.layers.items():
        ff = block.feed_forward
        score = ff.w1.weight.norm(dim=1) * ff.w3.weight.norm(dim=1) * ff.w2.weight.norm(dim=0)  # (hidden,)
        idx = score.topk(keep).indices.sort().values
        prefix = f"layers.{i}.feed_forward"
        state[f"{prefix}.w1.weight"] = ff.w1.weight[idx]
        state[f"{prefix}.w3.weight"] = ff.w3.weight[idx]
        state[f"{prefix}.w2.weight"] = ff.w2.weight[:, idx]
    small.load_state_dict(state, strict=False)
    small.tie_weights()
    return small


# ----------------------------------------------------------------------------------- fine-tune and distill


def train_loop(
    model: Transformer,
    data_dir: Path,
    *,
    steps: int,
    lr: float,
    seq_len: int,
    batch_size: int = 8,
    loss_fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    masks: dict[str, torch.Tensor] | None = None,
    seed: int = 0,
    log: Callable[[int, float], None] | None = None,
) -> list[float]:
    """A short AdamW loop (constant LR after 10% warm-up) on a prepared split: the fine-tune after pruning
    and the distillation loop. ``loss_fn(logits, inputs, targets)`` replaces cross-entropy; ``masks`` are
    re-applied after every update so pruned weights stay zero."""
    from plait.data import TokenDataset, TokenLoader

    device = next(model.parameters()).device
    loader = TokenLoader(
        TokenDataset(data_dir, "train"),
        seq_len=min(seq_len, model.args.max_seq_len),
        global_batch_size=batch_size,
        seed=seed,
        prefetch=0,
        device=device,
    )
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    named = dict(model.named_parameters())
    model.train()
    losses = []
    for step in range(1, steps + 1):
        x, y = next(loader)
        logits = model(x)
        loss = loss_fn(logits, x, y) if loss_fn else F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        if masks:
            with torch.no_grad():
                for name, mask in masks.items():
                    named[name].mul_(mask)
        losses.append(loss.item())
        if log is not None:
            log(step, losses[-1])
    loader.close()
    model.eval()
    return losses


def distillation_loss(teacher: nn.Module, temperature: float, hard_weight: float = 0.0):
    """KL(teacher || student) on softened distributions, times T^2 so gradients keep their scale across
    temperatures (Hinton et al.), averaged over tokens; plus ``hard_weight`` x cross-entropy on the data."""

    def loss_fn(logits: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            t_logits = teacher(inputs).float()
        s = F.log_softmax(logits.float() / temperature, dim=-1).flatten(0, 1)  # (B*T, V)
        t = F.log_softmax(t_logits / temperature, dim=-1).flatten(0, 1)
        kl = F.kl_div(s, t, log_target=True, reduction="batchmean") * temperature**2
        if hard_weight:
            kl = (1 - hard_weight) * kl + hard_weight * F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        return kl

    return loss_fn


def student_from_teacher(teacher: Transformer, args: ModelArgs, seed: int = 0) -> Transformer:
    """A student of shape ``args``: plait's initialisation, except that where the widths match it starts from
    the teacher's embedding, final norm, output and evenly spaced blocks (layer dropping)."""
    from plait.engine.trainable import build_model

    device = next(teacher.parameters()).device
    student = build_model(args, device, seed)
    t = teacher.args
    same_width = (args.dim, args.n_heads, args.n_kv_heads, args.hidden_dim, args.vocab_size) == (
        t.dim,
        t.n_heads,
        t.n_kv_heads,
        t.hidden_dim,
        t.vocab_size,
    )
    if same_width and args.n_layers <= t.n_layers:
        picks = [round(i * (t.n_layers - 1) / max(1, args.n_layers - 1)) for i in range(args.n_layers)]
        state = {k: v for k, v in teacher.state_dict().items() if not k.startswith(("layers.", "rope_"))}
        for new, old in enumerate(picks):
            for k, v in teacher.layers[str(old)].state_dict().items():
                state[f"layers.{new}.{k}"] = v
        student.load_state_dict(state, strict=False)
        student.tie_weights()
    return student
