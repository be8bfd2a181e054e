"""`plait train --layout auto`: let the planner choose the parallel layout for the processes at hand."""

from __future__ import annotations

import dataclasses

from plait.config import Config, ParallelConfig


def cluster_for(world_size: int):
    """The machine this job runs on as a one-node cluster of world_size devices: the data-sheet preset
    when the GPU is a known one, else a quick measurement of this machine."""
    import torch

    from plait.planner.cluster import PRESETS, get_cluster

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        for key in ("H200", "H100", "A100"):
            if key in name and key.lower() in PRESETS:
                return get_cluster(key.lower(), nodes=1, devices_per_node=world_size)
    return get_cluster("local", nodes=1, devices_per_node=world_size)


def auto_layout_overrides(cfg: Config, world_size: int) -> tuple[list[str], list[str]]:
    """The planner's best layout for this config on world_size local devices, as `section.key=value`
    overrides (so every worker gets the same choice), and the planner's explanation lines."""
    from plait.core.hardware import resolve_device, uses_bf16
    from plait.planner.preflight import workload_of
    from plait.planner.search import explain, layout_config, plan

    bf16 = uses_bf16(cfg.train.mixed_precision, resolve_device(cfg.run.device))
    work = workload_of(cfg, bf16)
    result = plan(work, cluster_for(world_size))
    chosen = layout_config(result, cfg)
    overrides = [
        f"parallel.{f.name}={getattr(chosen.parallel, f.name)}"
        for f in dataclasses.fields(ParallelConfig)
        if f.name != "timeout_s"
    ]
    overrides.append(f"train.micro_batch_size={chosen.train.micro_batch_size}")
    return overrides, explain(result, near=2)
