"""Pipeline parallelism with torch.distributed.pipelining: stage split, stage modules, schedules.

A stage is the plain Transformer with the layers it does not own deleted (layer names keep their global
index) and, except on the first / last stage, no embedding / no final norm and output. Each stage is then
parallelised (TP, AC, FSDP) like a whole model. With ``pp_virtual_stages = v`` a rank holds v stages,
rank r owning stages r, r + pp, r + 2 pp, ... (the "loop" placement of interleaved schedules).

Communication: activations (B_micro, T, dim) go forward and their gradients backward between neighbouring
stages over the ``pp`` axis with point-to-point send/recv, one message per micro-batch and direction.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait.config import Config
from plait.core.torch_private import (
    bounded_receive_stage,
    is_fake_group,
    quiet_shape_inference,
    reducing_pipeline_stage,
    unanimous_static_stage,
)
from plait.model.args import split_layers
from plait.model.llama import ModelArgs, Transformer
from plait.model.moe import MoE
from plait.parallel.dims import Meshes
from plait.parallel.materialize import materialize
from plait.parallel.parallelize import parallelize
from plait.parallel.rules import num_micro_batches


def schedule_class(name: str):
    """torch's schedule class for `parallel.pp_schedule`. torch.distributed.pipelining is imported here, when a
    pipeline is built: it imports torch._dynamo, 4 s of CPU at every process start otherwise."""
    from torch.distributed.pipelining import schedules

    return {
        "gpipe": schedules.ScheduleGPipe,
        "1f1b": schedules.Schedule1F1B,
        "interleaved_1f1b": schedules.ScheduleInterleaved1F1B,
        "zero_bubble": schedules.ScheduleInterleavedZeroBubble,
    }[name]


def stage_module(args: ModelArgs, layer_ids: list[int], first: bool, last: bool) -> Transformer:
    """The full model on meta with everything this stage does not run removed."""
    with torch.device("meta"):
        model = Transformer(args)
    keep = {str(i) for i in layer_ids}
    for name in list(model.layers):
        if name not in keep:
            del model.layers[name]
    if not first:
        model.tok_embeddings = None
    if not last:
        model.norm = None
        model.output = None
    return model


def stage_examples(cfg: Config, meshes: Meshes, micro_batch: int, first: bool, last: bool) -> dict:
    """A stage's input and output as torch's stage infers them (meta tensors: shape, dtype, requires_grad):
    the first stage takes token ids (micro-batch, T), every other the hidden states (micro-batch, T, dim),
    T the sequence over cp and, under sequence parallelism, over tp; in bf16 where FSDP computes in bf16,
    else fp32 (autocast keeps the residual stream in fp32); the last stage gives the fused head's summed loss.
    tests/e2e/test_fit.py holds this against what torch infers on a real group."""
    from plait.core.errors import ConfigError
    from plait.core.hardware import uses_bf16

    if last and not cfg.train.fused_head:
        raise ConfigError(
            "train.fused_head=false with a pipeline on a fake process group (plait fit): the last stage's logits "
            "are not described statically; keep train.fused_head=true"
        )
    dims = meshes.dims
    seq = cfg.data.seq_len // dims.cp
    bf16 = dims.fsdp_enabled and uses_bf16(cfg.train.mixed_precision, torch.device(meshes.world.device_type))
    hidden = torch.empty(
        micro_batch, seq // dims.tp, cfg.model.dim, dtype=torch.bfloat16 if bf16 else torch.float32, device="meta"
    ).requires_grad_()
    tokens = torch.empty(micro_batch, seq, dtype=torch.int64, device="meta")
    loss = torch.empty((), dtype=torch.float32, device="meta").requires_grad_()
    return {"input_args": (tokens if first else hidden,), "output_args": (loss if last else hidden,)}


@contextlib.contextmanager
def not_counting(module: nn.Module):
    """MoE blocks of a stage count no routing while torch's stage infers its shapes with an extra pass."""
    moe = [m for m in module.modules() if isinstance(m, MoE)]
    for m in moe:
        m.counting = False
    try:
        yield
    finally:
        for m in moe:
            m.counting = True


@dataclass
class Pipeline:
    schedule: Any  # a torch.distributed.pipelining schedule (single- or multi-stage)
    parts: list[nn.Module]
    has_first: bool
    has_last: bool
    num_microbatches: int
    fused: bool = False  # the last stage's output is its micro-batch's summed loss (the fused head's)
    documents: bool = False  # data.document_mask: every stage is given its micro-batch's token ids


def build_pipeline(args: ModelArgs, meshes: Meshes, cfg: Config, device: torch.device, loss_fn) -> Pipeline:
    """This rank's stages, parallelised and initialised, wrapped in the configured schedule.

    loss_fn(logits, targets) gives one micro-batch's loss; the schedule divides the summed gradients by the
    number of micro-batches (scale_grads), which plait's TokenLoss undoes in its scale (so the step's gradient
    is that of the mean over the batch's scored tokens). With parallel.fsdp_reduce_every_micro_batch each
    micro-batch's gradients are reduce-scattered after its backward and accumulated sharded.
    """
    pp, v = meshes.dims.pp, cfg.parallel.pp_virtual_stages
    num_stages = pp * v
    pp_rank = meshes.pp.get_local_rank()
    layout = split_layers(args, num_stages, cfg.parallel.pp_split, cfg.data.seq_len)
    stages: list = []
    parts: list[nn.Module] = []
    reduce_each = cfg.parallel.fsdp_reduce_every_micro_batch and meshes.dims.fsdp_enabled
    from torch.distributed.pipelining import PipelineStage

    base = bounded_receive_stage(reducing_pipeline_stage() if reduce_each else PipelineStage)
    stage_class = quiet_shape_inference(base, not_counting)
    local_batch = cfg.train.global_batch_size // meshes.dims.dp
    micro = num_micro_batches(cfg.train.micro_batch_size, local_batch, num_stages)
    # A fake process group (plait fit) cannot carry torch's metadata exchange: the stages get theirs statically.
    fake = is_fake_group(meshes.pp.get_group())
    if fake:
        stage_class = unanimous_static_stage(stage_class)
    for stage_id in range(pp_rank, num_stages, pp):
        first, last = stage_id == 0, stage_id == num_stages - 1
        part = stage_module(args, layout[stage_id], first, last)
        parallelize(part, meshes, cfg, device)
        materialize(part, device, seed=cfg.run.seed, cpu_offload=cfg.parallel.cpu_offload)
        parts.append(part)
        examples = stage_examples(cfg, meshes, local_batch // micro, first, last) if fake else {}
        stages.append(stage_class(part, stage_id, num_stages, device, group=meshes.pp.get_group(), **examples))
    cls = schedule_class(cfg.parallel.pp_schedule)
    if cfg.parallel.pp_schedule in ("gpipe", "1f1b"):
        schedule = cls(stages[0], n_microbatches=micro, loss_fn=loss_fn)
    else:
        schedule = cls(stages, n_microbatches=micro, loss_fn=loss_fn)
    owned = list(range(pp_rank, num_stages, pp))
    fused = loss_fn.fused
    return Pipeline(schedule, parts, 0 in owned, num_stages - 1 in owned, micro, fused)


@functools.cache
def _keeps_outputs_unless_told() -> bool:
    """torch >= 2.10: step(return_outputs=False) stops the last stage keeping each micro-batch's output (the
    logits: micro_batch x seq x vocab) for a merged return value plait never reads."""
    return "return_outputs" in inspect.signature(schedule_class("gpipe").step).parameters


def step_kwargs(pipe: Pipeline, targets: torch.Tensor, losses: list | None, tokens: torch.Tensor) -> dict:
    """The keyword arguments of this rank's schedule.step / eval: the targets and the list that collects the
    micro-batches' losses where the rank holds the last stage (whose model also takes the targets when its
    head is fused: it returns the loss), and no merged outputs kept. Under document masking every stage also
    takes its micro-batch's token ids (`documents`): where each document starts, for stages that receive
    hidden states."""
    kwargs: dict[str, Any] = {"target": targets, "losses": losses} if pipe.has_last else {}
    if pipe.documents:
        kwargs["documents"] = tokens
    if pipe.fused and pipe.has_last:
        kwargs["targets"] = targets
    if _keeps_outputs_unless_told():  # else the last stage holds every micro-batch's output until the step ends
        kwargs["return_outputs"] = False
    return kwargs


def pipeline_forward_backward(pipe: Pipeline, inputs: torch.Tensor, targets: torch.Tensor, pp_group):
    """Run one step's micro-batches through the schedule; returns the batch-mean loss on every pp rank
    (the last stage computes it; a sum-all-reduce over the pp axis hands it to the others)."""
    losses: list[torch.Tensor] | None = [] if pipe.has_last else None
    kwargs = step_kwargs(pipe, targets, losses, inputs)
    if pipe.has_first:
        pipe.schedule.step(inputs, **kwargs)
    else:
        pipe.schedule.step(**kwargs)
    if losses is not None:  # this rank has the last stage
        loss = torch.stack([x.detach().float() for x in losses]).mean()
    else:
        loss = torch.zeros((), device=inputs.device)
    if isinstance(loss, torch.distributed.tensor.DTensor):
        loss = loss.full_tensor()
    dist.all_reduce(loss, group=pp_group)
    return loss


def bubble_fraction(pp: int, micro: int, virtual: int = 1) -> float:
    """Analytic idle fraction of a stage: (p - 1) / (v m + p - 1) — GPipe and 1F1B with v = 1, interleaved
    1F1B with v virtual stages; zero-bubble fills most of it (this is its upper bound)."""
    return (pp - 1) / (virtual * micro + pp - 1)
