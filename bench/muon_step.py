"""The distributed Newton-Schulz's share of a step under FSDP, and the bytes it moves: Muon's optimizer step
against AdamW's and against the forward and backward, and plait's exchange (each matrix to one rank of its
shard group) against the simple design (every rank gathers every matrix and orthogonalises it).

    torchrun --nproc-per-node 4 bench/muon_step.py [--presets tiny,small] [--repeat 5]
        [--out bench/results/muon_step_cpu.json]

Per preset, on FSDP over all ranks (gloo on the CPU, NCCL on GPUs): the median seconds of the forward and
backward of one batch (train.global_batch_size and data.seq_len as the default job), of AdamW's step, of Muon's
step with plait's exchange and with the simple design; the Muon parameters' bytes, and the bytes each design
moves per step (summed over ranks: plait's 2 (N - 1) / N per matrix byte on NCCL's all-to-all, the simple
design's (N - 1)). On gloo DTensor swaps the all-to-all for an all-gather and a chunk, so on the CPU plait's
exchange moves 2 (N - 1) per matrix byte: both are printed. Rank 0 prints a table and writes --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist


def median_seconds(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat + 1):
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])  # the first warms up


def simple_design(monkey: list) -> None:
    """Muon's orthogonalisation as every rank gathering every matrix (the design plait's is measured against)."""
    from plait.core import torch_private
    from plait.engine import muon as muon_module

    def everywhere(params, local_of, ns):
        from torch.distributed.tensor import DTensor

        for i, p in enumerate(params):
            local = local_of(i)
            if not isinstance(p, DTensor):
                yield i, ns(local)
                continue
            whole = DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
            full = ns(whole.full_tensor())
            shape, offset = torch_private.local_box(p)
            yield i, full[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]

    monkey.append((muon_module, muon_module.orthogonalise_all))
    muon_module.orthogonalise_all = everywhere


def measure(preset: str, repeat: int) -> dict:
    from plait.config import load_config
    from plait.engine.optim import build_optimizer
    from plait.engine.trainable import build_trainable
    from plait.parallel import ParallelDims
    from plait.parallel.dims import Meshes
    from plait.parallel.orthogonal import split_mesh_dims

    world = dist.get_world_size()
    cfg = load_config(None, [f"model.preset={preset}", f"parallel.dp_shard_degree={world}", "run.device=cpu"])
    device = torch.device("cpu")
    meshes = Meshes.build(ParallelDims.from_config(cfg.parallel, world, cfg.model), "cpu")
    t = build_trainable(cfg, device, meshes)
    model = t.parts[0]
    batch = cfg.train.global_batch_size // world
    tokens = torch.randint(
        0, cfg.model.vocab_size, (batch, cfg.data.seq_len + 1), generator=torch.Generator().manual_seed(0)
    )

    def forward_backward():
        model.zero_grad(set_to_none=False)
        t.forward(tokens[:, :-1], tokens[:, 1:]).backward()

    fwd_bwd = median_seconds(forward_backward, repeat)
    adamw = build_optimizer(model, cfg.optim, device)
    muon_cfg = load_config(None, [f"model.preset={preset}", "optim.name=muon"]).optim
    muon = build_optimizer(model, muon_cfg, device)
    results = {
        "preset": preset,
        "world": world,
        "fwd_bwd_s": fwd_bwd,
        "adamw_step_s": median_seconds(adamw.step, repeat),
    }
    results["muon_step_s"] = median_seconds(muon.step, repeat)
    restore: list = []
    simple_design(restore)
    try:
        results["muon_simple_step_s"] = median_seconds(muon.step, repeat)
    finally:
        for module, fn in restore:
            module.orthogonalise_all = fn
    matrices = [p for g in muon.param_groups if g["muon"] for p in g["params"]]
    split = [p for p in matrices if split_mesh_dims(p)]
    size = sum(p.numel() * p.element_size() for p in split)
    results.update(
        muon_matrices=len(matrices),
        muon_bytes=size,
        bytes_all_to_all=2 * (world - 1) / world * size,
        bytes_gloo_fallback=2 * (world - 1) * size,
        bytes_simple=(world - 1) * size,
    )
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="tiny,small")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default="bench/results/muon_step_cpu.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rows = [measure(p, args.repeat) for p in args.presets.split(",")]
    if dist.get_rank() == 0:
        print(f"\nFSDP {rows[0]['world']} on gloo (CPU), median of {args.repeat} steps, seconds")
        print(f"{'preset':<7} {'fwd+bwd':>8} {'AdamW':>8} {'Muon':>8} {'Muon simple':>12} {'Muon/AdamW':>11} "
              f"{'NS share of step':>17} {'MiB a2a/gloo/simple':>22}")  # fmt: skip
        for r in rows:
            share = (r["muon_step_s"] - r["adamw_step_s"]) / (r["fwd_bwd_s"] + r["muon_step_s"])
            r["ns_share_of_step"] = share
            mib = "/".join(f"{r[k] / 2**20:.1f}" for k in ("bytes_all_to_all", "bytes_gloo_fallback", "bytes_simple"))
            print(f"{r['preset']:<7} {r['fwd_bwd_s']:>8.3f} {r['adamw_step_s']:>8.3f} {r['muon_step_s']:>8.3f} "
                  f"{r['muon_simple_step_s']:>12.3f} {r['muon_step_s'] / r['adamw_step_s']:>11.2f} {share:>17.1%} "
                  f"{mib:>22}")  # fmt: skip
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"rows": rows, "date": time.strftime("%Y-%m-%d")}, indent=1))
        print(f"written to {out}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
