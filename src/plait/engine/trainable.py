"""What one optimizer step touches on this rank: the model (or this rank's pipeline stages), built on meta and
parallelised from outside, its optimizers and LR schedules, the meshes, and the contexts of the step."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import loss_parallel

from plait.config import Config
from plait.core.errors import ConfigError
from plait.core.hardware import uses_bf16
from plait.engine.loss import MeanLoss, TokenLoss
from plait.engine.optim import build_optimizer, build_scheduler
from plait.model import ModelArgs, Transformer
from plait.parallel import Meshes, ParallelDims
from plait.parallel.env import init_single_process
from plait.parallel.parallelize import materialize, materialize_module, parallelize, parallelize_own
from plait.parallel.pipeline import Pipeline, build_pipeline
from plait.parallel.placement import check_placement


def build_model(args: ModelArgs, device: torch.device, seed: int) -> Transformer:
    """A single-process model: allocate on the meta device (no memory, no time), then materialise and
    initialise on `device`."""
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device=device)
    model.init_weights(seed)
    return model


def autocast_context(mixed_precision: str, device: torch.device, fsdp: bool = False):
    """bf16 autocast where train.mixed_precision asks (or 'auto' on a device with native bf16), else nothing.
    Under FSDP its mixed-precision policy casts the parameters instead."""
    if not fsdp and uses_bf16(mixed_precision, device):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@dataclass
class Trainable:
    """Everything one optimizer step touches on this rank: the model (or this rank's pipeline stages),
    optimizers and LR schedules (one per part), the meshes, and the contexts of the step."""

    cfg: Config
    device: torch.device
    parts: list[nn.Module]
    optimizers: list[torch.optim.Optimizer]
    schedulers: list
    meshes: Meshes  # one rank's share of the layout; a lone process is a mesh of size 1
    pipeline: Pipeline | None = None
    loss_fn: TokenLoss | MeanLoss = field(default_factory=TokenLoss)  # also the pipeline schedule's
    extra_state: list = field(default_factory=list)  # more checkpoint Parts a run's features add (engine.diloco)

    @property
    def model(self) -> nn.Module:
        return self.parts[0]

    @property
    def fsdp(self) -> bool:
        return self.meshes.dims.fsdp_enabled

    def autocast(self):
        return autocast_context(self.cfg.train.mixed_precision, self.device, self.fsdp)

    def loss_context(self):
        return loss_parallel() if self.meshes.dims.tp > 1 else contextlib.nullcontext()

    def parameters(self) -> list[nn.Parameter]:
        return [p for part in self.parts for p in part.parameters()]

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The model on a micro-batch: its summed loss through the fused head (given the targets), or its
        output for the loss function."""
        if self.loss_fn.fused:
            return self.model(inputs, targets=targets)
        return self.model(inputs)


def build_trainable(
    cfg: Config,
    device: torch.device,
    meshes: Meshes | None = None,
    *,
    model: Callable[[], nn.Module] | None = None,
    parallelize_fn: Callable | None = None,
    loss: Callable | None = None,
    on_model: Callable[[list[nn.Module]], None] | None = None,
) -> Trainable:
    """Build the model on meta, parallelise it from outside (or split it into pipeline stages), allocate,
    initialise like the single-process model, and attach optimizers. Without `meshes`, this process alone:
    a mesh of size 1 (a process group of one is set up if there is none), through the same path.

    model: your own model's constructor (called on the meta device) instead of plait's Transformer;
    parallelize_fn(model, meshes, cfg, device) then replaces plait's TP/AC/compile/FSDP plan (None: plait's
    plan for what it can apply to any model); loss(output, targets): the micro-batch mean, instead of the
    token-normalised cross-entropy; on_model(parts): called before the optimizers are made (fine-tuning)."""
    if meshes is None:
        init_single_process(device, cfg.parallel.timeout_s)
        meshes = Meshes.build(ParallelDims.from_config(cfg.parallel, dist.get_world_size(), cfg.model), device.type)
    loss_fn = TokenLoss(fused=cfg.train.fused_head and model is None) if loss is None else MeanLoss(loss)
    if model is not None:
        if meshes.dims.pp > 1:
            raise ConfigError(
                f"parallel.pp_degree={meshes.dims.pp}: plait splits only its own Transformer into pipeline "
                "stages; train your model with parallel.pp_degree=1"
            )
        with torch.device("meta"):
            user_model = model()
        if parallelize_fn is not None:
            parallelize_fn(user_model, meshes, cfg, device)
        else:
            parallelize_own(user_model, meshes, cfg, device)
        materialize_module(user_model, device, seed=cfg.run.seed, cpu_offload=cfg.parallel.cpu_offload)
        parts, pipeline = [user_model], None
    elif meshes.dims.pp > 1:
        pipeline = build_pipeline(cfg.model, meshes, cfg, device, loss_fn)
        parts = pipeline.parts
    else:
        with torch.device("meta"):
            plait_model = Transformer(cfg.model)
        parallelize(plait_model, meshes, cfg, device)
        materialize(plait_model, device, seed=cfg.run.seed, cpu_offload=cfg.parallel.cpu_offload)
        parts, pipeline = [plait_model], None
    if on_model is not None:
        on_model(parts)  # e.g. finetune.init_from weights; LoRA adapters on a frozen base
    for part in parts:  # a tensor left on another device fails here, naming it, not at the first forward
        check_placement(part, device, cpu_offload=cfg.parallel.cpu_offload)
    optimizers: list[torch.optim.Optimizer] = [build_optimizer(part, cfg.optim, device) for part in parts]
    schedulers = [build_scheduler(opt, cfg.optim, cfg.train.steps) for opt in optimizers]
    return Trainable(cfg, device, parts, optimizers, schedulers, meshes, pipeline, loss_fn)
