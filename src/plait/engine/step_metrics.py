"""What a run reports as it trains, called by the training loop: the opening line, each logged step's loss,
gradient norm, LR, throughput, MFU, memory and compile counters (the run's final metrics), the validation loss
and checkpoint reports, all written through run.metrics (metrics.jsonl, TensorBoard, W&B, MLflow, the console)
and the loss plot refreshed at evaluations (paced: `PlotRefresh`).

Throughput is measured between logged steps; evaluation, checkpoint saves and rollbacks are not counted."""

from __future__ import annotations

import time
from typing import Any

from plait.config.validate import mixture_shares
from plait.core.hardware import device_info, memory_stats
from plait.data.mixture import source_tokens
from plait.engine.callbacks import RunState
from plait.engine.compile_cache import CompileMonitor
from plait.engine.metrics import info, warn
from plait.engine.muon import describe as describe_optimizer
from plait.engine.optim import schedule_problem
from plait.engine.plot import PLOT_EXTRA, PlotRefresh, can_draw


class StepMetrics:
    """The run's step log, made when the run starts (its opening line said then): `loader` the training
    loader (its passes over the data, a mixture's tokens per source), `compiler` the run's compile monitor."""

    def __init__(self, run: RunState, loader, compiler: CompileMonitor):
        self.run, self.loader, self.compiler = run, loader, compiler
        cfg, env = run.cfg, run.env
        dev = device_info(env.device)
        self.tokens_per_step = cfg.train.global_batch_size * cfg.data.seq_len
        self.flops_per_token, params = _flops_per_token(run)
        self.peak_flops = dev.peak_flops * env.world_size
        if env.is_main:
            source = f"data {run.data_dir}" if run.data_dir else "your data"
            if cfg.data.sources:
                shares = mixture_shares(cfg.data.sources)
                source = "data mixture " + ", ".join(f"{n} {share:.0%}" for n, share in shares.items())
            layout = run.meshes.dims.describe()
            info(
                f"plait: {params / 1e6:.2f}M parameters, {env.world_size} x {dev.name} ({env.device}) as "
                f"{layout}, {cfg.train.steps} steps x {self.tokens_per_step:,} tokens, {source}"
            )
            if cfg.optim.name == "muon":
                info(
                    describe_optimizer(run.t.parts)
                    + (" (this rank's pipeline stages)" if cfg.parallel.pp_degree > 1 else "")
                )
            if problem := schedule_problem(cfg.optim, cfg.train.steps):
                warn(problem)
            if problem := epochs_problem(loader, cfg.train.steps - run.state.step):
                warn(problem)
            if cfg.log.plot and not can_draw():
                info(f"loss.png is not drawn: matplotlib is not installed ({PLOT_EXTRA})")
        self.plot = PlotRefresh()
        self._mark(run.state.step)
        run.metrics.advance(run.state.step)

    def _mark(self, step: int) -> None:
        self.last_time, self.last_step, self.next_step = time.perf_counter(), step, step + 1

    def before_step(self, step: int) -> None:
        if step != self.next_step:  # rolled back since the last step: the clock starts again here
            self._mark(step - 1)

    def after_step(self, step: int, result) -> dict[str, float] | None:
        """A step that counts: its metrics logged when due, and returned (the run's final metrics), else None."""
        run, logged = self.run, None
        if run.metrics.should_log(step, run.cfg.train.steps):
            elapsed, steps = time.perf_counter() - self.last_time, step - self.last_step
            tokens_per_s = steps * self.tokens_per_step / elapsed
            logged = {
                "loss": result.loss.item(),  # read already by the guard's should_step: no further device sync
                "grad_norm": result.grad_norm.item(),
                "lr": run.t.schedulers[0].get_last_lr()[0],
                "tokens_per_s": tokens_per_s,
                "mfu": self.flops_per_token * tokens_per_s / self.peak_flops,
                "tokens": run.state.tokens,
                **{f"tokens_{name}": n for name, n in source_tokens(self.loader).items()},  # a mixture's sources
                **memory_stats(run.env.device),
                **self.compiler.metrics(),
            }  # fmt: skip
            run.metrics.log(step, logged)
            self._mark(step)
        self.next_step = step + 1
        run.metrics.advance(step)
        return logged

    def after_eval(self, step: int, val_loss: float) -> None:
        run = self.run
        run.metrics.log(step, {"loss": val_loss}, prefix="val")
        if run.env.is_main and run.cfg.log.plot and self.plot.due():
            self.plot.draw(run.cfg.run_dir)  # runs/<name>/loss.png; the trainer draws the last one at the end
        self.last_time = time.perf_counter()  # evaluation time is not training throughput

    def after_checkpoint(self, step: int, saved: dict[str, Any]) -> None:
        if saved:
            self.run.metrics.log(step, saved, prefix="checkpoint")
            self.last_time = time.perf_counter()  # checkpoint time is not training throughput


def _flops_per_token(run: RunState) -> tuple[float, int]:
    """(training FLOPs per token, parameters): plait's model counts attention too; another model 6 N."""
    if run.plait_model:
        return run.cfg.model.flops_per_token(run.cfg.data.seq_len), run.cfg.model.num_params()
    params = sum(p.numel() for p in run.t.parameters())  # DTensor numel is the global size
    return 6.0 * params, params


EPOCHS_WARNED = 4.0  # more passes over the same sequences than this: a small corpus for the run


def epochs_problem(loader, steps: int) -> str | None:
    """A warning when the steps still to run would pass over the training sequences more than EPOCHS_WARNED
    times (a mixture: its sources together)."""
    windows, batch = getattr(loader, "num_windows", 0), getattr(loader, "global_batch_size", 0)
    if not windows or not batch or steps <= 0:
        return None
    epochs = steps * batch / windows
    if epochs <= EPOCHS_WARNED:
        return None
    return (
        f"the run passes over its training data {epochs:.1f} times ({steps:,} steps x {batch} sequences, "
        f"{windows:,} sequences in the corpus): expect the validation loss to rise as it memorises; prepare "
        f"more data, or lower train.steps to about {int(EPOCHS_WARNED * windows / batch):,}"
    )
