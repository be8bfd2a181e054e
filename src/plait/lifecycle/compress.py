"""Compression: weight-only quantization (plait.lifecycle.quantize), pruning (with a fine-tune after) and
knowledge distillation.

Each operation measures the model before and after on the same footing: size of the weights, forward
throughput (tokens/s on a fixed batch) and perplexity on held-out data, and reports the deltas.

- ``prune``: 'magnitude' zeroes the smallest weights of every block linear (unstructured, per layer);
  'structured' removes the least important SwiGLU channels (the same number in every layer), which gives a
  smaller dense model. Either can be fine-tuned for a few steps afterwards (magnitude pruning keeps its zeros).
- ``distill``: train a smaller plait student on a plait teacher's logits: KL(teacher || student) at a
  temperature T, times T^2, optionally mixed with the usual next-token loss.

The fine-tune after pruning and the distillation run on plait's trainer (plait.Trainer with the callbacks
below: StartFrom, KeepZeros, Distillation), so they log, checkpoint, resume and take a layout like any run.
Pruned and distilled models are ordinary plait runs (a checkpoint + config.toml: train, generate,
``plait ckpt export`` as usual) and can be written as Hugging Face Llama directories at once (``hf_out``).
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from plait.config import Config, validate
from plait.core.errors import ConfigError, PlaitError
from plait.core.torch_private import local_box
from plait.engine.callbacks import Callback, RunState
from plait.engine.loss import IGNORE_INDEX
from plait.lifecycle.quantize import (  # quantization's names, importable from here as before
    BLOCK_LINEARS,
    QUANT_FORMAT,
    QuantLinear,
    check_torchao,
    load_quantized,
    quantize_model,
    save_quantized,
    save_torchao,
    torchao_config,
    torchao_quantize,
)
from plait.model.llama import ModelArgs, Transformer, canonical_name
from plait.model.mlp import FeedForward
from plait.parallel.parallelize import load_local_shard

__all__ = [
    "BLOCK_LINEARS",
    "QUANT_FORMAT",
    "Distillation",
    "KeepZeros",
    "Losses",
    "QuantLinear",
    "StartFrom",
    "check_torchao",
    "compare",
    "load_quantized",
    "magnitude_prune",
    "measure",
    "quantize_model",
    "save_quantized",
    "save_torchao",
    "structured_prune",
    "student_from_teacher",
    "throughput",
    "torchao_config",
    "torchao_quantize",
    "training_config",
    "weights_bytes",
]


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
    args = cast(ModelArgs, model.args)
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
        "nonzero_m": (sum(_nonzero(p) for p in model.parameters()) + logical) / 1e6,
        "tokens_per_s": throughput(model, seq_len),
    }
    if data_dir is not None:
        out["perplexity"] = perplexity(model, data_dir, seq_len=seq_len, max_batches=batches)["perplexity"]
    return out


def _nonzero(p: torch.Tensor) -> int:
    """Non-zero values of a parameter; a quantized one (torchao's tensor subclasses) counts as dense."""
    return int((p != 0).sum()) if type(p.detach()) is torch.Tensor else p.numel()


def compare(before: dict[str, float], after: dict[str, float]) -> dict[str, dict[str, float]]:
    rows = {}
    for key in before:
        if key in after:
            b, a = before[key], after[key]
            rows[key] = {"before": b, "after": a, "delta": a - b, "ratio": a / b if b else math.nan}
    return rows


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
        ff = cast(FeedForward, block.feed_forward)  # structured pruning is of dense SwiGLU layers
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


def training_config(
    args: ModelArgs, out: Path, data_dir: Path, *, steps: int, lr: float, seq_len: int, batch_size: int, seed: int = 0
) -> Config:
    """The settings of a compression's training (the fine-tune after pruning, a distillation) as a plait run
    into the directory `out`: the compressed model's shape on `data_dir`, one process, AdamW at a constant `lr`
    after a warm-up of a tenth of the steps (none below 10), no weight decay, the gradient norm clipped at 1, a
    checkpoint at the end. The weights come from memory (StartFrom), so no finetune.init_from; the compressed
    model is recorded in the lineage registry by the command, not the run."""
    cfg = Config()
    cfg.model = args
    cfg.run.name, cfg.run.out_dir, cfg.run.seed = out.name, str(out.parent), seed
    cfg.data.source, cfg.data.seq_len = str(data_dir), min(seq_len, args.max_seq_len)
    cfg.train.steps, cfg.train.global_batch_size, cfg.train.grad_clip = steps, batch_size, 1.0
    cfg.optim.lr, cfg.optim.schedule, cfg.optim.weight_decay = lr, "constant", 0.0
    cfg.optim.warmup_steps = steps // 10
    cfg.eval.every_steps, cfg.checkpoint.every_steps, cfg.sample.prompt = 0, 0, ""
    cfg.log.every_steps, cfg.log.tensorboard, cfg.lineage.enabled = min(10, steps), False, False
    return validate(cfg)


class StartFrom(Callback):
    """Start the run from an in-memory model's weights (a pruned model, a student made from its teacher):
    copied into the built parts by parameter name, each rank only its shard's box, any layout."""

    def __init__(self, model: nn.Module):
        self.state = {canonical_name(k): v.detach() for k, v in model.state_dict().items()}

    def on_model(self, run: RunState, parts: list[nn.Module]) -> None:
        for part in parts:
            for name, param in part.named_parameters():
                value, device = self.state[canonical_name(name)], param.device

                def read(
                    offset: tuple[int, ...], shape: tuple[int, ...], v: torch.Tensor = value, d: torch.device = device
                ) -> torch.Tensor:
                    return v[_box(offset, shape)].to(d)

                with torch.no_grad():
                    load_local_shard(param, read)


def _box(offset: tuple[int, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


class KeepZeros(Callback):
    """Magnitude pruning's zeros kept through a fine-tune: after every update the pruned weights are zeroed
    again (each rank its shard of each mask, 1 = kept)."""

    def __init__(self, masks: dict[str, torch.Tensor]):
        self.masks = masks
        self.local: list[tuple[torch.Tensor, torch.Tensor]] = []

    def on_model(self, run: RunState, parts: list[nn.Module]) -> None:
        for part in parts:
            for name, param in part.named_parameters():
                mask = self.masks.get(canonical_name(name))
                if mask is None:
                    continue
                if isinstance(param, DTensor):
                    shape, offset = local_box(param)
                    local, mask = param.to_local(), mask[_box(tuple(offset), tuple(shape))]
                else:
                    local = param
                self.local.append((local, mask.to(local.device, local.dtype)))
        if len(self.local) != len(self.masks):
            raise PlaitError(f"{len(self.masks) - len(self.local)} pruning masks name no parameter of the model")

    def after_step(self, run: RunState, step: int, result: Any) -> None:
        with torch.no_grad():
            for param, mask in self.local:
                param.mul_(mask)


class Losses(Callback):
    """The training loss of every step, read on the host once the run ended (no sync per step)."""

    def __init__(self):
        self.kept: list[torch.Tensor] = []
        self.values: list[float] = []

    def after_step(self, run: RunState, step: int, result: Any) -> None:
        self.kept.append(result.loss.detach())

    def close(self, run: RunState) -> None:
        self.values = torch.stack(self.kept).tolist() if self.kept else []


class Distillation(Callback):
    """Knowledge distillation on plait's trainer: `loss` (the Trainer's loss=) is KL(teacher || student) on
    distributions softened by `temperature`, times T^2 so gradients keep their scale across temperatures
    (Hinton et al.), averaged over tokens; plus `hard_weight` x the next-token cross-entropy. The teacher sees
    the student's inputs: a forward pre-hook on the student's model keeps each micro-batch's tokens for the
    loss that follows it. One pipeline stage only (the loss of a pipeline's last stage never sees the tokens)."""

    def __init__(self, teacher: nn.Module, temperature: float, hard_weight: float = 0.0):
        if temperature <= 0 or not 0 <= hard_weight <= 1:
            raise PlaitError(
                f"distillation needs temperature > 0 and 0 <= hard_weight <= 1 (got {temperature}, {hard_weight})"
            )
        self.teacher, self.temperature, self.hard_weight = teacher.eval(), temperature, hard_weight
        self.tokens: torch.Tensor | None = None

    def on_model(self, run: RunState, parts: list[nn.Module]) -> None:
        if len(parts) != 1:
            raise ConfigError(f"distillation runs on one pipeline stage: set parallel.pp_degree=1 (got {len(parts)})")
        device = next(parts[0].parameters()).device
        self.teacher.to(device)
        parts[0].register_forward_pre_hook(self._keep_tokens)

    def _keep_tokens(self, module: nn.Module, args: tuple) -> None:
        self.tokens = args[0]

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.tokens is None or self.tokens.shape != targets.shape:
            raise RuntimeError("the distillation loss ran without its micro-batch's tokens (on_model not called?)")
        with torch.no_grad():
            teacher = self.teacher(self.tokens).float()
        t = self.temperature
        s = F.log_softmax(logits.float() / t, dim=-1).flatten(0, 1)  # (B*T, V)
        kl = F.kl_div(s, F.log_softmax(teacher / t, dim=-1).flatten(0, 1), log_target=True, reduction="batchmean")
        kl = kl * t**2
        if self.hard_weight:
            hard = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX)
            kl = (1 - self.hard_weight) * kl + self.hard_weight * hard
        return kl


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
