"""The training loop: load -> loop { step, log, eval, save } -> sample.

Run it as ``plait train [CONFIG] [--section.key=value ...]`` or ``python -m plait.train`` (torchrun too).
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from plait.checkpoint import CheckpointManager, TrainState, list_checkpoints, read_meta
from plait.config import Config, to_dict, to_toml
from plait.data import TokenDataset, TokenLoader, ensure_prepared, eos_id, load_tokenizer, unigram_entropy
from plait.errors import ConfigError
from plait.generate import generate
from plait.hardware import device_info, memory_stats, resolve_device
from plait.metrics import MetricsLogger, console
from plait.model import ModelArgs, Transformer
from plait.optim import build_optimizer, build_scheduler


def build_model(args: ModelArgs, device: torch.device, seed: int) -> Transformer:
    """Allocate on the meta device (no memory, no time), then materialise and initialise on `device`."""
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device=device)
    model.init_weights(seed)
    return model


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss over all positions; logits (B, T, V) are upcast to fp32 first."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


def autocast_context(cfg: Config, device: torch.device):
    """bf16 autocast where requested (or 'auto' on a device with native bf16), else nothing."""
    mode = cfg.train.mixed_precision
    if mode == "bf16" or (mode == "auto" and device_info(device).bf16_native):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@dataclass
class StepResult:
    loss: torch.Tensor  # mean loss over the step's micro-batches (a 0-d tensor: no device sync)
    grad_norm: torch.Tensor


def train_step(
    model, optimizer, inputs, targets, *, num_micro: int, grad_clip: float, autocast
) -> StepResult:
    """One optimizer step over the local batch split into num_micro micro-batches (gradient accumulation)."""
    total = torch.zeros((), device=inputs.device)
    for x, y in zip(inputs.chunk(num_micro), targets.chunk(num_micro), strict=True):
        with autocast:
            loss = cross_entropy(model(x), y) / num_micro
        loss.backward()
        total += loss.detach()
    norm = nn.utils.clip_grad_norm_(
        model.parameters(), grad_clip if grad_clip > 0 else math.inf, foreach=True
    )
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(total, norm)


@torch.no_grad()
def evaluate(model, dataset: TokenDataset, cfg: Config, device, autocast) -> float:
    """Mean loss over the first eval.num_batches batches of the validation split (the same every time)."""
    model.eval()
    loader = TokenLoader(
        dataset,
        seq_len=cfg.data.seq_len,
        global_batch_size=_micro(cfg),
        shuffle=False,
        device=device,
        prefetch=0,
    )
    losses = []
    batches = min(cfg.eval.num_batches, max(1, loader.steps_per_epoch))
    for _, (x, y) in zip(range(batches), loader, strict=False):
        with autocast:
            losses.append(cross_entropy(model(x), y))
    loader.close()
    model.train()
    return torch.stack(losses).mean().item()


def _micro(cfg: Config) -> int:
    return cfg.train.micro_batch_size or cfg.train.global_batch_size


def prepare_run_dir(cfg: Config) -> Path | None:
    """Refuse to mix runs: a run directory with checkpoints is resumed only by the same model shape.

    Returns the checkpoint to resume from (None for a fresh start). With run.overwrite the old outputs are
    moved aside to <run>.old-<time>, never deleted.
    """
    run_dir = cfg.run_dir
    ckpts = list_checkpoints(run_dir / "checkpoints")
    if cfg.run.overwrite and run_dir.exists():
        backup = run_dir.with_name(f"{run_dir.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
        run_dir.rename(backup)
        console.print(f"run.overwrite: previous outputs moved to {backup}")
        return None
    if not ckpts:
        return None
    saved = read_meta(ckpts[-1]).get("config", {}).get("model", {})
    current = to_dict(cfg)["model"]
    diff = [
        f"model.{k}: checkpoint {saved.get(k)!r} vs now {v!r}"
        for k, v in current.items()
        if saved.get(k) != v
    ]
    if diff:
        raise ConfigError(
            f"{run_dir} holds a checkpoint of a different model ({'; '.join(diff[:4])}); "
            f"choose another run.name, or pass --run.overwrite=true to move the old run aside"
        )
    return ckpts[-1]


def train(cfg: Config) -> dict[str, float]:
    """Train as configured; returns the final metrics. One process for now (the mesh comes next)."""
    device = resolve_device(cfg.run.device)
    torch.manual_seed(cfg.run.seed)
    resume_from = prepare_run_dir(cfg)
    data_dir = ensure_prepared(cfg.data.source, Path(cfg.data.cache_dir).expanduser(), cfg.model.vocab_size)
    train_data, val_data = TokenDataset(data_dir, "train"), TokenDataset(data_dir, "val")
    if train_data.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's vocabulary "
            f"({train_data.vocab_size}); set model.vocab_size={train_data.vocab_size}"
        )
    for split in (train_data, val_data):  # fail now, not at the first batch, if sequences cannot be cut
        split.num_samples(cfg.data.seq_len)

    model = build_model(cfg.model, device, cfg.run.seed)
    optimizer = build_optimizer(model, cfg.optim, device)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.steps)
    loader = TokenLoader(
        train_data,
        seq_len=cfg.data.seq_len,
        global_batch_size=cfg.train.global_batch_size,
        seed=cfg.run.seed,
        shuffle=cfg.data.shuffle,
        device=device,
        prefetch=cfg.data.prefetch,
    )
    state = TrainState()
    run_dir = cfg.run_dir
    checkpointer = CheckpointManager(run_dir / "checkpoints", cfg.checkpoint)
    if resume_from is not None:
        checkpointer.load(
            resume_from, model=model, optimizer=optimizer, scheduler=scheduler, loader=loader, state=state
        )
        console.print(f"resumed from {resume_from} (step {state.step})")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(to_toml(cfg))

    info = device_info(device)
    num_micro = cfg.train.global_batch_size // _micro(cfg)
    tokens_per_step = cfg.train.global_batch_size * cfg.data.seq_len
    flops_per_step = cfg.model.flops_per_token(cfg.data.seq_len) * tokens_per_step
    autocast = autocast_context(cfg, device)
    console.print(
        f"plait: {cfg.model.num_params() / 1e6:.2f}M parameters on {info.name} ({device}), "
        f"{cfg.train.steps} steps x {tokens_per_step:,} tokens, data {data_dir}"
    )
    metrics = MetricsLogger(run_dir, cfg.log, cfg.train.steps)
    final: dict[str, float] = {}
    last_time, last_step = time.perf_counter(), state.step
    try:
        metrics.advance(state.step)
        for step in range(state.step + 1, cfg.train.steps + 1):
            inputs, targets = next(loader)
            result = train_step(
                model,
                optimizer,
                inputs,
                targets,
                num_micro=num_micro,
                grad_clip=cfg.train.grad_clip,
                autocast=autocast,
            )
            scheduler.step()
            state.step, state.tokens = step, state.tokens + tokens_per_step
            if metrics.should_log(step, cfg.train.steps):
                loss = result.loss.item()  # the only device sync of a logged step
                if not math.isfinite(loss):
                    raise RuntimeError(f"loss is {loss} at step {step}; lower optim.lr (now {cfg.optim.lr})")
                elapsed = time.perf_counter() - last_time
                tokens_per_s = (step - last_step) * tokens_per_step / elapsed
                final = {
                    "loss": loss,
                    "grad_norm": result.grad_norm.item(),
                    "lr": scheduler.get_last_lr()[0],
                    "tokens_per_s": tokens_per_s,
                    "mfu": flops_per_step * (step - last_step) / elapsed / info.peak_flops,
                    "tokens": state.tokens,
                    **memory_stats(device),
                }
                metrics.log(step, final)
                last_time, last_step = time.perf_counter(), step
            if cfg.eval.every_steps and (step % cfg.eval.every_steps == 0 or step == cfg.train.steps):
                final["val_loss"] = evaluate(model, val_data, cfg, device, autocast)
                metrics.log(step, {"loss": final["val_loss"]}, prefix="val")
                last_time = time.perf_counter()  # evaluation time is not training throughput
            if checkpointer.should_save(step, cfg.train.steps):
                checkpointer.save(
                    step,
                    model=model,
                    optimizer=optimizer,
                    scheduler=scheduler,
                    loader=loader,
                    state=state,
                    config=to_dict(cfg),
                    tokenizer_path=data_dir / "tokenizer.json",
                )
                last_time = time.perf_counter()
            metrics.advance(step)
    finally:
        metrics.close()
        loader.close()
    if state.step >= cfg.train.steps and last_step == state.step and not final:
        console.print(f"run {run_dir} already finished at step {state.step}; nothing to train")
    _report(cfg, model, data_dir, final)
    return final


def _report(cfg: Config, model: Transformer, data_dir: Path, final: dict[str, float]) -> None:
    if "val_loss" in final:
        baseline = unigram_entropy(data_dir, "val")
        console.print(
            f"validation loss {final['val_loss']:.3f} nats/token "
            f"(unigram entropy of the corpus: {baseline:.3f}; a model that learned nothing scores "
            f"{math.log(cfg.model.vocab_size):.3f})"
        )
    ckpts = list_checkpoints(cfg.run_dir / "checkpoints")
    if ckpts:
        console.print(f"checkpoint: {ckpts[-1]}")
    if cfg.sample.prompt and cfg.sample.max_new_tokens:
        tok = load_tokenizer(data_dir / "tokenizer.json")
        ids = tok.encode(cfg.sample.prompt).ids
        s = cfg.sample
        out = generate(
            model,
            [ids],
            max_new_tokens=s.max_new_tokens,
            temperature=s.temperature,
            top_k=s.top_k,
            top_p=s.top_p,
            eos_id=eos_id(tok),
            seed=cfg.run.seed,
        )
        console.rule("sample")
        print(tok.decode(out[0]), flush=True)
        console.rule()


def main(argv: list[str] | None = None) -> int:
    """`python -m plait.train [CONFIG] [overrides]`: same as `plait train`."""
    from plait.cli import main as cli_main

    return cli_main(["train", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
