"""plait against its two GPU peers in one run, on one GPU: the hand-written loop (whole-model compile including
the loss, and per-block compile) and Hugging Face transformers' LlamaForCausalLM + torch.compile, all on the
llama3-1b shape at seq 2048, micro-batch 4 x 4 accumulation, bf16 autocast over fp32 master weights, fused
AdamW (the GPU-speed issue's table). The peers are the reference programs in ../shared/gpu (not project code:
they are run from there, `--peers` names another copy); plait is `plait bench` on the same job, with the fused
head (default) and, as a baseline in the same run, the plain head (`train.fused_head=false`).

Each side runs in its own process, one after the other (the device is empty for each). Printed: tokens/s,
MFU (plait's formula, 6 N + 12 L d T, against the device's dense bf16 peak), peak memory, first step (plait's
from process start; the peers' from their first step call, model built) and each side's tokens/s over the
hand-written whole-model-compile loop's. Written to bench/results/gpu_peers.json with the device name.

    python bench/gpu_peers.py                       # every side (about 10 minutes on an H100)
    python bench/gpu_peers.py --sides plait,bare-model --steps 10
    python bench/gpu_peers.py --dry-run             # print the commands, run nothing (any machine)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPE = dict(seq=2048, mb=4, accum=4)
PLAIT_JOB = [
    "--model.preset=llama3-1b",
    f"--data.seq_len={SHAPE['seq']}",
    f"--train.global_batch_size={SHAPE['mb'] * SHAPE['accum']}",
    f"--train.micro_batch_size={SHAPE['mb']}",
    "--compile.enabled=true",
    "--run.device=cuda",
]


def sides(
    peers: Path, steps: int, warmup: int, float8: bool, warm_run: bool = False, profile: Path | None = None
) -> dict[str, list[str]]:
    common = [f"--steps={steps}", f"--warmup={warmup}"]
    shape = [f"--seq={SHAPE['seq']}", f"--mb={SHAPE['mb']}", f"--accum={SHAPE['accum']}"]
    bench = [sys.executable, "-m", "plait.cli", "bench", *PLAIT_JOB, *common, "--quiet"]
    plait = [*bench, *([] if warm_run else ["--no-warm-run"]), *([f"--profile={profile}"] if profile else [])]
    bench.append("--no-warm-run")
    out = {
        "bare-model": [sys.executable, str(peers / "bare_llama.py"), "--compile=model", *shape, *common],
        "bare-block": [sys.executable, str(peers / "bare_llama.py"), "--compile=block", *shape, *common],
        "hf": [sys.executable, str(peers / "hf_llama.py"), *shape, *common],
        "plait": plait,
        "plait-plain-head": [*bench, "--train.fused_head=false"],
    }
    if float8:
        out["plait-float8"] = [*bench, "--compile.float8=true"]
        out["plait-float8-auto"] = [*bench, "--compile.float8=auto"]  # torchao's choice of layers
    return out


def run_side(cmd: list[str], is_plait: bool) -> dict:
    """One side in its own process: its JSON result, normalised to tokens_per_s / mfu / peak_gib / first_step_s."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "side.json"
        started = time.perf_counter()
        proc = subprocess.run([*cmd, f"--json={out}"], capture_output=True, text=True, cwd=ROOT)
        wall = time.perf_counter() - started
        if proc.returncode or not out.exists():
            return {"error": (proc.stderr or proc.stdout)[-2000:], "wall_s": wall}
        r = json.loads(out.read_text())
    if is_plait:
        return {
            "tokens_per_s": r["tokens_per_s"],
            "mfu": r["mfu"],
            "peak_gib": r["memory"]["mem_peak_gib"],
            "first_step_s": r["first_step"]["from_process_start_s"],
            "startup_s": r["startup_s"],
            "breakdown_s": r["breakdown_s"],
            "device": r["device"],
            "wall_s": wall,
            **{k: r[k] for k in ("warm_start", "warm_over_cold", "profile") if k in r},
        }
    return {**r, "wall_s": wall}


def _field(r: dict, *names: str):
    for n in names:
        if n in r:
            return r[n]
    return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peers", type=Path, default=ROOT.parent / "shared" / "gpu", help="the peers' folder")
    p.add_argument("--sides", default="", help="comma-separated subset of the sides (default: all)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--float8", action="store_true", help="also plait with compile.float8 (needs torchao)")
    p.add_argument("--plait-warm-run", action="store_true", help="plait's side also times a warm start (cache)")
    p.add_argument("--plait-profile", type=Path, help="plait's side also profiles 3 steps into this folder")
    p.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "gpu_peers.json")
    p.add_argument("--dry-run", action="store_true", help="print the commands and stop")
    a = p.parse_args()
    table = sides(a.peers, a.steps, a.warmup, a.float8, a.plait_warm_run, a.plait_profile)
    chosen = [s.strip() for s in a.sides.split(",") if s.strip()] or list(table)
    unknown = [s for s in chosen if s not in table]
    if unknown:
        print(f"--sides: unknown {unknown}; choose from {sorted(table)}", file=sys.stderr)
        return 2
    if a.dry_run:
        for name in chosen:
            print(f"{name}: {' '.join(table[name])}")
        return 0
    import torch

    from plait.core.profiling import describe

    if not torch.cuda.is_available():
        print("bench/gpu_peers.py needs a CUDA GPU (the peers are GPU programs); --dry-run prints the commands")
        return 2
    if not (a.peers / "bare_llama.py").exists() and any(not s.startswith("plait") for s in chosen):
        print(f"--peers {a.peers}: no bare_llama.py there; point --peers at the reference sides' folder")
        return 2
    results = {}
    for name in chosen:
        print(f"running {name} ...", flush=True)
        results[name] = run_side(table[name], name.startswith("plait"))
    base = results.get("bare-model", {}).get("tokens_per_s")
    print(f"\n{'side':<18} {'tokens/s':>10} {'MFU':>7} {'peak GiB':>9} {'first step s':>13} {'vs bare-model':>14}")
    for name, r in results.items():
        if "error" in r:
            print(f"{name:<18} failed: {r['error'].strip().splitlines()[-1] if r['error'].strip() else '?'}")
            continue
        tps, mfu = _field(r, "tokens_per_s"), _field(r, "mfu")
        peak, first = _field(r, "peak_gib", "peak_mem_gib"), _field(r, "first_step_s")
        ratio = f"{tps / base:.3f}x" if base and tps else "-"
        mfu_text = f"{100 * mfu:.1f}%" if mfu is not None else "-"
        print(
            f"{name:<18} {tps:>10,.0f} {mfu_text:>7} {peak if peak is None else round(peak, 1)!s:>9} "
            f"{first if first is None else round(first, 1)!s:>13} {ratio:>14}"
        )
    for name, r in results.items():
        if "warm_over_cold" in r:
            print(
                f"{name}: first step cold {r['first_step_s']:.1f} s, warm "
                f"{r['warm_start']['from_process_start_s']:.1f} s (warm/cold {r['warm_over_cold']:.2f}); "
                f"start-up {', '.join(f'{k} {v:.1f}' for k, v in r['startup_s'].items())}"
            )
        prof = r.get("profile", {})
        if prof:
            print(f"{name}: {describe(prof)}")
            for phase, areas in prof.get("startup", {}).items():
                print(f"{name}: {phase} host time, s: " + ", ".join(f"{k} {v:.1f}" for k, v in areas.items()))
    a.json.parent.mkdir(parents=True, exist_ok=True)
    record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": SHAPE, "sides": results}
    a.json.write_text(json.dumps(record, indent=1) + "\n")
    print(f"\nwritten to {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
