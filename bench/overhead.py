"""Framework overhead: plait's training step vs a bare hand-written PyTorch loop, in one process.

Both sides do the same work: the same model (same initial weights), the same contiguous (B, T) int64 inputs
and targets, cross-entropy on fp32 logits, backward, global gradient-norm clipping, AdamW with weight decay on
matrices only, and a per-step learning rate. plait's side is what `plait train` runs per step: the
background-prefetching loader over memory-mapped shards and `train_step`. The bare side indexes a token tensor
and writes the loop by hand. A third side, "bare (old)", is the loop this script used before (non-contiguous
targets sliced from one (B, T+1) tensor, `clip_grad_norm_` without foreach, one AdamW group, constant LR); it
is kept to show what the old comparison measured.

Noise control. On a small shared VM other processes take cores; with two OpenMP threads a step then waits at
every parallel region for a descheduled thread, so one unlucky segment runs several times slower. The sides
therefore alternate in many short rounds (order rotated each round), the ratio is the median of the per-round
ratios of adjacent segments (paired, so slow drift cancels), its spread (interquartile range) is reported,
and so is the ratio of process CPU time (less sensitive to being descheduled) and the load average. Results
go to bench/results/overhead.json.

    python bench/overhead.py [--preset tiny] [--seq-len 256] [--batch 16] [--rounds 12] [--steps 4] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from plait.config import load_config
from plait.core.hardware import device_info, resolve_device
from plait.data import TokenDataset, TokenLoader, ensure_prepared
from plait.engine.optim import lr_factor
from plait.engine.trainer import autocast_context, build_model, build_trainable, train_step


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return q[0], statistics.median(xs), q[2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--steps", type=int, default=4, help="steps per round and side")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "overhead.json"))
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)

    cfg = load_config(
        None,
        [
            f"model.preset={a.preset}",
            f"data.seq_len={a.seq_len}",
            f"train.global_batch_size={a.batch}",
            f"run.device={a.device}",
        ],
    )
    device = resolve_device(cfg.run.device)
    data_dir = ensure_prepared("shakespeare", Path(cfg.data.cache_dir).expanduser(), cfg.model.vocab_size)
    dataset = TokenDataset(data_dir, "train")
    autocast = autocast_context(cfg.train.mixed_precision, device)
    total = a.rounds * a.steps + 2
    cfg.train.steps = total
    o = cfg.optim

    # plait side: exactly what `plait train` builds and runs per step
    trainable = build_trainable(cfg, device)
    loader = TokenLoader(dataset, seq_len=a.seq_len, global_batch_size=a.batch, device=device, prefetch=2)

    def plait_steps(n: int) -> None:
        for _ in range(n):
            x, y = next(loader)
            train_step(trainable, x, y)

    # bare side: the same model, data and optimizer, written by hand
    tokens = torch.from_numpy(dataset.sample(0, dataset.num_tokens - 2).astype("int64")).to(device)
    schedule = partial(lr_factor, cfg=o, total_steps=total)

    def make_bare(old: bool):
        model = build_model(cfg.model, device, seed=0)
        if old:
            groups = [{"params": list(model.parameters()), "weight_decay": o.weight_decay}]
        else:
            matrices = [p for n, p in model.named_parameters() if p.ndim >= 2 and "tok_embeddings" not in n]
            others = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "tok_embeddings" not in n)]
            groups = [{"params": matrices, "weight_decay": o.weight_decay}, {"params": others, "weight_decay": 0.0}]
        fused = device.type in ("cuda", "cpu")  # as plait.engine.optim does: the same optimizer on both sides
        opt = torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=fused, foreach=not fused)
        gen = torch.Generator().manual_seed(0)
        offsets = torch.arange(a.seq_len + 1, device=device)
        state = {"step": 0}

        def steps(n: int) -> None:
            for _ in range(n):
                starts = torch.randint(0, tokens.numel() - a.seq_len - 1, (a.batch,), generator=gen).to(device)
                batch = tokens[starts[:, None] + offsets]  # (B, T + 1)
                x, y = batch[:, :-1], batch[:, 1:]
                if not old:
                    x, y = x.contiguous(), y.contiguous()  # what plait's loader hands over
                    for g in opt.param_groups:
                        g["lr"] = o.lr * schedule(state["step"])
                with autocast:
                    logits = model(x)
                    loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(0, 1))
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip, foreach=None if old else True)
                opt.step()
                opt.zero_grad(set_to_none=True)
                state["step"] += 1

        return steps

    sides = {"plait": plait_steps, "bare": make_bare(old=False), "bare (old)": make_bare(old=True)}

    def timed(fn, n: int) -> tuple[float, float]:
        if device.type == "cuda":
            torch.cuda.synchronize()
        w0, c0 = time.perf_counter(), time.process_time()
        fn(n)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - w0, time.process_time() - c0

    for fn in sides.values():  # warm-up: allocator, kernels, prefetch thread
        fn(2)
    load_before = os.getloadavg()
    wall: dict[str, list[float]] = {k: [] for k in sides}
    cpu: dict[str, list[float]] = {k: [] for k in sides}
    names = list(sides)
    for r in range(a.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]  # rotate who goes first
        for name in order:
            w, c = timed(sides[name], a.steps)
            wall[name].append(w)
            cpu[name].append(c)
    load_after = os.getloadavg()
    loader.close()

    tokens_per_step = a.batch * a.seq_len

    def tok_s(name: str) -> float:
        return a.steps * tokens_per_step / statistics.median(wall[name])

    def paired(num: str, den: str, series: dict) -> tuple[float, float, float]:
        # throughput ratio num / den per round = time(den) / time(num)
        return quartiles([d / n for n, d in zip(series[num], series[den], strict=True)])

    ratio = paired("plait", "bare", wall)
    result = {
        "device": device_info(device).name,
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "preset": a.preset,
        "params": cfg.model.num_params(),
        "seq_len": a.seq_len,
        "batch": a.batch,
        "precision": "bf16 autocast" if autocast.__class__.__name__ == "autocast" else "fp32",
        "plait_tokens_per_s": tok_s("plait"),
        "bare_tokens_per_s": tok_s("bare"),
        "bare_old_tokens_per_s": tok_s("bare (old)"),
        "ratio": ratio[1],
        "ratio_iqr": [ratio[0], ratio[2]],
        "ratio_cpu_time": paired("plait", "bare", cpu)[1],
        "ratio_vs_old_bare": paired("plait", "bare (old)", wall)[1],
        "ratio_bare_vs_old_bare": paired("bare", "bare (old)", wall)[1],
        "ratio_cpu_time_bare_vs_old_bare": paired("bare", "bare (old)", cpu)[1],
        "step_time_s": {k: quartiles([w / a.steps for w in v]) for k, v in wall.items()},
        "load_avg_1m": [load_before[0], load_after[0]],
        "rounds": a.rounds,
        "steps_per_round": a.steps,
        "torch": torch.__version__,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"{result['device']} ({result['cores']} cores, {result['threads']} threads)  {a.preset} "
        f"({result['params'] / 1e6:.1f}M)  seq {a.seq_len} x batch {a.batch}  {result['precision']}"
    )
    for name in names:
        lo, med, hi = result["step_time_s"][name]
        print(f"  {name:11s} {tok_s(name):8,.0f} tok/s   step {med * 1e3:7.1f} ms  (IQR {lo * 1e3:.1f}-{hi * 1e3:.1f})")
    print(
        f"ratio plait / bare = {ratio[1]:.3f} (IQR {ratio[0]:.3f}-{ratio[2]:.3f}; CPU-time ratio "
        f"{result['ratio_cpu_time']:.3f})  goal >= 0.98"
    )
    print(
        f"bare / bare (old) = {result['ratio_bare_vs_old_bare']:.3f} (CPU time "
        f"{result['ratio_cpu_time_bare_vs_old_bare']:.3f})   load average {load_before[0]:.1f} -> "
        f"{load_after[0]:.1f} on {result['cores']} cores   (written to {a.out})"
    )
    if max(load_before[0], load_after[0]) > (os.cpu_count() or 1):
        print("warning: the machine was busy with other processes (load average above the core count)")


if __name__ == "__main__":
    main()
