"""plait against its two GPU peers in one run, on one GPU: the hand-written loop (whole-model compile including
the loss, and per-block compile) and Hugging Face transformers' LlamaForCausalLM + torch.compile, all on the
llama3-1b shape at seq 2048, micro-batch 4 x 4 accumulation, bf16 autocast over fp32 master weights, fused
AdamW (the GPU-speed issue's table). The peers are the reference programs in ../shared/gpu (not project code:
they are run from there, `--peers` names another copy); plait is `plait bench` on the same job, with the fused
head (default) and, as a baseline in the same run, the plain head (`train.fused_head=false`).

Each side runs in its own process, one after the other (the device is empty for each). Printed: tokens/s,
MFU (plait's formula, 6 N + 12 L h T, against the device's dense bf16 peak), peak memory, first step (plait's
from process start; the peers' from their first step call, model built) and each side's tokens/s over the
hand-written whole-model-compile loop's. Written to bench/results/gpu_peers.json with the device name.

    python bench/gpu_peers.py                       # every side (about 10 minutes on an H100)
    python bench/gpu_peers.py --sides plait,bare-model --steps 10
    python bench/gpu_peers.py --dry-run             # print the commands, run nothing (any machine)

`--family moe` runs the mixture-of-experts peers instead, on the shape of `--moe-shape` (the qwen3-moe-2.8b
preset, or the GPU-speed issue's 1.91B MoE), all at seq 2048, micro-batch 4 x 4: transformers' own model of
that block (Qwen3MoeForCausalLM; MixtralForCausalLM for the 1.91B's Llama attention) compiled, with bf16 autocast
over fp32 weights as plait trains ("hf-moe") and with bf16 weights ("hf-moe-bf16"); a hand-written loop over
torch._grouped_mm, compiled ("bare-moe"); and `plait bench` compiled ("plait-moe") and eager
("plait-moe-eager"). The peers (bench/peers/) take the shape from plait's own config of the job, and every
side's MFU is plait's rule for that shape (active parameters: the router and the top-k experts a token passes
through, plus attention at the heads' width; `ModelArgs.flops_per_token`). The ratio column is against the
faster transformers side.

    python bench/gpu_peers.py --family moe --check  # every MoE side, tiny and eager, on this CPU (~1 min)
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


# The GPU-speed issue's MoE, as it gave it: 1.91B parameters, 12 blocks, dim 1024, 64 experts, top-8, width 768
# (moe-debug's router loss and loss-free balancing kept)
MOE_1_9B = [
    "--model.preset=moe-debug",
    "--model.dim=1024",
    "--model.n_layers=12",
    "--model.n_heads=16",
    "--model.n_kv_heads=4",
    "--model.moe_experts=64",
    "--model.moe_top_k=8",
    "--model.moe_hidden_dim=768",
    "--model.moe_shared_experts=0",
    "--model.moe_dense_layers=0",
    "--model.vocab_size=32768",
    "--model.max_seq_len=2048",
]
# The MoE jobs, as plait settings: the peers read their shape from plait's config of the same job.
MOE_SHAPES = {
    # Qwen3-MoE's block at a size that trains on one GPU: 2.81B parameters, 0.70B active
    "qwen3-moe-2.8b": ["--model.preset=qwen3-moe-2.8b"],
    # without a router loss or balancing, as transformers' side trains
    "1.9b": [*MOE_1_9B, "--model.moe_aux_loss=0", "--model.moe_bias_rate=0"],
}
MOE_JOB = [
    f"--data.seq_len={SHAPE['seq']}",
    f"--train.global_batch_size={SHAPE['mb'] * SHAPE['accum']}",
    f"--train.micro_batch_size={SHAPE['mb']}",
    "--train.mixed_precision=bf16",
]
CHECK_SHAPE = [  # --check: the same sides, tiny, eager, on the CPU
    "--model.preset=moe-debug",
    "--model.dim=64",
    "--model.n_layers=2",
    "--model.n_heads=4",
    "--model.n_kv_heads=2",
    "--model.moe_experts=8",
    "--model.moe_top_k=2",
    "--model.moe_hidden_dim=32",
    "--model.moe_shared_experts=0",
    "--model.moe_dense_layers=0",
    "--model.moe_aux_loss=0",
    "--model.moe_bias_rate=0",
    "--model.vocab_size=512",
    "--model.max_seq_len=64",
    "--data.seq_len=64",
    "--train.global_batch_size=4",
    "--train.micro_batch_size=2",
]


def moe_config(settings: list[str]):
    """plait's config of an MoE job given as command-line settings; refused where the peers differ from it."""
    from plait.config import load_config

    cfg = load_config(None, [s.removeprefix("--") for s in settings])
    m = cfg.model
    differs = {
        "moe_shared_experts": m.moe_shared_experts == 0,
        "moe_dense_layers": m.moe_dense_layers == 0,
        "moe_score": m.moe_score == "softmax",
        "moe_norm_topk": m.moe_norm_topk,
        "moe_aux_loss": m.moe_aux_loss == 0,
        "moe_bias_rate": m.moe_bias_rate == 0,
        "sliding_window": not m.sliding_window,
    }
    if bad := [k for k, same in differs.items() if not same]:
        raise SystemExit(f"the MoE peers build Qwen3-MoE / Mixtral blocks only; this job sets model.{bad}")
    return cfg


def moe_sides(settings: list[str], steps: int, warmup: int, device: str = "cuda") -> dict[str, list[str]]:
    """The MoE family's commands: plait's job (settings) and the peers on its shape."""
    cfg = moe_config(settings)
    m, mb = cfg.model, cfg.train.micro_batch_size
    accum = cfg.train.global_batch_size // mb
    peers = ROOT / "bench" / "peers"
    shape = [
        f"--dim={m.dim}", f"--layers={m.n_layers}", f"--heads={m.n_heads}", f"--kv={m.n_kv_heads}",
        f"--head-dim={m.head_dim}", f"--experts={m.moe_experts}", f"--top-k={m.moe_top_k}",
        f"--expert-width={m.expert_hidden_dim}", f"--vocab={m.vocab_size}", f"--rope-theta={m.rope_theta}",
        f"--eps={m.norm_eps}", f"--seq={cfg.data.seq_len}", f"--mb={mb}", f"--accum={accum}",
        f"--steps={steps}", f"--warmup={warmup}", f"--device={device}",
    ]  # fmt: skip
    compiled = "--compile=1" if device == "cuda" else "--compile=0"  # a CPU check runs them eager
    hf = [sys.executable, str(peers / "hf_moe.py"), f"--arch={'qwen3_moe' if m.qk_norm else 'mixtral'}", *shape]
    bench = [sys.executable, "-m", "plait.cli", "bench", *settings, f"--run.device={device}", f"--steps={steps}"]
    bench += [f"--warmup={warmup}", "--no-warm-run", "--quiet"]
    return {
        "plait-moe": [*bench, *(["--compile.enabled=true"] if device == "cuda" else [])],
        "hf-moe-bf16": [*hf, compiled, "--weights=bf16"],
        "hf-moe": [*hf, compiled, "--weights=fp32"],
        "bare-moe": [
            sys.executable,
            str(peers / "bare_moe.py"),
            *shape,
            compiled,
            f"--qk-norm={int(m.qk_norm)}",
            f"--dtype={'bf16' if device == 'cuda' else 'fp32'}",
        ],  # fmt: skip
        "plait-moe-eager": bench,
    }


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
    p.add_argument("--family", choices=["dense", "moe"], default="dense", help="dense llama3-1b, or MoE")
    p.add_argument("--moe-shape", choices=sorted(MOE_SHAPES), default="qwen3-moe-2.8b")
    p.add_argument("--check", action="store_true", help="--family moe: run every side tiny on this CPU, and stop")
    p.add_argument(
        "--merge", type=Path, nargs="+", help="print one table from these results (of one device), to --json"
    )
    a = p.parse_args()
    if a.merge:
        if a.dry_run:
            print(f"merge {[str(m) for m in a.merge]} into {a.json}")
            return 0
        return merge(a.merge, a.json)
    if a.family == "moe":
        if a.check:
            return check_moe_sides()
        settings = [*MOE_SHAPES[a.moe_shape], *MOE_JOB]
        table = moe_sides(settings, a.steps, a.warmup)
        if a.json == p.get_default("json"):
            a.json = a.json.with_name(f"gpu_peers_moe_{a.moe_shape}.json")
    else:
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

    from plait.core.hardware import device_info
    from plait.core.profiling import describe

    if not torch.cuda.is_available():
        print("bench/gpu_peers.py needs a CUDA GPU (the peers are GPU programs); --dry-run prints the commands")
        return 2
    if (
        a.family == "dense"
        and not (a.peers / "bare_llama.py").exists()
        and any(not s.startswith("plait") for s in chosen)
    ):
        print(f"--peers {a.peers}: no bare_llama.py there; point --peers at the reference sides' folder")
        return 2
    results = {}
    for name in chosen:
        print(f"running {name} ...", flush=True)
        results[name] = run_side(table[name], name.startswith("plait"))
    if a.family == "moe":  # the same MFU rule for every side: plait's, on the job's shape
        flops = moe_config(settings).model.flops_per_token(SHAPE["seq"])
        peak_flops = device_info(torch.device("cuda")).peak_flops
        for r in results.values():
            if "tokens_per_s" in r and "mfu" not in r:
                r["mfu"] = r["tokens_per_s"] * flops / peak_flops
    print_table(results)
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
    if a.family == "moe":
        record["moe_shape"], record["plait_settings"] = a.moe_shape, settings
    a.json.write_text(json.dumps(record, indent=1) + "\n")
    print(f"\nwritten to {a.json}")
    return 0


def print_table(results: dict[str, dict]) -> None:
    """Each side's tokens/s, MFU, peak and first step; the ratio against the hand-written whole-model loop
    (dense) or against the faster transformers side (MoE)."""
    hf = [results.get(k, {}).get("tokens_per_s") for k in ("hf-moe", "hf-moe-bf16")]
    if any(hf):
        base, against = max(x for x in hf if x), "vs best hf"
    else:
        base, against = results.get("bare-model", {}).get("tokens_per_s"), "vs bare-model"
    print(f"\n{'side':<18} {'tokens/s':>10} {'MFU':>7} {'peak GiB':>9} {'first step s':>13} {against:>14}")
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


def merge(paths: list[Path], out: Path) -> int:
    """One table from the JSONs of sides run in separate calls (bench/gpu_session.py runs each MoE side as
    its own step): the sides together, written to out. The records must come from one device and torch."""
    records = [json.loads(p.read_text()) for p in paths if p.exists()]
    if not records:
        print(f"--merge: none of {[str(p) for p in paths]} exists", file=sys.stderr)
        return 2
    where = {(r["device"], r["torch"], r.get("moe_shape")) for r in records}
    if len(where) > 1:
        print(f"--merge: the records come from different devices, torch versions or shapes: {where}", file=sys.stderr)
        return 2
    merged = {**records[0], "sides": {k: v for r in records for k, v in r["sides"].items()}}
    print_table(merged["sides"])
    out.write_text(json.dumps(merged, indent=1) + "\n")
    print(f"\nwritten to {out}")
    return 0


def check_moe_sides() -> int:
    """Every MoE side on a tiny shape, eager, on this CPU: each must run and print its JSON (what would
    otherwise fail on the device, found here)."""
    failed = []
    qwen3 = ["--model.qk_norm=true", "--model.attention_head_dim=32"]  # heads wider than the model, as Qwen3's
    for settings in (CHECK_SHAPE, [*CHECK_SHAPE, *qwen3]):
        params = moe_config(settings).model.num_params()
        for name, cmd in moe_sides(settings, steps=2, warmup=1, device="cpu").items():
            r = run_side(cmd, name.startswith("plait"))
            ok = "tokens_per_s" in r and r["tokens_per_s"] > 0
            if ok and r.get("params", params) != params:  # the peers' models: the same parameters as plait's
                ok, r["error"] = False, f"{r['params']:,} parameters, plait's model has {params:,}"
            arch = "qwen3" if qwen3[0] in settings else "mixtral"
            print(f"{arch:<8}{name:<16} {'ok' if ok else 'FAILED'} {r.get('tokens_per_s', 0):>9,.0f} tok/s  "
                  f"{r['wall_s']:.1f} s")  # fmt: skip
            if not ok:
                failed.append(name)
                print(r.get("error", "")[-1500:])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
