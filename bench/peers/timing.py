"""The peers' shared loop and measurement. The loop is what a user writes by hand: fused AdamW (lr 3e-4, weight
decay 0.1), torch.compile where asked, bf16 autocast where asked, micro-batches with gradient accumulation,
clip 1.0. The measurement: a first step (compilation included), warm-up steps, then timed steps; the median
step, tokens/s and peak memory, printed as one JSON line and written to --json. The peers import it from their
own folder (`python bench/peers/<peer>.py`)."""

import json
import time

import torch


def job_parser():
    """The arguments every MoE peer takes: the shape (bench/gpu_peers.py passes plait's), the job, the device."""
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--expert-width", type=int, default=768)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--rope-theta", type=float, default=1e6)
    p.add_argument("--eps", type=float, default=1e-6)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--mb", type=int, default=4)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--compile", type=int, default=1)
    p.add_argument("--device", default="cuda")
    p.add_argument("--json", default="")
    return p


def measure(step, device: torch.device, *, steps: int, warmup: int, tokens_per_step: int, out: str = "", **fields):
    """Time step() (returns the last micro-batch's loss, scaled by the accumulation); fields go in the record."""

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    started = time.perf_counter()
    step()
    sync()
    first = time.perf_counter() - started
    for _ in range(warmup):
        step()
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, last = [], None
    for _ in range(steps):
        started = time.perf_counter()
        last = step()
        sync()
        times.append(time.perf_counter() - started)
    median = sorted(times)[len(times) // 2]
    record = {
        **fields,
        "tokens_per_s": tokens_per_step / median,
        "step_s": median,
        "first_step_s": first,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
        "loss": float(last.detach()) if last is not None else None,
    }
    print(json.dumps(record))
    if out:
        with open(out, "w") as f:
            f.write(json.dumps(record))
    return record


def train(model, micro_loss, device: torch.device, a, *, autocast: bool, **fields):
    """Train model with micro_loss(forward, generator) -> one micro-batch's mean loss (its random tokens drawn
    from the generator); a: the peer's arguments (compile, mb, accum, seq, steps, warmup, json)."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=device.type == "cuda")
    forward = torch.compile(model) if a.compile else model
    generator = torch.Generator(device=device).manual_seed(0)
    context = torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast)

    def step():
        for _ in range(a.accum):
            with context:
                loss = micro_loss(forward, generator) / a.accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach() * a.accum  # the last micro-batch's loss

    params = sum(x.numel() for x in model.parameters())
    tokens = a.mb * a.accum * a.seq
    return measure(step, device, steps=a.steps, warmup=a.warmup, tokens_per_step=tokens, out=a.json, params=params,
                   **fields)  # fmt: skip
