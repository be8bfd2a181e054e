"""plait FSDP2 vs DeepSpeed ZeRO-3: the same model, batch and world size, side by side in the same processes.

Two processes (gloo on the CPU, NCCL on GPUs), each running both engines on the same pre-built batches, in
alternating rounds (order rotated each round) so that drift of the machine hits all sides alike:

- plait: `build_trainable` with parallel.dp_shard_degree=2 (FSDP2, parameters resharded after forward) and
  `train_step` (loss, backward with reduce-scatter, exact global grad norm, clipping, AdamW, LR schedule);
- DeepSpeed ZeRO-3, every parameter partitioned (stage3_param_persistence_threshold=0, the same sharding as
  FSDP2), with the same model and initial weights, the same AdamW (plait's `build_optimizer`: weight decay on
  matrices only) and LR schedule, gradient clipping at the same norm;
- DeepSpeed ZeRO-3 with its defaults: parameters under 100k elements (most of a small model) stay whole on
  every rank, so it communicates less than the other two; shown for reference.

Precision: fp32 on a CPU (no native bf16 here); on GPUs both use bf16 (plait's FSDP2 mixed-precision policy,
DeepSpeed's bf16 section). The ratio printed is the median over rounds of plait's throughput over each
DeepSpeed side's (paired per round). The first steps' losses of the sides are compared as a sanity check.
Results go to bench/results/deepspeed_zero3.json.

    pip install deepspeed   # only for this benchmark
    python bench/deepspeed_zero3.py [--preset tiny] [--seq-len 256] [--batch 16] [--rounds 6] [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch.multiprocessing as mp

WORLD = 2


def _worker(rank: int, a: argparse.Namespace, port: int, out: str) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        LOCAL_WORLD_SIZE=str(WORLD),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    warnings.filterwarnings("ignore", category=FutureWarning)
    import logging

    import torch
    import torch.distributed as dist

    from plait.config import load_config
    from plait.data import TokenDataset, TokenLoader, ensure_prepared
    from plait.engine.optim import build_optimizer, build_scheduler
    from plait.engine.trainer import autocast_context, build_model, build_trainable, cross_entropy, train_step
    from plait.parallel import Meshes, ParallelDims, init_distributed

    cuda = torch.cuda.is_available() and a.device != "cpu"
    if not cuda:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // WORLD))
    cfg = load_config(
        None,
        [
            f"model.preset={a.preset}",
            f"data.seq_len={a.seq_len}",
            f"train.global_batch_size={a.batch}",
            f"train.steps={2 + a.rounds * a.steps}",
            "parallel.dp_shard_degree=2",
            f"run.device={'cuda' if cuda else 'cpu'}",
        ],
    )
    env = init_distributed(cfg.run.device, 600)
    device = env.device
    import deepspeed

    deepspeed.utils.logger.setLevel(logging.WARNING)

    # the same batches for every side: this rank's half of each global batch
    data_dir = ensure_prepared("shakespeare", Path(cfg.data.cache_dir).expanduser(), cfg.model.vocab_size)
    loader = TokenLoader(
        TokenDataset(data_dir, "train"),
        seq_len=a.seq_len,
        global_batch_size=a.batch,
        dp_rank=rank,
        dp_degree=WORLD,
        device=device,
        prefetch=0,
    )
    batches = [next(loader) for _ in range(2 + a.rounds * a.steps)]
    loader.close()

    dims = ParallelDims.from_config(cfg.parallel, WORLD)
    plait = build_trainable(cfg, device, Meshes(dims.build_mesh(device.type), dims))
    bf16 = cuda and cfg.train.mixed_precision != "fp32"

    def make_ds(persistence: int | None):
        model = build_model(cfg.model, device, cfg.run.seed)  # the weights plait's FSDP materialize gives
        opt = build_optimizer(model, cfg.optim, device)
        zero = {"stage": 3} | ({} if persistence is None else {"stage3_param_persistence_threshold": persistence})
        ds_cfg = {
            "train_batch_size": a.batch,
            "train_micro_batch_size_per_gpu": a.batch // WORLD,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": cfg.train.grad_clip,
            "zero_optimization": zero,
            "zero_allow_untested_optimizer": True,
            "bf16": {"enabled": bf16},
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        engine, *_ = deepspeed.initialize(
            model=model,
            optimizer=opt,
            lr_scheduler=lambda o: build_scheduler(o, cfg.optim, cfg.train.steps),
            config=ds_cfg,
        )
        return engine

    engines = {"deepspeed_zero3": make_ds(0), "deepspeed_zero3_defaults": make_ds(None)}
    cursor = {name: 0 for name in ["plait", *engines]}
    losses: dict[str, list[float]] = {name: [] for name in cursor}

    def run(name: str, n: int) -> None:
        for _ in range(n):
            x, y = batches[cursor[name]]
            cursor[name] += 1
            if name == "plait":
                loss = train_step(plait, x, y).loss
            else:
                engine = engines[name]
                # no autocast: DeepSpeed casts itself under bf16
                with autocast_context(cfg.train.mixed_precision, device, fsdp=True):
                    loss = cross_entropy(engine(x), y)
                engine.backward(loss)
                engine.step()
                loss = loss.detach().clone()
                dist.all_reduce(loss)
                loss = loss / WORLD
            losses[name].append(loss.item())

    def timed(name: str, n: int) -> float:
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        run(name, n)
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        return time.perf_counter() - t0

    names = list(cursor)
    for name in names:  # warm-up
        run(name, 2)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(a.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(timed(name, a.steps))
    if rank == 0:
        Path(out).write_text(
            json.dumps(
                {
                    "times": times,
                    "losses": losses,
                    "device": torch.cuda.get_device_name(device) if cuda else "cpu",
                    "threads_per_rank": torch.get_num_threads(),
                    "deepspeed": deepspeed.__version__,
                    "torch": torch.__version__,
                    "precision": "bf16 params, fp32 reduction" if bf16 else "fp32",
                }
            )
        )
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=3, help="steps per round and side")
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "deepspeed_zero3.json"))
    a = p.parse_args()
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        raise SystemExit("this benchmark needs DeepSpeed: pip install deepspeed") from None

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        raw_path = Path(tmp) / "raw.json"
        mp.start_processes(_worker, args=(a, port, str(raw_path)), nprocs=WORLD, start_method="spawn")
        raw = json.loads(raw_path.read_text())
    load_after = os.getloadavg()[0]

    tokens_per_step = a.batch * a.seq_len
    times = raw["times"]

    def tok_s(name: str) -> float:
        return a.steps * tokens_per_step / statistics.median(times[name])

    def ratio(other: str) -> float:  # plait throughput / other's, per round
        return statistics.median([o / p for p, o in zip(times["plait"], times[other], strict=True)])

    first = {name: v[:3] for name, v in raw["losses"].items()}
    result = {
        "device": raw["device"],
        "world_size": WORLD,
        "threads_per_rank": raw["threads_per_rank"],
        "preset": a.preset,
        "seq_len": a.seq_len,
        "global_batch": a.batch,
        "precision": raw["precision"],
        "plait_fsdp2_tokens_per_s": tok_s("plait"),
        "deepspeed_zero3_tokens_per_s": tok_s("deepspeed_zero3"),
        "deepspeed_zero3_defaults_tokens_per_s": tok_s("deepspeed_zero3_defaults"),
        "ratio_plait_over_zero3": ratio("deepspeed_zero3"),
        "ratio_plait_over_zero3_defaults": ratio("deepspeed_zero3_defaults"),
        "first_losses": first,
        "load_avg_1m": [load_before, load_after],
        "rounds": a.rounds,
        "steps_per_round": a.steps,
        "deepspeed": raw["deepspeed"],
        "torch": raw["torch"],
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"{WORLD} ranks x {result['device']} ({result['threads_per_rank']} threads each)  {a.preset}  "
        f"seq {a.seq_len} x global batch {a.batch}  {result['precision']}  DeepSpeed {result['deepspeed']}"
    )
    for name in times:
        print(f"  {name:26s} {tok_s(name):9,.0f} tok/s   first losses {', '.join(f'{v:.5f}' for v in first[name])}")
    print(
        f"plait FSDP2 / DeepSpeed ZeRO-3 = {result['ratio_plait_over_zero3']:.3f}  (vs ZeRO-3 defaults: "
        f"{result['ratio_plait_over_zero3_defaults']:.3f})   load average {load_before:.1f} -> {load_after:.1f}"
    )


if __name__ == "__main__":
    main()
