"""What torch.compile does with tensor parallelism and with mixture-of-experts blocks, at real size on a GPU.

plait allows compile.enabled=true with parallel.tp_degree > 1 only on torch 2.11 (on 2.12 and 2.13 TP alone
fails in backward, and FSDP2 + TP trains on wrong gradients on 2.13), and compiles MoE blocks where their experts
run as grouped bf16 matmuls. This probe builds the job through the runtime's own path with compilation
switched on behind the config's back (`parallelize` compiles each block as a compiled run would) and reports
what happens:

    --case tp       one rank of tp 8 (a fake process group of 8, llama3-8b's block with 2 blocks): does the
                    compiled step run, and how long a step takes against eager (values are not meaningful on
                    a fake group, so parity is for a real group: tests/parallel/test_compile.py on 8 GPUs)
    --case fsdp-tp  the same with FSDP 2 x TP 8 (a fake group of 16)
    --case moe      one process (a real group of 1), qwen3-30b-a3b's block shape with 2 blocks: the compiled
                    and the eager step from the same weights and batch: losses side by side, recompilations
                    after the first step (each step's tokens per expert differ), step times

    python bench/compile_probe.py --case moe --json out.json      # on a GPU
    python bench/compile_probe.py --case tp --dry-run              # any machine: the same at a toy size, CPU

Each case prints one line, `ok` or the first line of the failure, and writes its numbers to --json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

CASES = {  # name: (world size, settings at real size, settings of the dry run)
    "tp": (
        8,
        ["model.preset=llama3-8b", "model.n_layers=2", "parallel.tp_degree=8", "data.seq_len=2048"],
        ["model.preset=debug", "parallel.tp_degree=2", "data.seq_len=64"],
    ),
    "fsdp-tp": (
        16,
        ["model.preset=llama3-8b", "model.n_layers=2", "parallel.tp_degree=8", "parallel.dp_shard_degree=2"]
        + ["data.seq_len=2048"],
        ["model.preset=debug", "parallel.tp_degree=2", "parallel.dp_shard_degree=2", "data.seq_len=64"],
    ),
    "moe": (
        1,
        ["model.preset=qwen3-30b-a3b", "model.n_layers=2", "data.seq_len=2048"],
        ["model.preset=moe-debug", "data.seq_len=64"],
    ),
}
STEPS = 4


def run_case(case: str, dry_run: bool) -> dict:
    import torch

    from plait.config import load_config
    from plait.core.torch_private import compilation_metrics, init_fake_process_group
    from plait.engine.trainable import build_trainable
    from plait.engine.trainer import train_step
    from plait.parallel import Meshes, ParallelDims

    world, real, toy = CASES[case]
    world = world if not dry_run else (4 if case == "fsdp-tp" else 2 if case == "tp" else 1)
    device = torch.device("cpu" if dry_run else "cuda")
    base = [*(toy if dry_run else real), f"train.global_batch_size={max(1, world // 8) if not dry_run else 2}"]
    moe_on_cpu = dry_run and case == "moe"  # compiled experts are grouped bf16 matmuls: switched on for the CPU
    base += [f"run.device={device.type}", "train.mixed_precision=" + ("fp32" if dry_run and not moe_on_cpu else "bf16")]
    if moe_on_cpu:
        from plait.core import torch_private

        torch_private.GROUPED_MM_ON_CPU = True
    init_fake_process_group(world, 0)  # a group of 1 is one process: the compiled step has nothing to fake there
    cfg = load_config(None, base)  # validated with compile off; switched on below, as the refusal would not
    dims = ParallelDims.from_config(cfg.parallel, world, cfg.model)
    meshes = Meshes.build(dims, device.type)
    local = cfg.train.global_batch_size // dims.dp
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.model.vocab_size, (local, cfg.data.seq_len + 1), generator=gen).to(device)
    x, y = tokens[:, :-1], tokens[:, 1:]
    out: dict = {"case": case, "world_size": world, "device": str(device), "settings": base}
    for compiled in (False, True):
        side = "compiled" if compiled else "eager"
        c = dataclasses.replace(cfg, compile=dataclasses.replace(cfg.compile, enabled=compiled))
        try:
            t = build_trainable(c, device, meshes)
            frames_before = len(compilation_metrics()) if compiled else 0
            losses, times = [], []
            for step in range(STEPS):
                if device.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                result = train_step(t, x, y)
                losses.append(float(result.loss))
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
                if step == 0 and compiled:
                    frames_after_first = len(compilation_metrics())
            out[side] = {
                "ok": True,
                "losses": losses,
                "step_s": statistics.median(times[1:]),
                "first_step_s": times[0],
            }
            if compiled:
                out[side]["compilations_first_step"] = frames_after_first - frames_before
                out[side]["recompilations_after"] = len(compilation_metrics()) - frames_after_first
            del t
        except Exception as e:  # noqa: BLE001 - the point is to see what torch does
            out[side] = {"ok": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:400]}"}
            out[side]["where"] = traceback.format_exc().splitlines()[-3:]
    if world == 1 and out["eager"].get("ok") and out["compiled"].get("ok"):
        pairs = zip(out["eager"]["losses"], out["compiled"]["losses"], strict=True)
        out["max_loss_difference"] = max(abs(a - b) for a, b in pairs)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", choices=list(CASES), required=True)
    p.add_argument("--dry-run", action="store_true", help="a toy size on the CPU: the probe's plumbing")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args()
    out = run_case(a.case, a.dry_run)
    compiled = out["compiled"]
    line = "ok" if compiled.get("ok") else f"fails: {compiled['error']}"
    if compiled.get("ok"):
        line += f", step {compiled['step_s']:.3f} s compiled vs {out['eager'].get('step_s', float('nan')):.3f} s eager"
        line += f", {compiled['recompilations_after']} recompilation(s) after the first step"
        if "max_loss_difference" in out:
            line += f", losses differ by at most {out['max_loss_difference']:.2e}"
    print(f"compile probe {a.case} ({out['device']}, world {out['world_size']}): {line}")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
