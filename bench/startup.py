"""Start-up at real size: build a model under FSDP on a fake process group of the real world size, in one
process on this CPU, and report what rank 0 pays: time to build on meta, to shard, to allocate and initialise
its shards, and its peak RSS against the bytes of its shards.

Each rank draws only the rows of its own shards (`Transformer.init_weights` draws per block of rows;
`parallel.materialize.init_local_shard` asks for the shard's rows), so neither time nor memory grows with the
full model. The baseline, in the same run on a smaller model, is the earlier way: every full parameter drawn,
then the shard cut out (what every rank paid before, for the whole model).

    python bench/startup.py                      # llama3-70b on 64 ranks, llama3-405b on 512, baseline on llama3-1b
    python bench/startup.py --cases llama3-70b:64 --json bench/results/startup.json

Each case runs in a fresh process (its own peak RSS). Criterion (issue "real size"): 70B on 64 ranks in <= 60 s,
peak RSS <= 1.5 x the rank's shards + 1 GiB.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

GIB = 2**30


def one_case(preset: str, world: int, method: str) -> dict:
    import resource

    import torch

    from plait.config import load_config
    from plait.core.torch_private import init_fake_process_group
    from plait.model import Transformer
    from plait.parallel import Meshes, ParallelDims
    from plait.parallel.materialize import init_local_shard
    from plait.parallel.parallelize import parallelize

    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    init_fake_process_group(world)
    cfg = load_config(None, [f"model.preset={preset}", "run.device=cpu", f"train.global_batch_size={world}"])
    dims = ParallelDims.from_config(cfg.parallel, world)
    meshes = Meshes.build(dims, "cpu")
    with torch.device("meta"):
        model = Transformer(cfg.model)
    t_meta = time.perf_counter()
    parallelize(model, meshes, cfg, torch.device("cpu"))
    t_shard = time.perf_counter()
    model.to_empty(device=torch.device("cpu"))
    t_alloc = time.perf_counter()
    if method == "shards":
        model.init_weights(cfg.run.seed, assign=init_local_shard)
    else:  # the baseline: every full parameter drawn, then this rank's shard cut out

        def full_then_cut(param, rows):
            full = rows(0, param.shape[0])
            init_local_shard(param, lambda a, b: full[a:b])

        model.init_weights(cfg.run.seed, assign=full_then_cut)
    t_init = time.perf_counter()
    shard_bytes = sum(p.to_local().numel() * p.to_local().element_size() for p in model.parameters())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "preset": preset,
        "world": world,
        "method": method,
        "params": cfg.model.num_params(),
        "meta_s": t_meta - t0,
        "shard_s": t_shard - t_meta,
        "alloc_s": t_alloc - t_shard,
        "init_s": t_init - t_alloc,
        "total_s": t_init - t0,
        "shard_gib": shard_bytes / GIB,
        "peak_rss_gib": peak / GIB,
        "rss_before_gib": rss0 / GIB,
        "rss_bound_gib": (1.5 * shard_bytes + GIB) / GIB,
    }


def run_case(preset: str, world: int, method: str) -> dict:
    code = (
        f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import startup; "
        f"print(json.dumps(startup.one_case({preset!r}, {world}, {method!r})))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{preset} on {world} ranks failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", nargs="*", default=["llama3-70b:64", "llama3-405b:512"], help="PRESET:WORLD ...")
    ap.add_argument("--baseline", default="llama3-1b:64", help="PRESET:WORLD run both ways ('' to skip)")
    ap.add_argument("--json", default="bench/results/startup.json")
    a = ap.parse_args()
    rows = []
    if a.baseline:
        preset, world = a.baseline.split(":")
        for method in ("full_then_cut", "shards"):
            rows.append(run_case(preset, int(world), method))
            print(_line(rows[-1]), flush=True)
    for case in a.cases:
        preset, world = case.split(":")
        rows.append(run_case(preset, int(world), "shards"))
        print(_line(rows[-1]), flush=True)
    if a.baseline:
        old, new = rows[0], rows[1]
        print(
            f"baseline {old['preset']} on {old['world']} ranks: init {old['init_s']:.2f} s -> {new['init_s']:.2f} s "
            f"({old['init_s'] / new['init_s']:.1f}x faster), peak RSS {old['peak_rss_gib']:.2f} -> "
            f"{new['peak_rss_gib']:.2f} GiB"
        )
    out = {
        "machine": f"{platform.processor() or platform.machine()}, {__import__('os').cpu_count()} cores",
        "rows": rows,
    }
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {a.json}")


def _line(r: dict) -> str:
    ok = r["peak_rss_gib"] <= r["rss_bound_gib"]
    return (
        f"{r['preset']:>12} x{r['world']:<4} {r['method']:>13}: {r['params'] / 1e9:6.1f}B params, "
        f"rank shard {r['shard_gib']:6.2f} GiB, build {r['total_s']:6.1f} s (meta {r['meta_s']:.1f}, "
        f"shard {r['shard_s']:.1f}, alloc {r['alloc_s']:.1f}, init {r['init_s']:.1f}), peak RSS "
        f"{r['peak_rss_gib']:.2f} GiB (bound 1.5 x shard + 1 GiB = {r['rss_bound_gib']:.2f}: "
        f"{'ok' if ok else 'OVER'})"
    )


if __name__ == "__main__":
    main()
