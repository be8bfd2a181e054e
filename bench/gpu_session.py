"""Every GPU measurement the open issues ask for, in nine parts that each fit one 10-minute device call.

A session lent a GPU has 15 minutes of device time (one call, after the machine's start) and 10 minutes a
call; the parts are in order of what the issues need most, one part per lent session:

    part 1  the fused head on CUDA against the plain one (bench/head.py, eager and compiled), the GPU-speed
            table's core: the hand-written whole-model-compile loop and plait in one run (bench/gpu_peers.py),
            plait's side with its warm start and a profile of three steps; float8 where time is left
    part 2  float8 with torchao's choice of layers against the hand-written loop; plait's plain head; the
            ring attention at cp 1 against SDPA on CUDA and llama3-1b at seq 32,768 (regression checks);
            document masking's flex_attention path on CUDA (parity, then its cost against causal attention)
    part 3  the other peers (per-block compile, HF transformers), full activation checkpointing's effect on
            peak memory in one process, llama3-8b with CPU offload + full AC, an MoE model in bf16
    part 4  real size (issue 30): `plait fit` of llama3-8b FSDP 8, llama3-70b TP 8 x FSDP 8, the Llama 3 405B
            published layout (first and last stage), qwen3-30b-a3b EP 8, beside torch.compile probes with TP,
            FSDP x TP and MoE blocks; then llama3-8b with CPU offload training; then the 1.9B MoE timed. Needs
            an H200 (the 405B first stage is predicted at 78 GiB). One call, with the logs out of $OUT:

        python3 bench/gpu_session.py --part 4 --out /tmp/res --logs /tmp/res/logs --budget 535; \
        tar czf $OUT/part4.tgz -C /tmp res; cp /tmp/res/gpu_session_part4.json $OUT/

            (all green in one call of 345 s on an H200, 2026-11-28: bench/results/h200-2026-11-28-part4)
    part 5  mixture of experts (issue 31): the 1.91B MoE compiled, and the qwen3-moe-2.8b preset eager and
            compiled (about 6 minutes: the compiled first step of the 1.91B took 101 s on an H200)
    part 7  float8 against bf16 (issue 31): llama3-1b trained 200 steps in bf16, float8 tensorwise and float8
            rowwise (compile.float8_recipe), same batches; the loss gaps and tokens/s (bench/float8_loss.py)
    part 6  MoE against its peers (issue 31's 1.5x transformers), qwen3-moe-2.8b's shape, each side compiled,
            one after the other: plait, transformers' Qwen3MoeForCausalLM with bf16 weights and with bf16
            autocast over fp32 weights, the hand-written loop over torch._grouped_mm (bench/gpu_peers.py
            --family moe; checked here with `python bench/gpu_peers.py --family moe --check`)
    part 8  Muon (issue 46): the Newton-Schulz of llama3-1b's 112 matrices against its floor (bench/muon_ns.py);
            llama3-1b compiled, AdamW then Muon, at the speed table's batch (16 x 2048) and at 64 x 2048, one
            compile cache for the four; one rank of llama3-8b FSDP 8 under `plait fit`, Muon then AdamW
            (all green in one call of 244 s on an H200, 2026-11-30: bench/results/h200-2026-11-30-part8)
    part 9  Muon's step cost again: the 64 x 2048 pair in the other order, then 128 x 2048

Each step runs in its own process with a time limit; a step that would not finish before the part's deadline
is skipped and said so. Logs and JSON results go to --out (default $OUT on the device machine, else
bench/results/gpu_session); a short table is printed last. Steps that fail do not stop the part.

On the device machine plait is not installed and nothing can be fetched; the peers (../shared/gpu) and the
torchao wheel travel with the call. Here, once:

    echo /.whl/ >> .git/info/exclude && echo /.peers/ >> .git/info/exclude && cp -r ../shared/gpu .peers
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl torchao==0.17.0

then each call (carry [".whl", ".peers"]):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \\
        && export PYTHONPATH=/tmp/site || exit; python3 bench/gpu_session.py --part 1

    python bench/gpu_session.py --part 2 --dry-run     # the commands, on any machine
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the other bench scripts, also when loaded by a test
import float8_loss  # noqa: E402
import gpu_peers  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CALL_LIMIT_S = 560  # a device call's 600 s, less the start-up of the call and the copy of the results
LLAMA3_1B_2048 = [
    "--model.preset=llama3-1b",
    "--data.seq_len=2048",
    "--train.global_batch_size=16",
    "--train.micro_batch_size=4",
    "--train.mixed_precision=bf16",
    "--compile.enabled=true",
    "--run.device=cuda",
]


@dataclass
class Step:
    name: str
    argv: list[str]  # after the interpreter
    estimate_s: float  # seconds on an H100 or H200; a step is skipped when less than this is left
    result: str = ""  # the JSON file the step writes, relative to the output folder
    settings: list[str] = field(default_factory=list)  # the --section.key=value it gives plait (checked in CI)
    lane: str = ""  # steps of different lanes in one stage run at the same time (GPU-bound beside CPU-bound work)
    stage: int = 0  # stages run one after the other: a later stage starts when every lane of the one before ends


def plait_step(name: str, command: str, settings: list[str], options: list[str], estimate_s: float) -> Step:
    result = f"{name}.json" if command in ("bench", "fit") else ""
    argv = ["-m", "plait.cli", command, *settings, *options] + ([f"--json={{out}}/{result}"] if result else [])
    # `plait fit` settings describe an N-rank job: checked by its own --dry-run (--check), not as one process
    return Step(name, argv, estimate_s, result, settings if command != "fit" else [])


BF16_CUDA = ["--train.mixed_precision=bf16", "--run.device=cuda"]
MOE_1_9B = [  # the GPU-speed issue's MoE: 1.91B parameters, 12 blocks, dim 1024, 64 experts, top-8, width 768
    *gpu_peers.MOE_1_9B,
    "--data.seq_len=2048",
    "--train.global_batch_size=16",
    "--train.micro_batch_size=4",
    *BF16_CUDA,
]


QWEN3_MOE_2_8B = [  # the preset: Qwen3-MoE's block, 64 experts, top-8, 2.81B parameters (0.70B active)
    "--model.preset=qwen3-moe-2.8b",
    "--data.seq_len=2048",
    "--train.global_batch_size=16",
    "--train.micro_batch_size=4",
    *BF16_CUDA,
]
MOE_SHORT = ["--steps=8", "--warmup=3", "--no-warm-run"]
MUON_CACHE = "--compile.cache_dir=/tmp/plait-muon-cache"  # the four llama3-1b runs of part 8 compile once
FIT_8B_FSDP8 = [
    "--model.preset=llama3-8b",
    "--data.seq_len=8192",
    "--train.global_batch_size=8",
    "--parallel.dp_shard_degree=8",
]
MOE_PEER_SIDES = [("plait-moe", 140), ("hf-moe-bf16", 140), ("hf-moe", 140), ("bare-moe", 100)]  # estimates, s


def fit_step(name: str, world: int, settings: list[str], estimate_s: float, ranks: str = "", steps: int = 3,
             stage: int = 0) -> Step:  # fmt: skip
    """One rank (or the extreme ranks) of a `world`-rank job on this GPU: its peak beside the planner's."""
    options = ["--world-size", str(world), "--steps", str(steps), *(["--ranks", ranks] if ranks else [])]
    step = plait_step(name, "fit", [*settings, *BF16_CUDA], options, estimate_s)
    return dataclasses.replace(step, lane="fit", stage=stage)


def compile_probe(case: str, estimate_s: float) -> Step:
    return Step(f"compile-{case}", ["bench/compile_probe.py", f"--case={case}", f"--json={{out}}/compile-{case}.json"],
                estimate_s, f"compile-{case}.json", lane="compile")  # fmt: skip


def muon_1b(optimizer: str, batch: int, estimate_s: float) -> Step:
    """llama3-1b compiled at `batch` x 2048 with AdamW or Muon, timed by `plait bench` (one compile cache)."""
    settings = [*(a for a in LLAMA3_1B_2048 if "global_batch" not in a), f"--train.global_batch_size={batch}"]
    steps = {16: ["--steps=10", "--warmup=3"], 64: ["--steps=5", "--warmup=2"]}.get(batch, ["--steps=3", "--warmup=1"])
    optim = ["--optim.name=muon"] if optimizer == "muon" else []
    return plait_step(f"muon-1b-{optimizer}-b{batch}", "bench", [*settings, MUON_CACHE, *optim],
                      [*steps, "--no-warm-run"], estimate_s)  # fmt: skip


def parts(peers: Path) -> dict[int, list[Step]]:
    peers_cmd = ["bench/gpu_peers.py", f"--peers={peers}", "--steps=10", "--warmup=3", "--json={out}/gpu_peers.json"]
    short = ["--steps=10", "--warmup=3", "--no-warm-run"]
    moe_peers = ["bench/gpu_peers.py", "--family=moe", "--moe-shape=qwen3-moe-2.8b", "--steps=8", "--warmup=3"]
    ac_full = plait_step("ac-full", "bench", [*LLAMA3_1B_2048, "--parallel.activation_checkpoint=full"], short, 110)
    seq32k = plait_step(
        "seq32k",
        "bench",
        [
            "--model.preset=llama3-1b",
            "--model.max_seq_len=32768",
            "--data.seq_len=32768",
            "--train.global_batch_size=1",
            "--train.mixed_precision=bf16",
            "--parallel.activation_checkpoint=full",
            "--run.device=cuda",
        ],
        ["--steps=5", "--warmup=2", "--no-warm-run"],
        60,  # measured 41 s on an H200 (2026-11-26)
    )
    return {
        # what the GPU-speed issue needs most, in one call of a 15-minute lease: the fused head on CUDA (short),
        # then the speed table's core with cold/warm start and a profile of plait's step, float8 if time is left
        1: [
            Step(
                "head-cuda",
                [
                    "bench/head.py",
                    "--device=cuda",
                    "--dtype=bf16",
                    "--tokens=8192",
                    "--dim=2048",
                    "--compiled",
                    "--json={out}/head_cuda.json",
                ],
                60,  # measured 5 s before the compiled side
                "head_cuda.json",
            ),
            Step(
                "peers-core",
                [
                    *peers_cmd,
                    "--sides=bare-model,plait",
                    "--plait-warm-run",
                    "--plait-profile={out}/profile",
                ],
                230,  # measured 192 s
                "gpu_peers.json",
            ),
            # only where time is left: the same warm machine, so against peers-core's bare-model side
            Step(
                "float8",
                [*peers_cmd[:-1], "--json={out}/gpu_peers_float8.json", "--float8", "--sides=plait-float8"],
                120,  # measured 99 s
                "gpu_peers_float8.json",
            ),
        ],
        2: [
            Step(
                "peers-float8",
                [*peers_cmd, "--float8", "--sides=bare-model,plait-float8-auto"],
                190,  # bare-model measured 54 s, plait-float8 99 s on an H200
                "gpu_peers.json",
            ),
            Step(
                "peers-plain-head",
                [*peers_cmd[:-1], "--json={out}/gpu_peers_plain.json", "--sides=plait-plain-head"],
                150,
                "gpu_peers_plain.json",
            ),
            # long context, passed on an H200 on 2026-11-26 (kept as regression checks)
            Step(
                "ring-attention-cuda",
                ["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/parallel/test_context_parallel.py"]
                + ["-k", "cuda"],
                25,  # measured 13 s
            ),
            seq32k,
            # document masking on CUDA: flex_attention's path against the masked one, forward and backward;
            # then its cost in attention against causal flash attention (bench/document_mask.py)
            Step(
                "document-mask-cuda",
                ["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/parallel/test_document_mask.py", "-k", "cuda"],
                40,
            ),
            Step(
                "document-mask-cost",
                ["bench/document_mask.py", "--device=cuda", "--json={out}/document_mask_cuda.json"],
                60,
                "document_mask_cuda.json",
            ),
        ],
        3: [
            # three peer sides at about 60 s each (bare-model measured 54 s on an H200)
            Step("peers-rest", [*peers_cmd, "--sides=bare-model,bare-block,hf"], 220, "gpu_peers.json"),
            ac_full,  # against part 1's plait side (no AC): what checkpointing saves in one process
            plait_step(
                "llama3-8b-offload",
                "train",
                [
                    "--model.preset=llama3-8b",
                    "--data.seq_len=2048",
                    "--train.global_batch_size=4",
                    "--train.micro_batch_size=1",
                    "--train.mixed_precision=bf16",
                    "--parallel.cpu_offload=true",
                    "--parallel.activation_checkpoint=full",
                    "--optim.state_dtype=bf16",  # 16 bytes a parameter of host memory would not fit 128 GiB
                    "--train.steps=3",
                    "--log.every_steps=1",
                    "--eval.every_steps=0",
                    "--checkpoint.save_final=false",
                    "--run.name=h100-8b-offload",
                    "--run.out_dir={out}/runs",
                    "--run.device=cuda",
                ],
                [],
                150,  # 34 s a step on an H200 (plait fit, 2026-11-28)
            ),
            plait_step(
                "moe-bf16",
                "bench",
                ["--model.preset=moe-debug", "--data.seq_len=512", "--train.mixed_precision=bf16", "--run.device=cuda"],
                ["--steps=10", "--warmup=3", "--no-warm-run"],
                60,
            ),
        ],
        # real size on one GPU (issue "real size, proven on a device"): `plait fit` runs one rank of each job on
        # a fake process group of its world size, its peak beside the planner's (lane "fit", GPU-bound), while
        # torch.compile is tried with TP and with MoE blocks (lane "compile", mostly CPU-bound: Inductor); then
        # llama3-8b with CPU offload trains alone (stage 1: it needs nearly all the host memory). The fits'
        # step times share the machine with the compiler; their peaks are per process. Run with --logs
        # outside $OUT: 8 files come back at most.
        4: [
            fit_step("fit-8b-fsdp8", 8, FIT_8B_FSDP8, 45),
            fit_step(
                "fit-70b-tp8-fsdp8",
                64,
                ["--model.preset=llama3-70b", "--data.seq_len=8192", "--train.global_batch_size=8"]
                + [
                    "--parallel.tp_degree=8",
                    "--parallel.dp_shard_degree=8",
                    "--parallel.activation_checkpoint=selective",
                ],
                60,
            ),
            # Llama 3 405B's published layout (TP 8, PP 16, seq 8192) at DP 64: 16 micro-batches a rank
            fit_step(
                "fit-405b-first-last",
                8192,
                ["--model.preset=llama3-405b", "--data.seq_len=8192", "--train.global_batch_size=1024"]
                + [
                    "--train.micro_batch_size=1",
                    "--parallel.tp_degree=8",
                    "--parallel.pp_degree=16",
                    "--parallel.dp_shard_degree=64",
                    "--parallel.pp_schedule=interleaved_1f1b",
                    "--parallel.pp_virtual_stages=2",
                    "--parallel.activation_checkpoint=selective",
                ],
                110,
                ranks="extremes",
                steps=2,
            ),
            fit_step(
                "fit-qwen3-30b-ep8",
                32,
                ["--model.preset=qwen3-30b-a3b", "--data.seq_len=4096", "--train.global_batch_size=32"]
                + ["--parallel.dp_shard_degree=32", "--parallel.ep_degree=8"],
                80,
            ),
            compile_probe("tp", 70),
            compile_probe("moe", 90),
            compile_probe("fsdp-tp", 70),
            # CPU offload: llama3-8b's offloaded states take 16 bytes a parameter with fp32 moments (119.7 GiB, over
            # 90% of a 128 GiB host: plait fit refuses it; on 2026-11-27 the kernel killed it at its first step)
            # and 12 with bf16 ones (optim.state_dtype=bf16: 89.8 GiB): the whole model trains, its GPU peak,
            # step time and host RSS beside the planner's host figure
            fit_step(
                "fit-8b-offload",
                1,
                ["--model.preset=llama3-8b", "--data.seq_len=2048", "--train.global_batch_size=1"]
                + [
                    "--parallel.cpu_offload=true",
                    "--parallel.activation_checkpoint=full",
                    "--optim.state_dtype=bf16",
                ],
                160,  # 155 s on an H200, 2026-11-28
                steps=2,
                stage=1,
            ),
            # issue 31's MoE (1.91B, 64 experts, top-8) eager, alone on the GPU: the grouped kernel under autocast
            # and no host sync per block (was 9,258 tok/s, 1.92% MFU on an H100)
            dataclasses.replace(
                plait_step("moe-1.9b", "bench", MOE_1_9B, ["--steps=6", "--warmup=2", "--no-warm-run"], 70), stage=2
            ),
        ],
        # mixture of experts on one GPU (issue 31), alone on the GPU, eager beside compiled: the 1.91B MoE (24.2%
        # MFU compiled, 15.4% eager on an H200, 2026-11-28) and the qwen3-moe-2.8b preset
        5: [
            plait_step("moe-1.9b-compiled", "bench", [*MOE_1_9B, "--compile.enabled=true"], MOE_SHORT, 150),
            plait_step("moe-2.8b-eager", "bench", QWEN3_MOE_2_8B, MOE_SHORT, 60),
            plait_step("moe-2.8b-compiled", "bench", [*QWEN3_MOE_2_8B, "--compile.enabled=true"], MOE_SHORT, 160),
        ],
        # float8 against bf16: the same 200 steps in each recipe, one run after the other, then the gaps. A
        # compiled llama3-1b's first step took 60-100 s on an H200 (float8 the longer), 8 x 2048 tokens a step
        # about 0.25 s: estimates
        7: [
            *(
                plait_step(
                    f"float8-loss-{name}",
                    "train",
                    [*float8_loss.JOB, *float8_loss.RUNS[name], f"--run.name={name}", "--run.out_dir={out}/runs"],
                    [],
                    estimate,
                )
                for name, estimate in (("bf16", 150), ("float8-tensorwise", 190), ("float8-rowwise", 190))
            ),
            Step(
                "float8-loss-table",
                ["bench/float8_loss.py", "--runs={out}/runs", "--json={out}/float8_loss.json"],
                15,
                "float8_loss.json",
            ),
        ],
        # MoE beside its peers on qwen3-moe-2.8b's shape: each side its own step (a side's compile is most of it),
        # plait first (its compiled first step took 65 s, the whole side about 120 s on an H200); the
        # transformers and hand-written sides are not yet timed on a GPU: estimates
        6: [
            Step(
                f"moe-peers-{side}",
                [*moe_peers, f"--sides={side}", f"--json={{out}}/gpu_peers_moe_{side}.json"],
                estimate,
                f"gpu_peers_moe_{side}.json",
            )
            for side, estimate in MOE_PEER_SIDES
        ]
        + [
            Step(  # the sides in one table, the ratio against the faster transformers side
                "moe-peers-table",
                [
                    "bench/gpu_peers.py",
                    "--merge",
                    *(f"{{out}}/gpu_peers_moe_{side}.json" for side, _ in MOE_PEER_SIDES),
                    "--json={out}/gpu_peers_moe.json",
                ],
                5,
                "gpu_peers_moe.json",
            )
        ],
        # Muon against AdamW (issue 46): the orthogonalisation alone, then whole steps, then memory at real size
        8: [
            Step("muon-ns", ["bench/muon_ns.py", "--device=cuda", "--json={out}/muon_ns.json"], 30, "muon_ns.json"),
            muon_1b("adamw", 16, 120),  # the cold compile: 92 s to the first step on an H200 (2026-11-26)
            muon_1b("muon", 16, 60),
            fit_step("fit-8b-fsdp8-muon", 8, [*FIT_8B_FSDP8, "--optim.name=muon"], 45),
            fit_step("fit-8b-fsdp8-adamw", 8, FIT_8B_FSDP8, 35),  # 23 s on an H200 (2026-11-28)
            muon_1b("adamw", 64, 55),
            muon_1b("muon", 64, 60),
        ],
        # Muon's cost again (2026-11-30, after part 8): the 64 x 2048 pair in the other order, Muon first and
        # cold (is part 8's 1.3% compute difference between the two processes Muon's or the order's?), then 128
        # x 2048, where the optimizer's fixed 95 ms should be under 3% of the step
        9: [
            dataclasses.replace(muon_1b("muon", 64, 60), name="muon-1b-muon-b64-first", estimate_s=110),
            dataclasses.replace(muon_1b("adamw", 64, 55), name="muon-1b-adamw-b64-second"),
            muon_1b("muon", 128, 70),
            muon_1b("adamw", 128, 65),
        ],
    }


def run_step(step: Step, out: Path, limit_s: float, env: dict, logs: Path | None = None) -> dict:
    argv = [a.replace("{out}", str(out)) for a in step.argv]
    log = (logs or out) / f"{step.name}.log"
    started = time.perf_counter()
    with log.open("w") as f:
        # its own process group: a step that overruns goes with its children (gpu_peers' sides), and the GPU
        # memory they hold with them, before the next step starts
        proc = subprocess.Popen(
            [sys.executable, *argv], cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=limit_s)
            status = "ok" if rc == 0 else f"exit {rc}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            status = f"timed out at {limit_s:.0f} s"
    record = {"status": status, "wall_s": round(time.perf_counter() - started, 1), "log": log.name}
    if step.result and (out / step.result).exists():
        record["result"] = step.result
    if status != "ok":
        record["tail"] = log.read_text(errors="replace")[-1500:]
    return record


def summary(step: Step, out: Path) -> str:
    """One line of what a step measured, from its JSON."""
    if not step.result or not (out / step.result).exists():
        return ""
    r = json.loads((out / step.result).read_text())
    if isinstance(r, list):  # plait fit: one record per rank
        return "; ".join(_fit_line(rank) for rank in r)
    if "case" in r:  # bench/compile_probe.py
        c = r["compiled"]
        return f"compiled: {'ok, ' + format(c['step_s'], '.3f') + ' s/step' if c['ok'] else c['error'][:120]}"
    if "recipes" in r:  # bench/float8_loss.py
        return "; ".join(
            f"{name} {x['gap_nats']:+.4f} nats" if "gap_nats" in x else f"{name}: {x['error']}"
            for name, x in r["recipes"].items()
        )
    if "sides" in r:
        return "; ".join(
            f"{name} {s['tokens_per_s']:,.0f} tok/s {s.get('peak_gib') or s.get('peak_mem_gib') or 0:.1f} GiB"
            if "tokens_per_s" in s
            else f"{name} failed"
            for name, s in r["sides"].items()
        )
    if "ns_tflop" in r:  # bench/muon_ns.py
        ms = {k: f"{1e3 * r[k + '_s']:.1f} ms" for k in ("plait", "stacked", "floor")}
        return (f"Newton-Schulz {r['ns_tflop']:.1f} TFLOP: plait {ms['plait']}, stacked {ms['stacked']}, "
                f"floor {ms['floor']} at {r['matmul_tflops']:.0f} TFLOP/s")  # fmt: skip
    if "tokens_per_s" in r:
        text = f"{r['tokens_per_s']:,.0f} tok/s, MFU {100 * r['mfu']:.1f}%, peak {r['memory']['mem_peak_gib']:.1f} GiB"
        if "optimizer" in r.get("breakdown_s", {}):
            text += f", step {r['breakdown_s']['total']:.3f} s (optimizer {r['breakdown_s']['optimizer']:.3f})"
        if "planner" in r["memory"]:
            text += f" (planner {r['memory']['planner']['allocated_gib']:.1f})"
        text += f", first step {r['first_step']['from_process_start_s']:.1f} s"
        if "warm_over_cold" in r:
            text += f", warm/cold {r['warm_over_cold']:.2f}"
        return text
    return json.dumps(r)[:160]


def _fit_line(r: dict) -> str:
    m, p = r["measured"], r["predicted"]
    if not m:
        return f"rank {r['rank']}: {r['note']}"
    gib = 2**30
    text = f"rank {r['rank']}: peak {m['peak'] / gib:.1f} GiB vs planner {p['peak'] / gib:.1f}"
    text += (
        f" ({(p['peak'] - m['peak']) / m['peak']:+.1%}), reserved {m['reserved'] / gib:.1f} vs {p['total'] / gib:.1f}"
    )
    if r["step_s"]:
        text += f", step {r['step_s']:.2f} s, host RSS {m['host_rss'] / gib:.1f} GiB"
        if p.get("host"):
            text += f" (planner's offloaded states {p['host'] / gib:.1f})"
    return text + ("" if r["fits"] else f", DOES NOT FIT: {r['note']}")


def check(steps: list[Step], out: Path) -> list[str]:
    """What would fail at once on the device, found here: plait settings that do not validate or that plait's
    memory check would refuse on an H100 (plait.planner.preflight), script arguments
    the scripts refuse (each script step takes --dry-run), test selections that select nothing."""
    from plait.config import load_config
    from plait.core.errors import ConfigError
    from plait.planner.preflight import Machine, check_memory

    H100 = Machine(device_bytes=85_520_809_984, host_bytes=1800 * 2**30, name="H100 80GB", bf16_native=True)

    problems = []
    for step in steps:
        argv = [a.replace("{out}", str(out)) for a in step.argv]
        if step.settings:
            try:  # valid settings, and a memory prediction that the run's own check lets through on an H100
                cfg = load_config(None, [s.removeprefix("--").replace("{out}", str(out)) for s in step.settings])
                check_memory(cfg, 1, 1, H100)
            except ConfigError as e:
                problems.append(f"{step.name}: {e}")
            continue
        extra = ["--collect-only"] if argv[:2] == ["-m", "pytest"] else ["--dry-run"]
        if argv[:3] == ["-m", "plait.cli", "fit"]:  # the layout and the planner's rank, here on the CPU
            argv = [a.replace("--run.device=cuda", "--run.device=cpu") for a in argv]
        proc = subprocess.run([sys.executable, *argv, *extra], cwd=ROOT, capture_output=True, text=True)
        if proc.returncode:
            problems.append(f"{step.name}: exit {proc.returncode}: {(proc.stderr or proc.stdout).strip()[-500:]}")
    return problems


def critical_path_s(steps: list[Step]) -> float:
    """Seconds a part takes by its estimates: stage after stage, each as long as its longest lane."""
    total = 0.0
    for stage in {s.stage for s in steps}:
        lanes: dict[str, float] = {}
        for s in steps:
            if s.stage == stage:
                lanes[s.lane] = lanes.get(s.lane, 0.0) + s.estimate_s
        total += max(lanes.values())
    return total


_PRINT = threading.Lock()  # the lanes' lines whole
STEP_CAP = 2.5  # a step may take this many times its estimate (and never past the part's deadline)


def run_lane(steps: list[Step], deadline: float, out: Path, env: dict, logs: Path | None, records: dict) -> None:
    """The steps of one lane, one after the other, each skipped when its estimate no longer fits."""
    for step in steps:
        left = deadline - time.perf_counter()
        if left < step.estimate_s:
            records[step.name] = {"status": f"skipped: {left:.0f} s left, needs ~{step.estimate_s:.0f}"}
            continue
        with _PRINT:
            print(f"[{time.strftime('%H:%M:%S')}] {step.name} (~{step.estimate_s:.0f} s)", flush=True)
        records[step.name] = run_step(step, out, min(left, STEP_CAP * step.estimate_s), env, logs)
        try:
            records[step.name]["summary"] = summary(step, out)
        except (KeyError, TypeError, ValueError) as e:  # a result of another shape: the JSON is still there
            records[step.name]["summary"] = f"(no summary: {type(e).__name__} {e})"
        with _PRINT:
            print(f"[{time.strftime('%H:%M:%S')}] {step.name}: {records[step.name]['status']}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", type=int, choices=(1, 2, 3, 4, 5, 6, 7, 8, 9), required=True)
    default_peers = next((d for d in (ROOT / ".peers", ROOT.parent / "shared" / "gpu") if d.exists()), ROOT / ".peers")
    p.add_argument("--peers", type=Path, default=default_peers, help="the reference sides' folder")
    default_out = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "bench" / "results" / "gpu_session"
    p.add_argument("--out", type=Path, default=default_out)
    p.add_argument("--logs", type=Path, help="the steps' logs (default: --out); a failure's last lines go in the JSON")
    p.add_argument("--budget", type=float, default=CALL_LIMIT_S, help="seconds this part may take")
    p.add_argument("--only", default="", help="comma-separated step names of the part to run (default: all)")
    p.add_argument("--dry-run", action="store_true", help="print the commands and stop")
    p.add_argument("--check", action="store_true", help="check every step's arguments here (no GPU) and stop")
    a = p.parse_args()
    steps = parts(a.peers)[a.part]
    only = [n for n in a.only.split(",") if n]
    if only:
        unknown = sorted(set(only) - {s.name for s in steps})
        if unknown:
            p.error(f"--only: no step {unknown} in part {a.part}; its steps: {[s.name for s in steps]}")
        steps = [s for s in steps if s.name in only]
    if a.dry_run:
        for s in steps:
            print(f"{s.name} (~{s.estimate_s:.0f} s): python3 {' '.join(s.argv).replace('{out}', str(a.out))}")
        return 0
    if a.check:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="gpu-session-check-") as scratch:  # results of the dry runs
            problems = check(steps, Path(scratch))
        print("\n".join(problems) or f"part {a.part}: every step's arguments check out")
        return 1 if problems else 0
    import torch

    if not torch.cuda.is_available():
        print("bench/gpu_session.py needs a CUDA GPU; --dry-run prints the commands", file=sys.stderr)
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    if a.logs:
        a.logs.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH", "")]))
    deadline = time.perf_counter() + a.budget
    records = {s.name: {} for s in steps}  # in the part's order, whatever order the lanes end in
    for stage in sorted({s.stage for s in steps}):
        lanes = {}
        for s in steps:
            if s.stage == stage:
                lanes.setdefault(s.lane, []).append(s)
        threads = [threading.Thread(target=run_lane, args=(lane, deadline, a.out, env, a.logs, records))
                   for lane in lanes.values()]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    record = {"part": a.part, "device": torch.cuda.get_device_name(), "torch": torch.__version__, "steps": records}
    (a.out / f"gpu_session_part{a.part}.json").write_text(json.dumps(record, indent=1) + "\n")
    for name, r in records.items():
        if "tail" in r:
            print(f"\n--- {name}: {r['status']}, last lines of {r['log']} ---\n{r['tail']}")
    print(f"\npart {a.part} on {record['device']}, torch {record['torch']}")
    for name, r in records.items():
        print(f"{name:<20} {r['status']:<12} {r.get('wall_s', 0):>6.0f} s  {r.get('summary', '')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
