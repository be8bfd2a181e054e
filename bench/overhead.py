"""Framework overhead: plait's training step vs a bare hand-written PyTorch loop, in one process.

Both train the same model (same initial weights) on the same token data with the same AdamW settings.
plait's side is what `plait train` runs per step: the background-prefetching loader, `train_step` (loss,
backward, global-norm clipping, optimizer step) and the LR scheduler. The bare side indexes a token tensor
and writes the loop by hand. The two alternate in rounds so drift of the machine hits both alike; the
ratio of the medians of steps/s is printed (goal >= 0.98) and written to bench/results/overhead.json.

    python bench/overhead.py [--preset tiny] [--seq-len 256] [--batch 16] [--rounds 5] [--steps 10]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from plait.config import load_config
from plait.data import TokenDataset, TokenLoader, ensure_prepared
from plait.hardware import device_info, resolve_device
from plait.train import autocast_context, build_model, build_trainable, train_step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=10, help="steps per round and side")
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "overhead.json"))
    a = p.parse_args()

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
    autocast = autocast_context(cfg, device)
    total = a.rounds * a.steps + 2

    # plait side: exactly what `plait train` builds and runs per step
    cfg.train.steps = total
    trainable = build_trainable(cfg, device)
    loader = TokenLoader(dataset, seq_len=a.seq_len, global_batch_size=a.batch, device=device, prefetch=2)

    def plait_steps(n: int) -> None:
        for _ in range(n):
            x, y = next(loader)
            train_step(trainable, x, y)

    # bare side: the same model, data tokens and optimizer, written by hand
    bare = build_model(cfg.model, device, seed=0)
    bare_opt = torch.optim.AdamW(
        bare.parameters(),
        lr=cfg.optim.lr,
        betas=(0.9, 0.95),
        weight_decay=0.1,
        fused=device.type == "cuda",
        foreach=device.type != "cuda",
    )
    tokens = torch.from_numpy(dataset.sample(0, dataset.num_tokens - 2).astype("int64")).to(device)
    gen = torch.Generator().manual_seed(0)

    def bare_steps(n: int) -> None:
        for _ in range(n):
            starts = torch.randint(0, tokens.numel() - a.seq_len - 1, (a.batch,), generator=gen)
            idx = starts[:, None].to(device) + torch.arange(a.seq_len + 1, device=device)
            batch = tokens[idx]
            with autocast:
                logits = bare(batch[:, :-1])
                loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(bare.parameters(), 1.0)
            bare_opt.step()
            bare_opt.zero_grad(set_to_none=True)

    def timed(fn, n: int) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(n)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return n / (time.perf_counter() - t0)

    plait_steps(2)  # warm-up: allocator, kernels, prefetch thread
    bare_steps(2)
    plait_rates, bare_rates = [], []
    for r in range(a.rounds):
        # alternate which side goes first so neither always runs on a warmer machine
        order = [(plait_steps, plait_rates), (bare_steps, bare_rates)]
        for fn, rates in order if r % 2 == 0 else order[::-1]:
            rates.append(timed(fn, a.steps))
    loader.close()

    tokens_per_step = a.batch * a.seq_len
    plait_rate, bare_rate = statistics.median(plait_rates), statistics.median(bare_rates)
    result = {
        "device": device_info(device).name,
        "preset": a.preset,
        "params": cfg.model.num_params(),
        "seq_len": a.seq_len,
        "batch": a.batch,
        "precision": "bf16 autocast" if autocast.__class__.__name__ == "autocast" else "fp32",
        "plait_tokens_per_s": plait_rate * tokens_per_step,
        "bare_tokens_per_s": bare_rate * tokens_per_step,
        "ratio": plait_rate / bare_rate,
        "rounds": a.rounds,
        "steps_per_round": a.steps,
        "torch": torch.__version__,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"{result['device']}  {a.preset} ({result['params'] / 1e6:.1f}M)  seq {a.seq_len} x batch {a.batch}")
    print(f"plait {result['plait_tokens_per_s']:,.0f} tok/s   bare loop {result['bare_tokens_per_s']:,.0f} tok/s")
    print(f"ratio plait / bare = {result['ratio']:.3f}  (goal >= 0.98; written to {a.out})")


if __name__ == "__main__":
    main()
