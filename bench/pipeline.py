"""Pipeline bubble: each pipeline rank's idle fraction per step, measured, against the analytic bubble.

For each schedule (gpipe, 1f1b, interleaved_1f1b and zero_bubble with v virtual stages per rank) and micro-batch
count m, plait builds the pipeline (`build_trainable`) and runs the schedule's step (`pipeline_forward_backward`)
on gloo processes, one launch per pipeline degree p. Each rank times its own compute: every stage's
`forward_one_chunk`, `backward_one_chunk` and `backward_weight_one_chunk` and the loss, with wall-clock stamps
(`time.perf_counter`). The step time T runs from a barrier to the end of the slowest rank's schedule; a rank's
idle fraction is 1 - compute / T. Also reported: the share of T inside the pipeline's P2P post / wait calls, and
the tail after the rank's own schedule ended (waiting for the others to finish); the rest is the schedule's own
Python work.

Analytic bubble (the idle share of a stage with equal stages and free communication): (p - 1) / (m + p - 1) for
GPipe and 1F1B, (p - 1) / (v m + p - 1) for interleaved 1F1B (the bubble shrinks to (p - 1) / v chunk-times);
for zero-bubble the interleaved figure is an upper bound (the schedule fills part of it with weight-gradient work).
plait's `bubble_fraction` (written to the JSON too) is the same formula.

Compute per micro-batch is made heavy enough (dim 384, seq 128, 2 sequences per micro-batch: ~12 ms forward
and ~25 ms backward per layer on one core) that P2P latency (~1 ms per message on loopback) is small beside it.
One thread per process. On a 2-core machine, p = 4 means 4 processes time-sharing 2 cores: stages that should
run at once do not, so the idle fractions measured there say little about the schedule. It is off by default
(--pp 2 4 to run it).

    python bench/pipeline.py [--pp 2] [--micro 2 4 8] [--steps 4] [--dim 384] [--seq-len 128]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.multiprocessing as mp

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 2)]


class Clock:
    """Wall-clock seconds spent in compute and in pipeline P2P calls on this rank."""

    def __init__(self) -> None:
        self.compute = 0.0
        self.wait = 0.0

    def wrap(self, fn, field: str):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(self, field, getattr(self, field) + time.perf_counter() - t0)

        return timed


def _instrument(schedule, clock: Clock) -> None:
    stages = getattr(schedule, "_stages", None) or [schedule._stage]
    for stage in stages:
        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            setattr(stage, name, clock.wrap(getattr(stage, name), "compute"))
    schedule._maybe_compute_loss = clock.wrap(schedule._maybe_compute_loss, "compute")


def _run(schedule: str, v: int, m: int, pp: int, a, world: int) -> dict:
    import torch.distributed as dist
    import torch.distributed.pipelining.schedules as sched_mod

    from plait.config import load_config
    from plait.engine.trainer import build_trainable
    from plait.parallel import Meshes, ParallelDims, validate_layout
    from plait.parallel.pipeline import bubble_fraction, pipeline_forward_backward

    cfg = load_config(
        None,
        [
            f"model.dim={a.dim}", "model.n_layers=8", "model.n_heads=4", "model.n_kv_heads=4", "model.vocab_size=256",
            "model.max_seq_len=512", f"data.seq_len={a.seq_len}", f"train.global_batch_size={m * a.micro_batch}",
            f"train.micro_batch_size={a.micro_batch}", "train.mixed_precision=fp32", "run.device=cpu",
            f"parallel.pp_degree={pp}", f"parallel.pp_schedule={schedule}", f"parallel.pp_virtual_stages={v}",
            "parallel.pp_split=layers",
        ],
    )  # fmt: skip
    dims = ParallelDims.from_config(cfg.parallel, world)
    validate_layout(cfg, dims)
    meshes = Meshes(dims.build_mesh("cpu"), dims)
    t = build_trainable(cfg, torch.device("cpu"), meshes)
    pipe, group = t.pipeline, meshes.pp.get_group()
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.model.vocab_size, (m * a.micro_batch, a.seq_len + 1), generator=gen)
    x, y = tokens[:, :-1], tokens[:, 1:]

    def step() -> float:
        """One schedule step; returns when this rank's part of the schedule ended (before plait's loss sum)."""
        inner = pipe.schedule.step
        ended = []

        def timed_step(*args, **kwargs):
            try:
                return inner(*args, **kwargs)
            finally:
                ended.append(time.perf_counter())

        pipe.schedule.step = timed_step
        try:
            pipeline_forward_backward(pipe, x, y, group)
        finally:
            del pipe.schedule.step
        for opt in t.optimizers:
            opt.zero_grad(set_to_none=True)
        return ended[0]

    step()  # warm-up: shape inference, allocations
    clock = Clock()
    _instrument(pipe.schedule, clock)
    post, wait = sched_mod._batch_p2p, sched_mod._wait_batch_p2p
    sched_mod._batch_p2p, sched_mod._wait_batch_p2p = clock.wrap(post, "wait"), clock.wrap(wait, "wait")
    samples = []  # (step time T, this rank's compute, P2P time, tail after this rank's last op)
    try:
        for _ in range(a.steps):
            clock.compute = clock.wait = 0.0
            dist.barrier()
            t0 = time.perf_counter()
            span = step() - t0
            total = torch.tensor([span], dtype=torch.float64)
            dist.all_reduce(total, op=dist.ReduceOp.MAX)
            samples.append((total.item(), clock.compute, clock.wait, total.item() - span))
    finally:
        sched_mod._batch_p2p, sched_mod._wait_batch_p2p = post, wait
    idle = [1 - c / T for T, c, _, _ in samples]
    mine = {
        "pp_rank": meshes.pp.get_local_rank(),
        "step_s": statistics.median(T for T, _, _, _ in samples),
        "compute_s": statistics.median(c for _, c, _, _ in samples),
        "idle": statistics.median(idle),
        "idle_spread": max(idle) - min(idle),
        "p2p": statistics.median(w / T for T, _, w, _ in samples),
        "tail": statistics.median(e / T for T, _, _, e in samples),
    }
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    return {
        "schedule": schedule, "virtual": v, "pp": pp, "micro": m,
        "analytic": (pp - 1) / (v * m + pp - 1), "plait_bubble_fraction": bubble_fraction(pp, m, v),
        "ranks": everyone,
    }  # fmt: skip


def _worker(rank: int, world: int, port: int, jobs: list, a, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)
    from plait.parallel.env import init_distributed, shutdown

    results = []
    try:
        init_distributed("cpu", 300)
        for schedule, v, m in jobs:
            try:
                results.append(_run(schedule, v, m, world, a, world))
            except Exception:
                results.append({"schedule": schedule, "virtual": v, "micro": m, "error": traceback.format_exc()})
                raise
    finally:
        if rank == 0:
            Path(out).write_text(json.dumps(results))
        shutdown()


def launch(pp: int, jobs: list, a) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(Path(tempfile.mkdtemp(prefix=f"plait-pipe-p{pp}-")) / "results.json")
    try:
        mp.start_processes(_worker, args=(pp, port, jobs, a, out), nprocs=pp, start_method="spawn")
    except mp.ProcessRaisedException as e:
        print(f"pp={pp}: a worker failed: {e}", file=sys.stderr)
    return json.loads(Path(out).read_text()) if Path(out).exists() else []


def report(results: list[dict], a) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=150)
    table = Table(title=f"Pipeline idle fraction per rank and step (dim {a.dim}, seq {a.seq_len}, "
                  f"{a.micro_batch} seq / micro-batch, 8 layers, gloo, 1 thread / process)")  # fmt: skip
    for col in ("schedule", "p", "v", "m", "analytic bubble", "idle per rank (measured)", "mean idle",
                "measured / analytic", "in P2P per rank", "tail per rank", "step s"):  # fmt: skip
        table.add_column(col, justify="left" if col == "schedule" else "right")
    for r in results:
        ranks = sorted(r["ranks"], key=lambda x: x["pp_rank"])
        mean = statistics.mean(x["idle"] for x in ranks)
        table.add_row(
            r["schedule"], str(r["pp"]), str(r["virtual"]), str(r["micro"]), f"{r['analytic']:.3f}",
            " ".join(f"{x['idle']:.3f}" for x in ranks), f"{mean:.3f}",
            f"{mean / r['analytic']:.2f}" if r["analytic"] else "-",
            " ".join(f"{x['p2p']:.3f}" for x in ranks), " ".join(f"{x['tail']:.3f}" for x in ranks),
            f"{ranks[0]['step_s']:.2f}",
        )  # fmt: skip
        r["mean_idle"] = mean
    console.print(table)
    console.print(
        "idle = 1 - (time in this rank's stage forward/backward/weight-grad compute and loss) / step time; "
        "in P2P = time inside the schedule's batch_isend_irecv post and wait calls / step time; tail = time "
        "between this rank's last operation and the end of the slowest rank / step time; analytic = (p-1)/(v m+p-1) "
        "(v = 1: GPipe, 1F1B; zero-bubble: the interleaved figure, an upper bound)."
    )
    if any(r["pp"] > 2 for r in results):
        console.print(
            f"note: this machine has {os.cpu_count()} CPU cores; with p > {os.cpu_count()} processes time-share "
            "cores, so stages that the schedule overlaps run one after another and the measured idle is not the "
            "schedule's bubble."
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pp", type=int, nargs="+", default=[2], help="pipeline degrees (4: time-shared on 2 cores)")
    p.add_argument("--micro", type=int, nargs="+", default=[2, 4, 8], help="micro-batch counts m")
    p.add_argument("--schedules", nargs="+", default=[s for s, _ in SCHEDULES])
    p.add_argument("--steps", type=int, default=4, help="timed steps per configuration (after one warm-up)")
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "pipeline.json"))
    a = p.parse_args()
    results = []
    for pp in a.pp:
        jobs = [
            (s, v, m)
            for s, v in SCHEDULES
            if s in a.schedules
            for m in a.micro
            if m >= pp and (s != "interleaved_1f1b" or m % pp == 0)
        ]
        for res in launch(pp, jobs, a):
            if "error" in res:
                print(f"{res['schedule']} m={res['micro']}: {res['error']}", file=sys.stderr)
            else:
                results.append(res)
    report(results, a)
    out = {
        "what": "idle fraction per pipeline rank and step: 1 - compute time / step time, median over steps",
        "settings": {"dim": a.dim, "n_layers": 8, "seq_len": a.seq_len, "micro_batch": a.micro_batch,
                     "steps": a.steps, "backend": "gloo", "threads_per_process": 1, "cpu_cores": os.cpu_count(),
                     "torch": torch.__version__},
        "results": results,
    }  # fmt: skip
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"written to {a.out}")


if __name__ == "__main__":
    main()
