"""The training loop: load -> loop { step, log, eval, save } -> sample.

Run it as ``plait train [CONFIG] [--section.key=value ...]`` or ``python -m plait.train`` (torchrun too).
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from plait.checkpoint import (
    CheckpointManager,
    TrainState,
    checkpoint_dir,
    list_checkpoints,
    newest_first,
    read_meta,
    scan_checkpoints,
    step_of,
)
from plait.compile import CompileMonitor
from plait.config import Config, to_dict, to_toml
from plait.data import TokenDataset, TokenLoader, ensure_prepared, eos_id, load_tokenizer, unigram_entropy
from plait.errors import ConfigError, PlaitError
from plait.generate import generate
from plait.guards import Guard
from plait.hardware import device_info, memory_stats
from plait.health import run_health_check
from plait.lifecycle.finetune import apply_finetune
from plait.lifecycle.tracking import RunLineage
from plait.metrics import MetricsLogger, console, warn
from plait.model import ModelArgs, Transformer
from plait.optim import build_optimizer, build_scheduler
from plait.parallel import DistEnv, Meshes, ParallelDims, init_distributed, validate_layout
from plait.parallel.env import init_single_process, restart_count, shutdown
from plait.parallel.parallelize import materialize, parallelize
from plait.parallel.pipeline import Pipeline, build_pipeline, pipeline_forward_backward
from plait.plot import write_run_plot
from plait.stop import Stopped, StopRequest
from plait.storage import Location, is_remote


def build_model(args: ModelArgs, device: torch.device, seed: int) -> Transformer:
    """A single-process model: allocate on the meta device (no memory, no time), then materialise and
    initialise on `device`."""
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device=device)
    model.init_weights(seed)
    return model


IGNORE_INDEX = -100  # a target that is not scored (a fine-tuning prompt's tokens): the loader writes it


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-token loss over the scored positions (targets other than IGNORE_INDEX); logits (B, T, V) are
    upcast to fp32 first. Under tensor parallelism the logits are vocabulary shards and this runs inside
    `loss_parallel`."""
    return F.cross_entropy(
        logits.flatten(0, 1).float(), targets.flatten(0, 1), ignore_index=IGNORE_INDEX, reduction=reduction
    )


class TokenLoss:
    """The training loss of one micro-batch: its summed cross-entropy times `scale`, which each step sets
    (`for_step`) so that the step's gradient is that of the mean over every scored target token of the
    global batch: whatever the micro-batch size, the data-parallel degree or the pipeline, and however the
    masked (unscored) tokens fall. A micro-batch with no scored token contributes 0, not NaN."""

    def __init__(self):
        self.scale = 1.0

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return cross_entropy(logits, targets, reduction="sum") * self.scale

    def for_step(self, targets: torch.Tensor, meshes: Meshes, num_micro: int) -> None:
        """scale = dp x m / N: N scored tokens in the global batch (one all-reduce of a count over the
        data-parallel ranks); the gradient reduction averages over the dp ranks and the pipeline schedule
        over its m micro-batches (m = 1 for gradient accumulation, which sums), so both are undone here."""
        count = (targets != IGNORE_INDEX).sum().to(torch.float64)
        if meshes.dims.dp > 1:
            dist.all_reduce(count, group=meshes.batch.get_group())
        self.scale = meshes.dims.dp * num_micro / max(count.item(), 1.0)


def autocast_context(cfg: Config, device: torch.device, fsdp: bool = False):
    """bf16 autocast where requested (or 'auto' on a device with native bf16), else nothing. Under FSDP
    its mixed-precision policy casts the parameters instead."""
    mode = cfg.train.mixed_precision
    if not fsdp and (mode == "bf16" or (mode == "auto" and device_info(device).bf16_native)):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@dataclass
class Trainable:
    """Everything one optimizer step touches on this rank: the model (or this rank's pipeline stages),
    optimizers and LR schedules (one per part), the meshes, and the contexts of the step."""

    cfg: Config
    device: torch.device
    parts: list[nn.Module]
    optimizers: list[torch.optim.Optimizer]
    schedulers: list
    meshes: Meshes  # one rank's share of the layout; a lone process is a mesh of size 1
    pipeline: Pipeline | None = None
    loss_fn: TokenLoss = field(default_factory=TokenLoss)  # also the pipeline schedule's

    @property
    def model(self) -> nn.Module:
        return self.parts[0]

    @property
    def fsdp(self) -> bool:
        return self.meshes.dims.fsdp_enabled

    def autocast(self):
        return autocast_context(self.cfg, self.device, self.fsdp)

    def loss_context(self):
        return loss_parallel() if self.meshes.dims.tp > 1 else contextlib.nullcontext()

    def parameters(self) -> list[nn.Parameter]:
        return [p for part in self.parts for p in part.parameters()]


def build_trainable(cfg: Config, device: torch.device, meshes: Meshes | None = None) -> Trainable:
    """Build the model on meta, parallelise it from outside (or split it into pipeline stages), allocate,
    initialise like the single-process model, and attach optimizers. Without `meshes`, this process alone:
    a mesh of size 1 (a process group of one is set up if there is none), through the same path."""
    if meshes is None:
        init_single_process(device, cfg.parallel.timeout_s)
        meshes = Meshes.build(ParallelDims.from_config(cfg.parallel, dist.get_world_size()), device.type)
    loss_fn = TokenLoss()
    if meshes.dims.pp > 1:
        pipeline = build_pipeline(cfg.model, meshes, cfg, device, loss_fn)
        parts = pipeline.parts
    else:
        with torch.device("meta"):
            model = Transformer(cfg.model)
        parallelize(model, meshes, cfg, device)
        materialize(model, cfg, device)
        parts, pipeline = [model], None
    apply_finetune(cfg, parts, meshes)  # finetune.init_from weights; LoRA adapters on a frozen base
    optimizers = [build_optimizer(part, cfg.optim, device) for part in parts]
    schedulers = [build_scheduler(opt, cfg.optim, cfg.train.steps) for opt in optimizers]
    return Trainable(cfg, device, parts, optimizers, schedulers, meshes, pipeline, loss_fn)


@dataclass
class StepResult:
    loss: torch.Tensor  # mean loss over the global batch (a 0-d tensor: no device sync)
    grad_norm: torch.Tensor
    stepped: bool = True  # False when should_step withheld the update


def train_step(
    t: Trainable,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    should_step: Callable[[torch.Tensor, torch.Tensor], bool] | None = None,
) -> StepResult:
    """One optimizer step over this rank's batch: micro-batches (gradient accumulation or the pipeline
    schedule), the global gradient norm and clipping, the optimizer and LR schedule.

    should_step(loss, grad_norm), given the global values, may withhold the update (plait.guards): the
    gradients are then dropped and neither the optimizer nor the LR schedule moves."""
    t.loss_fn.for_step(targets, t.meshes, t.pipeline.num_microbatches if t.pipeline is not None else 1)
    with t.loss_context(), t.autocast():
        if t.pipeline is not None:
            loss = pipeline_forward_backward(t.pipeline, inputs, targets, t.meshes.pp.get_group())
        else:
            loss = _accumulate(t, inputs, targets)
    norm = clip_grad_norm(t.parameters(), t.cfg.train.grad_clip, t.meshes)
    if t.meshes.dims.dp > 1:
        # Each data-parallel rank holds dp x its share of the global token mean: sum, divide. (gloo has no AVG.)
        dist.all_reduce(loss, group=t.meshes.batch.get_group())
        loss = loss / t.meshes.dims.dp
    stepped = should_step is None or should_step(loss, norm)
    for opt, sched in zip(t.optimizers, t.schedulers, strict=True):
        if stepped:
            opt.step()
            sched.step()
        opt.zero_grad(set_to_none=True)
    return StepResult(loss, norm, stepped)


def _accumulate(t: Trainable, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    micro = t.cfg.train.micro_batch_size or inputs.shape[0]
    num_micro = inputs.shape[0] // micro
    total = torch.zeros((), device=inputs.device)
    for i, (x, y) in enumerate(zip(inputs.chunk(num_micro), targets.chunk(num_micro), strict=True)):
        if t.fsdp:  # reduce-scatter once, after the last micro-batch (or after each: sharded accumulation)
            t.model.set_requires_gradient_sync(i == num_micro - 1 or t.cfg.parallel.fsdp_reduce_every_micro_batch)
        loss = t.loss_fn(t.model(x), y)
        loss.backward()
        total += _local(loss.detach())
    return total


def _local(x: torch.Tensor) -> torch.Tensor:
    return x.full_tensor() if isinstance(x, DTensor) else x


def clip_grad_norm(params: list[nn.Parameter], max_norm: float, meshes: Meshes) -> torch.Tensor:
    """Global L2 norm of all gradients, clipped to max_norm (0: measure only).

    Communication plan: each rank sums the squares of its local gradient shards, grouped by which mesh
    axes the gradient is sharded over; each group's sum is all-reduced over exactly those axes (a
    replicated gradient is counted once, not once per replica), and pipeline stages, which hold disjoint
    parameters, are summed over the pp axis. One scalar all-reduce per group and axis.
    Under TP, autograd leaves some gradients in another placement than their parameter: sequence-parallel
    norm weights get Partial (unreduced) gradients, the vocabulary-sharded embedding a Replicate one. They
    are first brought to the parameter's placement (an all-reduce of the small norm gradients; a local
    slice of the embedding's), so the norm counts each element once and the optimizer sees plain shards.
    """
    for p in params:
        if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
            p.grad = p.grad.redistribute(p.device_mesh, p.placements)
    grads = [p.grad for p in params if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    groups: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        if isinstance(g, DTensor):
            # Any placement that is neither replicated nor partial splits the tensor (Shard, and the
            # _StridedShard FSDP2 uses on top of TP, for which is_shard() is False).
            axes = tuple(i for i, pl in enumerate(g.placements) if not (pl.is_replicate() or pl.is_partial()))
            groups.setdefault((g.device_mesh, axes), []).append(g.to_local())
        else:
            groups.setdefault((None, ()), []).append(g)
    squared = torch.zeros((), device=device, dtype=torch.float64)
    for (mesh, axes), tensors in groups.items():
        # fp64 accumulation: torch's fp32 CPU norm of a 4096 x 64 gradient was seen 4e-5 off.
        part = torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float64)).square().sum()
        for axis in axes:
            dist.all_reduce(part, group=mesh.get_group(axis))
        squared = squared + part
    if meshes.dims.pp > 1:
        dist.all_reduce(squared, group=meshes.pp.get_group())
    norm = squared.sqrt().float()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
    return norm


@torch.no_grad()
def evaluate(t: Trainable, dataset: TokenDataset) -> float:
    """Mean loss over the first eval.num_batches global batches of the validation split (the same every
    time), averaged over data-parallel ranks."""
    cfg = t.cfg
    dp_rank, dp = t.meshes.dp_rank, t.meshes.dims.dp
    loader = TokenLoader(
        dataset,
        seq_len=cfg.data.seq_len,
        global_batch_size=cfg.train.global_batch_size,
        dp_rank=dp_rank,
        dp_degree=dp,
        shuffle=False,
        device=t.device,
        prefetch=0,
    )
    for part in t.parts:
        part.eval()
    losses = []
    batches = min(cfg.eval.num_batches, max(1, loader.steps_per_epoch))
    with t.loss_context(), t.autocast():
        for _, (x, y) in zip(range(batches), loader, strict=False):
            if t.pipeline is not None:
                out: list[torch.Tensor] | None = [] if t.pipeline.has_last else None
                kwargs = {"target": y, "losses": out} if t.pipeline.has_last else {}
                t.pipeline.schedule.eval(*([x] if t.pipeline.has_first else []), **kwargs)
                loss = torch.stack([_local(v).float() for v in out]).mean() if out else torch.zeros((), device=x.device)
                dist.all_reduce(loss, group=t.meshes.pp.get_group())
            else:
                loss = _local(cross_entropy(t.model(x), y))
            losses.append(loss)
    for part in t.parts:
        part.train()
    mean = torch.stack(losses).mean()
    if dp > 1:
        dist.all_reduce(mean, group=t.meshes.batch.get_group())
        mean = mean / dp
    return mean.item()


def prepare_run_dir(cfg: Config, is_main: bool = True) -> list[Location]:
    """Refuse to mix runs: a run directory with checkpoints is resumed only by the same model shape.

    Returns the checkpoints to resume from, newest first (empty for a fresh start): the first is the newest
    that looks loadable; damaged newer ones are reported and left on disk. With run.overwrite the old
    outputs are moved aside to <run>.old-<time>, never deleted.
    """
    run_dir = cfg.run_dir
    complete, damaged = scan_checkpoints(checkpoint_dir(cfg))
    if cfg.run.overwrite and (complete or damaged):
        if cfg.checkpoint.dir:
            raise ConfigError(
                f"run.overwrite=true moves {run_dir} aside, but the checkpoints in checkpoint.dir="
                f"{cfg.checkpoint.dir} would stay and be resumed; delete them or choose another checkpoint.dir"
            )
        if is_main:
            backup = run_dir.with_name(f"{run_dir.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
            run_dir.rename(backup)
            console.print(f"run.overwrite: previous outputs moved to {backup}")
        return []
    candidates, passed_over = newest_first(complete)
    damaged += passed_over
    newest = step_of(candidates[0]) if candidates else -1
    for path, why in sorted(damaged, key=lambda d: step_of(d[0])):
        if is_main and step_of(path) > newest:
            warn(
                f"checkpoint {path} is damaged ({why}); left as it is, "
                + (f"resuming from {candidates[0]}" if candidates else "no complete checkpoint to resume from")
            )
    if not candidates and damaged:
        raise ConfigError(
            f"{run_dir} holds only damaged checkpoints ({'; '.join(f'{p.name}: {why}' for p, why in damaged[:3])}); "
            f"they are left as they are: repair or move them, or pass --run.overwrite=true to move the run aside"
        )
    if not candidates:
        if is_main:
            _set_aside_old_metrics(run_dir)
        return []
    meta = read_meta(candidates[0])
    changed = _changed_settings(meta.get("config", {}), to_dict(cfg))
    if meta.get("weights_only"):  # `plait ckpt import`: weights only, no data consumed, nothing else to keep
        changed = [c for c in changed if c.startswith("model.")]
    model = [c for c in changed if c.startswith("model.")]
    if model:
        raise ConfigError(
            f"{run_dir} holds a checkpoint of a different model ({'; '.join(model[:4])}); "
            f"choose another run.name, or pass --run.overwrite=true to move the old run aside"
        )
    unsafe = [c for c in changed if c.startswith(RESUME_UNSAFE)]
    if unsafe:
        raise ConfigError(
            f"resuming {run_dir} with other data or seed would make the run wrong ({'; '.join(unsafe[:4])}); "
            f"keep them as the checkpoint has them, choose another run.name, or pass --run.overwrite=true"
        )
    safe = [c for c in changed if not c.startswith(RESUME_QUIET)]
    if safe and is_main:
        warn(f"resuming {candidates[0].name} with changed settings: {'; '.join(safe)}")
    return candidates


RESUME_UNSAFE = ("data.source", "data.seq_len", "data.shuffle", "run.seed", "finetune.")
"""Settings a resumed run must keep: with another corpus, sequence length, order or adapter set, the restored
data position and optimizer state would belong to a different run. (model.* is refused on its own.)"""
RESUME_QUIET = ("run.overwrite", "data.cache_dir", "data.prefetch", "log.", "parallel.", "compile.cache_dir")
"""Changes that do not touch the numbers (or, for parallel.*, are what resharding is for): not reported."""


def _changed_settings(saved: dict, current: dict) -> list[str]:
    """'section.key: checkpoint A -> now B' for each setting that differs (keys the checkpoint lacks: skipped)."""
    out = []
    for section, values in current.items():
        before = saved.get(section)
        if not isinstance(values, dict) or not isinstance(before, dict):
            continue
        for key, value in values.items():
            if key in before and before[key] != value:
                note = " (the LR schedule now spans the new total)" if f"{section}.{key}" == "train.steps" else ""
                out.append(f"{section}.{key}: checkpoint {before[key]!r} -> now {value!r}{note}")
    return out


def _set_aside_old_metrics(run_dir: Path) -> None:
    """A fresh start in a directory that has metrics (a run that saved no checkpoint): they are moved to
    <run>/previous-<time>/, so the new run's metrics, TensorBoard files and plot start clean."""
    old = [run_dir / n for n in ("metrics.jsonl", "tb", "loss.png") if (run_dir / n).exists()]
    if not old:
        return
    aside = run_dir / f"previous-{time.strftime('%Y%m%d-%H%M%S')}"
    aside.mkdir(parents=True, exist_ok=True)
    for path in old:
        path.rename(aside / path.name)
    console.print(f"fresh start: the earlier metrics of {run_dir} (no checkpoint) moved to {aside}", highlight=False)


def resume(checkpointer: CheckpointManager, candidates: list[Location], t, loader, state, is_main: bool):
    """Load the newest checkpoint that loads; one that fails (on every rank alike) is reported, kept, and the
    previous one tried. Every tensor, the data position and the counters come from the one that loads."""
    for i, path in enumerate(candidates):
        try:
            checkpointer.load(path, t, loader=loader, state=state)
            return path
        except PlaitError as e:
            if i + 1 == len(candidates):
                raise
            if is_main:
                warn(f"{e}; left as it is, trying the previous checkpoint {candidates[i + 1]}")
    return None


def train(cfg: Config) -> dict[str, float]:
    """Train as configured on this process's share of the mesh; returns the final metrics."""
    env = init_distributed(cfg.run.device, cfg.parallel.timeout_s)
    try:
        return _train(cfg, env)
    finally:
        shutdown()


def _train(cfg: Config, env: DistEnv) -> dict[str, float]:
    device = env.device
    dims = ParallelDims.from_config(cfg.parallel, env.world_size)
    validate_layout(cfg, dims)
    torch.manual_seed(cfg.run.seed)
    candidates = prepare_run_dir(cfg, env.is_main)
    cache_dir = Path(cfg.data.cache_dir).expanduser()
    data_dir = ensure_prepared(cfg.data.source, cache_dir, cfg.model.vocab_size) if env.is_main else None
    if env.world_size > 1:  # the main rank tokenises the bundled corpus once; the others wait for it
        box = [str(data_dir) if data_dir else None]
        dist.broadcast_object_list(box, src=0)
        data_dir = Path(box[0])
    train_data, val_data = TokenDataset(data_dir, "train"), TokenDataset(data_dir, "val")
    if train_data.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's vocabulary "
            f"({train_data.vocab_size}); set model.vocab_size={train_data.vocab_size}"
        )
    for split in (train_data, val_data):  # fail now, not at the first batch, if sequences cannot be cut
        split.num_samples(cfg.data.seq_len)

    meshes = Meshes.build(dims, device.type)  # one process: a mesh of size 1
    run_health_check(cfg, env, meshes)  # refuses to start on a rank that computes or communicates wrongly
    compiler = CompileMonitor.start(cfg, device, env.is_main)  # compile caches set up before the first compile
    t = build_trainable(cfg, device, meshes)
    loader = TokenLoader(
        train_data,
        seq_len=cfg.data.seq_len,
        global_batch_size=cfg.train.global_batch_size,
        dp_rank=meshes.dp_rank,
        dp_degree=dims.dp,
        seed=cfg.run.seed,
        shuffle=cfg.data.shuffle,
        device=device,
        prefetch=cfg.data.prefetch,
    )
    state = TrainState()
    run_dir = cfg.run_dir
    checkpointer = CheckpointManager(
        checkpoint_dir(cfg),
        cfg.checkpoint,
        total_steps=cfg.train.steps,
        is_writer=env.is_main,
        config=to_dict(cfg),
        tokenizer_path=data_dir / "tokenizer.json",
    )
    resume_from = resume(checkpointer, candidates, t, loader, state, env.is_main) if candidates else None
    if resume_from is not None:
        if env.is_main:
            console.print(f"resumed from {resume_from} (step {state.step})")
    elif env.is_main and restart_count() > 0:
        console.print(f"restarted from step 0: no complete checkpoint in {checkpoint_dir(cfg)} yet")
    if env.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.toml").write_text(to_toml(cfg))

    info = device_info(device)
    tokens_per_step = cfg.train.global_batch_size * cfg.data.seq_len
    flops_per_step = cfg.model.flops_per_token(cfg.data.seq_len) * tokens_per_step
    if env.is_main:
        console.print(
            f"plait: {cfg.model.num_params() / 1e6:.2f}M parameters, {env.world_size} x {info.name} ({device}) "
            f"as {_layout(dims)}, {cfg.train.steps} steps x {tokens_per_step:,} tokens, data {data_dir}"
        )
    metrics = MetricsLogger(
        run_dir, cfg.log, cfg.train.steps, enabled=env.is_main, name=cfg.run.name, config=to_dict(cfg)
    )
    lineage = RunLineage.start(cfg, env, t, data_dir, resume_from, metrics)  # the lineage registry's record
    lineage.attach(checkpointer)
    final: dict[str, float] = {}
    last_time, last_step = time.perf_counter(), state.step
    guard = Guard(cfg, env, t, checkpointer=checkpointer, loader=loader, metrics=metrics)
    stop = StopRequest(announce=env.is_main).install()  # SIGTERM / SIGINT: checkpoint this step, then stop
    try:
        metrics.advance(state.step)
        while state.step < cfg.train.steps:
            step = state.step + 1
            maybe_inject_fault(env.rank, step)
            inputs, targets = next(loader)
            guard.before_step(step)
            result = train_step(t, inputs, targets, should_step=guard.should_step)
            compiler.check(step)  # static shapes: any compilation after the first step is a recompilation
            if guard.after_step(step, state):  # rolled back: model, data and state.step are a checkpoint's
                last_time, last_step = time.perf_counter(), state.step
                continue
            state.step, state.tokens = step, state.tokens + tokens_per_step
            if metrics.should_log(step, cfg.train.steps):
                loss = result.loss.item()  # read already by guard.should_step: no further device sync
                elapsed = time.perf_counter() - last_time
                final = {
                    "loss": loss,
                    "grad_norm": result.grad_norm.item(),
                    "lr": t.schedulers[0].get_last_lr()[0],
                    "tokens_per_s": (step - last_step) * tokens_per_step / elapsed,
                    "mfu": flops_per_step * (step - last_step) / elapsed / (info.peak_flops * env.world_size),
                    "tokens": state.tokens,
                    **memory_stats(device),
                    **compiler.metrics(),
                }
                metrics.log(step, final)
                last_time, last_step = time.perf_counter(), step
            if cfg.eval.every_steps and (step % cfg.eval.every_steps == 0 or step == cfg.train.steps):
                with compiler.expect("evaluation"):  # no_grad: compiled once more, the first time only
                    final["val_loss"] = evaluate(t, val_data)
                metrics.log(step, {"loss": final["val_loss"]}, prefix="val")
                if env.is_main:
                    write_run_plot(run_dir)  # runs/<name>/loss.png, refreshed at each evaluation
                lineage.monitor(step)  # eval.suite's behavioural assertions, if any
                last_time = time.perf_counter()  # evaluation time is not training throughput
            saved = checkpointer.maybe_save(step, t, loader=loader, state=state, stop_requested=stop.requested)
            lineage.checkpoint(step, saved, final)  # weights hash (and a LoRA run's adapter) of a save begun now
            if saved:
                metrics.log(step, saved, prefix="checkpoint")
                last_time = time.perf_counter()  # checkpoint time is not training throughput
            metrics.advance(step)
            if checkpointer.stopped_at:
                break
    finally:
        stop.restore()
        guard.close()
        saved = checkpointer.close()  # waits for the save in flight and publishes it
        if saved:
            metrics.log(state.step, saved, prefix="checkpoint")
        metrics.close()
        loader.close()
        if env.is_main:
            with contextlib.suppress(Exception):  # a picture never turns a run into a failure
                write_run_plot(run_dir)
    if checkpointer.stopped_at:
        _stopped(cfg, stop.signal_name or "a signal on another rank", checkpointer.stopped_at, env.is_main)
    if checkpointer.final_lost:  # trained, but a restart would redo work: not a success
        if not env.is_main:
            raise PlaitError("")  # the main rank says it
        try:
            newest = list_checkpoints(checkpoint_dir(cfg))
            where = str(newest[-1]) if newest else "none"
        except PlaitError:
            where = f"unknown ({checkpoint_dir(cfg)} cannot be listed now)"
        raise PlaitError(
            f"{checkpointer.final_lost}. Training reached step {state.step}; the newest complete checkpoint is "
            f"{where}. {'Fix the storage (is the server up?)' if is_remote(checkpoint_dir(cfg)) else 'Free space'} "
            f"and rerun the same command to resume from it"
        )
    lineage.finish(final)
    if env.is_main:
        if not final:
            console.print(f"run {run_dir} already finished at step {state.step}; nothing to train")
        with torch.compiler.set_stance("force_eager"):  # sampling changes shapes every token
            _report(cfg, t.model if env.world_size == 1 and not t.fsdp else None, data_dir, final, device)
    return final


def _stopped(cfg: Config, why: str, step: int, is_main: bool) -> None:
    """The end of a run stopped on request: exit EXIT_STOPPED if this step's checkpoint is there, else an
    error that says so (resuming would then redo the steps since the newest checkpoint). The main rank
    says it; the others exit the same way, silently."""
    if not is_main:
        raise Stopped("")
    newest = list_checkpoints(checkpoint_dir(cfg))
    if newest and step_of(newest[-1]) == step:
        raise Stopped(
            f"stopped by {why} at step {step}/{cfg.train.steps}; checkpoint {newest[-1]} written. Run the same "
            f"command to resume from it"
        )
    raise PlaitError(
        f"stopped by {why} at step {step}, but its checkpoint could not be written (see the warning above); the "
        f"newest complete checkpoint is {newest[-1] if newest else 'none'}"
    )


def maybe_inject_fault(rank: int, step: int) -> None:
    """Fault injection for resilience tests: PLAIT_FAULT_KILL="RANK:STEP[,RANK:STEP...]" kills a rank (hard
    exit, as a lost machine would) when it is about to run STEP. The i-th entry fires in elastic attempt i
    (the first run is attempt 0), so one run can lose several ranks in turn and still finish."""
    spec = os.environ.get("PLAIT_FAULT_KILL")
    if not spec:
        return
    kills = parse_fault_kills(spec)
    attempt = restart_count()
    if attempt < len(kills) and kills[attempt] == (rank, step):
        print(f"plait: fault injection: killing rank {rank} at step {step}", file=sys.stderr, flush=True)
        os._exit(137)


def parse_fault_kills(spec: str) -> list[tuple[int, int]]:
    try:
        kills = [tuple(int(x) for x in item.split(":")) for item in spec.split(",")]
    except ValueError:
        kills = []
    if not kills or any(len(k) != 2 or min(k) < 0 for k in kills):
        raise ConfigError(f"PLAIT_FAULT_KILL={spec!r}: expected RANK:STEP[,RANK:STEP...], e.g. '1:5,0:9'")
    return kills  # type: ignore[return-value]


def _layout(dims: ParallelDims) -> str:
    return f"pp={dims.pp} dp_replicate={dims.dp_replicate} dp_shard={dims.dp_shard} tp={dims.tp}"


SAMPLE_FROM_CHECKPOINT_MAX_PARAMS = 2e9
"""After a run whose model is sharded, the main rank samples from the final checkpoint loaded whole on its
device, up to this size; larger runs print the `plait generate` command instead."""


def _report(
    cfg: Config, model: Transformer | None, data_dir: Path, final: dict[str, float], device: torch.device
) -> None:
    if "val_loss" in final:
        baseline = unigram_entropy(data_dir, "val")
        console.print(
            f"validation loss {final['val_loss']:.3f} nats/token "
            f"(unigram entropy of the corpus: {baseline:.3f}; a model that learned nothing scores "
            f"{math.log(cfg.model.vocab_size):.3f})"
        )
    ckpts = list_checkpoints(checkpoint_dir(cfg))
    if ckpts:
        console.print(f"checkpoint: {ckpts[-1]}")
    sampling = cfg.sample.prompt and cfg.sample.max_new_tokens
    if model is None and sampling and ckpts and cfg.model.num_params() <= SAMPLE_FROM_CHECKPOINT_MAX_PARAMS:
        from plait.generate import load_for_generation

        model = load_for_generation(ckpts[-1], str(device))[0]  # the sharded model, whole on this rank
    elif model is None and sampling and ckpts:
        console.print(f"sample with: plait generate {cfg.run_dir}")
    if model is not None and cfg.sample.prompt and cfg.sample.max_new_tokens:
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
