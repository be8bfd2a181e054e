"""Mixture-of-experts bookkeeping around the training step: the load-balancing loss's scale, routing statistics
in the metrics and auxiliary-loss-free balancing (the experts themselves are model code: plait.model.moe).
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
from torch import nn

from plait.engine.callbacks import Callback, RunState
from plait.model.moe import MoE


def moe_layers(parts: list[nn.Module]) -> list[MoE]:
    """This rank's MoE blocks (of all its pipeline stages), in order."""
    return [m for _, m in named_moe_layers(parts)]


def named_moe_layers(parts: list[nn.Module]) -> list[tuple[str, MoE]]:
    """This rank's MoE blocks with the index of the block each sits in (as in parameter names), in order."""
    out = []
    for part in parts:
        for name, m in part.named_modules():
            if isinstance(m, MoE):
                block = [p for p in name.split(".") if p.isdigit()]
                out.append((block[0] if block else name, m))
    return out


LOAD_FILE = "moe_load.jsonl"
"""Per run: at every logged step, each MoE block's routed tokens per expert over that step (all ranks)."""


def set_aux_scale(parts: list[nn.Module], meshes, pipelined: int, global_batch: int) -> None:
    """Each MoE block's balancing-loss scale for this step: dp x cp x m / S, so that its gradient is that of the
    loss's mean over the S sequences of the global batch (the gradient reduction averages over the dp x cp
    ranks and the pipeline schedule over its m micro-batches; gradient accumulation sums). As TokenLoss."""
    scale = meshes.dims.dp_cp * pipelined / global_batch
    for layer in moe_layers(parts):
        layer.aux_scale = scale


class ExpertBalance(Callback):
    """After each step: the routing counts of every MoE block summed over the ranks that saw different
    tokens, logged as moe/load_imbalance (the busiest expert's load over the mean, worst block) and
    moe/aux_loss (the balancing loss, mean over the batch's sequences, summed over blocks), and per expert
    and block in <run>/moe_load.jsonl (plotted as moe_load.png: plait.engine.plot); with model.moe_bias_rate each
    block's routing bias moves towards balance (DeepSeek-V3's loss-free balancing: + rate for experts below
    the mean load, - rate above). The counts then start again. Routing is dropless: no token is dropped, so
    there is no dropped-token count to log."""

    def after_step(self, run: RunState, step: int, result) -> None:
        cfg = run.cfg
        if not cfg.model.moe_experts or not run.plait_model:
            return
        named, meshes = named_moe_layers(run.t.parts), run.t.meshes  # a pipeline stage may have none: it still joins
        layers = [m for _, m in named]
        experts = cfg.model.moe_experts
        loads = (  # (blocks, experts)
            torch.stack([m.load for m in layers]) if layers else torch.zeros(0, experts, device=run.env.device)
        )
        aux = sum((m.aux_total for m in layers), torch.zeros(())).reshape(1).to(loads.device)
        packed = torch.cat([loads.flatten(), aux]).double()
        if meshes.dims.dp_cp * meshes.dims.moe_tp > 1:  # the ranks that routed different tokens
            dist.all_reduce(packed, group=meshes.tokens.get_group())
        loads = packed[:-1].view_as(loads)
        mean = loads.mean(1, keepdim=True)
        if result.stepped and cfg.model.moe_bias_rate:
            with torch.no_grad():
                for m, load, avg in zip(layers, loads, mean, strict=True):
                    m.expert_bias += cfg.model.moe_bias_rate * torch.sign(avg - load).to(m.expert_bias.dtype)
        worst = (loads / mean.clamp(min=1)).max() if layers else torch.zeros((), dtype=packed.dtype)
        summary = torch.stack([worst.to(packed.device), packed[-1] / cfg.train.global_batch_size])
        if meshes.dims.pp > 1:  # stages hold different blocks: the worst imbalance, the summed loss
            worst, total = summary[:1].clone(), summary[1:].clone()
            dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=meshes.pp.get_group())
            dist.all_reduce(total, group=meshes.pp.get_group())
            summary = torch.cat([worst, total])
        for m in layers:
            m.load.zero_()
            m.aux_total.zero_()
        if run.metrics.should_log(step, cfg.train.steps):
            self._write_loads(run, step, {name: load.tolist() for (name, _), load in zip(named, loads, strict=True)})
            metrics = {"load_imbalance": summary[0].item()}
            if cfg.model.moe_aux_loss:
                metrics["aux_loss"] = summary[1].item()
            run.metrics.log(step, metrics, prefix="moe")

    @staticmethod
    def _write_loads(run: RunState, step: int, loads: dict[str, list[float]]) -> None:
        if run.t.meshes.dims.pp > 1:  # each stage holds its own blocks
            stages: list = [None] * run.t.meshes.dims.pp
            dist.all_gather_object(stages, loads, group=run.t.meshes.pp.get_group())
            loads = {k: v for stage in stages for k, v in stage.items()}
        if run.env.is_main:
            row = {"step": step, "load": {k: [int(x) for x in v] for k, v in sorted(loads.items(), key=_block)}}
            with open(run.cfg.run_dir / LOAD_FILE, "a") as f:
                f.write(json.dumps(row) + "\n")


def _block(item) -> int:
    return int(item[0]) if item[0].isdigit() else -1
