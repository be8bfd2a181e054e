"""The training loop: build -> resume -> loop { step, log, eval, save } -> end, with every feature of a run
(guards, lineage, health checks, fine-tuning, fault injection, your own) attached as a plait.engine.callbacks hook.
The loop calls logging (plait.engine.step_metrics), evaluation (.validation) and the checkpointer itself, in
that order, after the callbacks have seen the step; the run's data is wired in plait.engine.inputs.

`Trainer` is the loop itself; `plait.Trainer` (plait.api) is the same with plait's standard features attached,
and `plait train` is a command line over that.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from plait.config import Config, to_dict, to_toml, validate
from plait.core.errors import ConfigError, PlaitError
from plait.core.stop import StopRequest
from plait.core.storage import Location
from plait.data import TokenLoader
from plait.data.samples import SampleLoader
from plait.engine.arguments import check_arguments
from plait.engine.callbacks import Callback, Callbacks
from plait.engine.checkpoint import CheckpointManager, TrainState, checkpoint_dir, list_checkpoints
from plait.engine.core_callbacks import CompileWatch, LockWatch
from plait.engine.expert_balance import ExpertBalance, set_aux_scale
from plait.engine.groups import build_replicas
from plait.engine.inputs import RunData
from plait.engine.loss import IGNORE_INDEX, TokenLoss, cross_entropy
from plait.engine.metrics import MetricsLogger, info, use_console
from plait.engine.plot import write_run_plot
from plait.engine.replicas import Replicas
from plait.engine.retrieval_refresh import IndexRefresh
from plait.engine.rundir import final_checkpoint_lost, inspect_run_dir, raise_stopped, resume
from plait.engine.runlock import RunLock, RunLocked
from plait.engine.step_metrics import StepMetrics
from plait.engine.trainable import Trainable, autocast_context, build_model, build_trainable
from plait.engine.validation import Validation
from plait.model.llama import Transformer
from plait.parallel import DistEnv, Meshes, ParallelDims, init_distributed, validate_layout
from plait.parallel.context import context_shard
from plait.parallel.env import restart_count, shutdown
from plait.parallel.norm import clip_grad_norm, full_value
from plait.parallel.pipeline import pipeline_forward_backward
from plait.parallel.rules import num_micro_batches

__all__ = [  # the loop, and the pieces of a step that benchmarks and tests import from here
    "IGNORE_INDEX", "Trainable", "TokenLoss", "Trainer", "autocast_context", "build_model", "build_trainable",
    "cross_entropy", "train_step",
]  # fmt: skip


ALONE = Replicas()  # a run that is not fault-tolerant: one group, nothing to average across, every step commits


@dataclass
class StepResult:
    loss: torch.Tensor  # mean loss over the global batch (a 0-d tensor: no device sync)
    grad_norm: torch.Tensor
    stepped: bool = True  # False when should_step withheld the update
    committed: bool = True  # False when a fault-tolerant step failed on a group: no group moved (engine.replicas)


def mask_documents(parts: list[nn.Module], eos: int) -> None:
    """data.document_mask: plait's model attends each document of a packed sequence alone (positions from 0)."""
    models = [m for part in parts for m in part.modules() if isinstance(m, Transformer)]
    if not models:
        raise ConfigError(
            "data.document_mask=true applies to plait's model (its attention takes the documents); a model of "
            "your own masks its own: set data.document_mask=false"
        )
    for model in models:
        model.document_eos = eos


def train_step(
    t: Trainable,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    should_step: Callable[[torch.Tensor, torch.Tensor], bool] | None = None,
    replicas: Replicas = ALONE,
) -> StepResult:
    """One optimizer step over this rank's batch: micro-batches (gradient accumulation or the pipeline
    schedule), the gradients averaged over the replica groups (a fault-tolerant run's; one group alone has only
    its own), the global gradient norm and clipping, the optimizer and LR schedule.

    should_step(loss, grad_norm), given the global values, may withhold the update (plait.features.guards): the
    gradients are then dropped and neither the optimizer nor the LR schedule moves. A fault-tolerant step that
    does not commit moves nothing either."""
    inputs, targets = context_shard(t.meshes, inputs, targets)  # cp > 1: this rank's part of each sequence
    pipelined = t.pipeline.num_microbatches if t.pipeline is not None else 1
    t.loss_fn.for_step(targets, t.meshes, pipelined, 1 if t.pipeline is not None else _num_micro(t, inputs))
    set_aux_scale(t.parts, t.meshes, pipelined, t.cfg.train.global_batch_size)  # MoE balancing loss, if any
    with t.loss_context(), t.autocast():
        if t.pipeline is not None:
            loss = pipeline_forward_backward(t.pipeline, inputs, targets, t.meshes.pp.get_group())
        else:
            loss = _accumulate(t, inputs, targets)
    replicas.average_gradients(t.parameters())  # before clipping: every group clips the same average
    norm = clip_grad_norm(t.parameters(), t.cfg.train.grad_clip, t.meshes)
    if t.meshes.dims.dp_cp > 1:
        # Each rank holds dp x cp x its share of the global token mean: sum, divide. (gloo has no AVG.)
        dist.all_reduce(loss, group=t.meshes.loss.get_group())
        loss = loss / t.meshes.dims.dp_cp
    loss = replicas.mean_loss(loss)
    stepped = should_step is None or should_step(loss, norm)
    committed = replicas.commit()
    for opt, sched in zip(t.optimizers, t.schedulers, strict=True):
        if stepped and committed:
            opt.step()
            sched.step()
        opt.zero_grad(set_to_none=True)
    replicas.after_update()  # DiLoCo: at a round's end, the groups' outer step
    return StepResult(loss, norm, stepped, committed)


def _num_micro(t: Trainable, inputs: torch.Tensor) -> int:
    return num_micro_batches(t.cfg.train.micro_batch_size, inputs.shape[0])


def _accumulate(t: Trainable, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    num_micro = _num_micro(t, inputs)
    total = torch.zeros((), device=inputs.device)
    for i, (x, y) in enumerate(zip(inputs.chunk(num_micro), targets.chunk(num_micro), strict=True)):
        if t.fsdp:  # reduce-scatter once, after the last micro-batch (or after each: sharded accumulation)
            sync = i == num_micro - 1 or t.cfg.parallel.fsdp_reduce_every_micro_batch
            cast(FSDPModule, t.model).set_requires_gradient_sync(sync)
        loss = t.loss_fn(t.forward(x, y), y)
        loss.backward()
        total += full_value(loss.detach())
    return total


class Trainer:
    """One training run on this process's share of the mesh (a lone process is a mesh of size 1).

    cfg: the settings (plait.Config); model / parallelize / loss: your own model, parallelisation plan and
    loss (see build_trainable; default: plait's Llama for cfg.model); data / val_data: your own samples
    (plait.data.samples: any sequence or iterable of token sequences or {"input_ids"} dicts; default:
    cfg.data.source); callbacks: plait.Callback instances, called in order after the trainer's own observers
    (core_callbacks: the run-lock check, the compile monitor; the experts' balancing); env: a process group
    already set up (it is then left up), else one from the torchrun environment (or of one process). `fit()`
    trains to cfg.train.steps (resuming the run directory's newest checkpoint) and returns the last logged
    metrics. What a callback may read or call of it is plait.engine.callbacks.RunState."""

    # What a run fills in as it goes: read before it is set, an attribute is missing. env, meshes, t,
    # checkpointer and metrics are RunState's; the others the loop's own.
    env: DistEnv
    meshes: Meshes
    t: Trainable
    loader: TokenLoader | SampleLoader
    checkpointer: CheckpointManager
    metrics: MetricsLogger
    stop: StopRequest
    inputs: RunData
    step_metrics: StepMetrics
    replicas: Replicas
    _callbacks: Callbacks  # the trainer's observers, then yours: this fit()'s
    _RUN_FIELDS = (
        "env", "meshes", "t", "loader", "checkpointer", "metrics", "stop", "inputs", "step_metrics", "replicas",
        "_callbacks",
    )  # fmt: skip

    def __init__(
        self,
        cfg: Config,
        *,
        model: Callable[[], nn.Module] | None = None,
        parallelize: Callable | None = None,
        loss: Callable | None = None,
        data: Iterable | None = None,
        val_data: Iterable | None = None,
        callbacks: Iterable[Callback] = (),
        env: DistEnv | None = None,
    ):
        self.callbacks = check_arguments(model, parallelize, loss, data, val_data, callbacks, env)
        self.cfg, self.model_fn, self.parallelize_fn, self.loss = validate(cfg), model, parallelize, loss
        self.data, self.val_data, self.given_env = data, val_data, env
        self.validation = Validation(self, lambda: self.inputs.val_loaders(self.meshes, self.env.device))
        self._reset()

    @property
    def plait_model(self) -> bool:
        """Whether the model is plait's, built from cfg.model (RunState)."""
        return self.model_fn is None

    def fit(self) -> dict[str, float]:
        """Train to cfg.train.steps, resuming the run directory's newest checkpoint. Called again (after
        raising cfg.train.steps, say), it continues from the checkpoint the last call wrote. Without a given
        process group it sets one up (from the torchrun environment, or of one process) and takes it down."""
        validate(self.cfg)  # again: the settings may have been changed since the Trainer was made
        use_console()  # plait's messages on stderr, unless your application handles the 'plait' logger
        self._reset()
        own = self.given_env is None
        self.env = self.given_env or init_distributed(self.cfg.run.device, self.cfg.parallel.timeout_s)
        try:
            with self._run_lock():
                return self._run()
        finally:
            if own:
                shutdown()

    def _reset(self) -> None:
        """What a run fills in, empty: at the start of each fit() (nothing of an earlier call is reused)."""
        for name in self._RUN_FIELDS:
            self.__dict__.pop(name, None)
        self.data_dir: Path | None = None
        self.resumed_from: Location | None = None
        self.state = TrainState()
        self.final: dict[str, float] = {}
        self.lock: RunLock | None = None  # the run directory's lock, on the main rank while fit() runs
        self._withheld = ""  # why this step's update is withheld (a callback's withhold_step), "" if it is not
        self._rolled_back = False  # this step was rolled back (a callback's roll_back)

    @contextlib.contextmanager
    def _run_lock(self):
        """One run per run directory (plait.engine.runlock): the main rank takes the lock or every rank refuses with
        its holder named, before anything is written; released when the run ends, however it ends."""
        cfg, env = self.cfg, self.env
        lock, refused = RunLock.for_run(cfg), ""
        if env.is_main:
            try:
                lock.acquire(break_lock=cfg.run.break_lock)
            except PlaitError as e:
                refused = str(e)
        if env.world_size > 1:
            box = [refused]
            dist.broadcast_object_list(box, src=0)
            refused = box[0]
        if refused:
            raise RunLocked(refused if env.is_main else "")  # the main rank says it; the others end silently
        self.lock = lock if env.is_main else None
        try:
            yield lock
        finally:
            lock.release()

    def _run(self) -> dict[str, float]:
        cfg, env = self.cfg, self.env
        dims = ParallelDims.from_config(cfg.parallel, env.world_size, cfg.model)
        validate_layout(cfg, dims)
        torch.manual_seed(cfg.run.seed)
        plan = inspect_run_dir(cfg, env.is_main)  # resume, start fresh or move aside: decided, nothing moved yet
        self.inputs = RunData.prepare(cfg, env, self.data, self.val_data)
        self.data_dir = self.inputs.data_dir
        self.meshes = Meshes.build(dims, env.device.type)  # one process: a mesh of size 1
        compile_watch = CompileWatch()
        own = [LockWatch(self.lock), compile_watch, ExpertBalance(), IndexRefresh(self.inputs.live)]  # then yours
        cb = self._callbacks = Callbacks([*own, *self.callbacks], rolled_back=lambda: self._rolled_back)
        cb.on_setup(self)  # compile caches set up; health checks refuse a rank that computes or communicates wrongly
        self._build_model()
        plan.apply(env.is_main)  # every check has passed: now run.overwrite moves the old run aside
        if env.world_size > 1:
            dist.barrier()  # no rank writes into the run directory before it is in place
        self.loader = self.inputs.train_loader(self.meshes, env.device)
        self.checkpointer = CheckpointManager(
            checkpoint_dir(cfg), cfg.checkpoint, total_steps=cfg.train.steps, is_writer=env.is_main,
            config=to_dict(cfg), tokenizer_path=self.data_dir / "tokenizer.json" if self.data_dir else None,
        )  # fmt: skip
        # before resuming: a mode of replica groups may add to the checkpoint's state (DiLoCo's outer momentum)
        self.replicas = build_replicas(cfg, env, self.meshes, self.t, self.loader, self.state, self.data is not None)
        self._resume(plan.candidates)
        self.metrics = MetricsLogger(
            cfg.run_dir, cfg.log, cfg.train.steps, enabled=env.is_main, name=cfg.run.name, config=to_dict(cfg),
            run_id=self.lock.token[:12] if self.lock else "", start_step=self.state.step,
        )  # fmt: skip
        stop = self.stop = StopRequest(announce=env.is_main)
        try:
            cb.on_start(self)
            self.step_metrics = StepMetrics(self, self.loader, compile_watch.monitor)  # the opening line
            self.validation.start()
            stop.install()  # SIGTERM / SIGINT: checkpoint this step, then stop
            try:
                self._loop()
            finally:
                stop.restore()
        finally:
            try:
                cb.close(self)  # the watchdog stops before the final save is waited for
            finally:
                self._close()
        self._finish(stop)
        return self.final

    def _build_model(self) -> None:
        """The model parts, their optimizers and schedules (self.t); the callbacks' on_model between the two.
        data.document_mask: each document of a packed window attended alone."""
        cfg, env, cb = self.cfg, self.env, self._callbacks
        self.t = build_trainable(
            cfg, env.device, self.meshes, model=self.model_fn, parallelize_fn=self.parallelize_fn,
            loss=self.loss, on_model=lambda parts: cb.on_model(self, parts),
        )  # fmt: skip
        if cfg.data.document_mask:
            mask_documents(self.t.parts, self.inputs.eos_id())
            if env.is_main:
                info(self.inputs.document_lengths())
            if self.t.pipeline is not None:
                self.t.pipeline.documents = True

    def _resume(self, candidates) -> None:
        cfg, env = self.cfg, self.env
        if candidates:
            self.resumed_from = resume(self.checkpointer, candidates, self.t, self.loader, self.state, env.is_main)
        if self.resumed_from is not None and env.is_main:
            info(f"resumed from {self.resumed_from} (step {self.state.step})")
        elif env.is_main and restart_count() > 0:
            info(f"restarted from step 0: no complete checkpoint in {checkpoint_dir(cfg)} yet")
        if env.is_main:
            cfg.run_dir.mkdir(parents=True, exist_ok=True)
            (cfg.run_dir / "config.toml").write_text(to_toml(cfg))

    def _loop(self) -> None:
        """Steps until cfg.train.steps: the callbacks see each step (after_step), then the loop logs it,
        evaluates and saves when due (_log_evaluate_save); a step a callback rolled back reaches none of these."""
        cfg, cb, state = self.cfg, self._callbacks, self.state
        tokens_per_step = cfg.train.global_batch_size * cfg.data.seq_len
        while state.step < cfg.train.steps and not self.checkpointer.stopped_at:
            self.replicas.start_step()  # fault-tolerant: this step's groups; a group behind heals from a peer
            step = state.step + 1
            inputs, targets = next(self.loader)
            cb.before_step(self, step)
            self.step_metrics.before_step(step)
            result = train_step(self.t, inputs, targets, self._should_step, self.replicas)
            if not result.committed:
                continue  # a group failed during the step: no group moved, the next quorum tries it again
            state.step, state.tokens = step, state.tokens + tokens_per_step
            self._rolled_back = False
            cb.after_step(self, step, result)  # a callback may roll back: state is then a checkpoint's
            if not self._rolled_back:
                self._log_evaluate_save(step, result)

    def _log_evaluate_save(self, step: int, result: StepResult) -> None:
        """After a step that counts, in this order: its metrics when a log is due (the final metrics), the
        validation loss when an evaluation is due (then the callbacks' after_eval), a checkpoint when a save is
        due or a stop was requested (the loop then ends at this step; the callbacks' after_checkpoint either way)."""
        cb = self._callbacks
        if logged := self.step_metrics.after_step(step, result):
            self.final = logged
        if replicas := self.replicas.record():  # a fault-tolerant step: its groups and samples, every step
            self.metrics.log(step, replicas, prefix="replicas")
        if (evaluated := self.validation.maybe_evaluate(step)) is not None:
            self.final.update(evaluated)
            cb.after_eval(self, step, self.final["val_loss"])
            self.step_metrics.after_eval(step, self.final["val_loss"])
        saved = self.checkpointer.maybe_save(
            step, self.t, loader=self.loader, state=self.state, stop_requested=self.stop.requested
        )
        cb.after_checkpoint(self, step, saved)
        self.step_metrics.after_checkpoint(step, saved)

    def _should_step(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        self._withheld = ""
        self._callbacks.should_step(self, loss, grad_norm)
        return not self._withheld

    def withhold_step(self, why: str) -> None:
        """A callback's should_step: this step's update is not applied (RunState)."""
        self._withheld = self._withheld or why or "withheld"

    def roll_back(self) -> Location | None:
        """A callback's after_step: the newest checkpoint loaded into the run, chosen by the main rank for
        all (an asynchronous save may be publishing a newer one meanwhile); None where there is none yet
        (RunState)."""
        checkpointer = self.checkpointer
        found = list_checkpoints(checkpointer.dir) if self.env.is_main else []
        choice = [found[-1].name if found else None]
        if self.env.world_size > 1:
            dist.broadcast_object_list(choice, src=0)
        if choice[0] is None:
            return None
        path = checkpointer.dir / choice[0]
        checkpointer.load(path, self.t, loader=self.loader, state=self.state)
        self._rolled_back = True
        return path

    def _close(self) -> None:
        if hasattr(self, "replicas"):
            self.replicas.close()
        saved = self.checkpointer.close()  # waits for the save in flight and publishes it
        if saved:
            self.metrics.log(self.state.step, saved, prefix="checkpoint")
        self.metrics.close()
        self.loader.close()
        if self.env.is_main and self.cfg.log.plot:
            with contextlib.suppress(Exception):  # a picture never turns a run into a failure
                write_run_plot(self.cfg.run_dir)

    def _finish(self, stop: StopRequest) -> None:
        cfg, env, checkpointer = self.cfg, self.env, self.checkpointer
        if checkpointer.stopped_at:
            why = stop.signal_name or "a signal on another rank"
            raise_stopped(cfg, why, checkpointer.stopped_at, env.is_main)
        if checkpointer.final_lost:  # the main rank says it; the others end silently
            raise (
                final_checkpoint_lost(cfg, checkpointer.final_lost, self.state.step) if env.is_main else PlaitError("")
            )
        if env.is_main and not self.final:
            info(f"run {cfg.run_dir} already finished at step {self.state.step}; nothing to train")
        self._callbacks.on_end(self, self.final)


if __name__ == "__main__":  # the command line lives above this module: say where, never do nothing
    raise SystemExit("plait: this module is the training loop; run `plait train ...` or `python -m plait train ...`")
