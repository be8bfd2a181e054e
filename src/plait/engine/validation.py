"""Validation loss during training: the mean loss over the first eval.num_batches batches of the validation
split (the same batches every time), every eval.every_steps steps and at the last step, measured when the
training loop asks (Validation.maybe_evaluate). How many of the split's tokens that is goes with it
(val/scored_tokens of val/heldout_tokens): the console says `val 4.520 (2,048 of 61,440 held-out tokens)`."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from plait.data import unigram_entropy
from plait.data.remote import is_remote_source
from plait.engine.callbacks import RunState
from plait.engine.loss import IGNORE_INDEX, MeanLoss, cross_entropy
from plait.engine.metrics import warn
from plait.parallel.context import context_shard
from plait.parallel.norm import full_value
from plait.parallel.pipeline import step_kwargs


@torch.no_grad()
def evaluate(t, loader, batches: int) -> float:
    """Mean loss of a Trainable over the first `batches` global batches of a validation loader, averaged
    over data- and context-parallel ranks."""
    for part in t.parts:
        part.eval()
    losses = []
    with t.loss_context(), t.autocast():
        for _, (x, y) in zip(range(batches), loader, strict=False):
            x, y = context_shard(t.meshes, x, y)
            if t.pipeline is not None:
                out: list[torch.Tensor] | None = [] if t.pipeline.has_last else None
                kwargs = step_kwargs(t.pipeline, y, out, x)
                t.pipeline.schedule.eval(*([x] if t.pipeline.has_first else []), **kwargs)
                kept = [full_value(v).float() for v in out or []]  # the last stage's micro-batch losses
                loss = torch.stack(kept).mean() if kept else torch.zeros((), device=x.device)
                dist.all_reduce(loss, group=t.meshes.pp.get_group())
            elif isinstance(t.loss_fn, MeanLoss):
                loss = full_value(t.loss_fn.loss_fn(t.model(x), y)).float()
            elif t.loss_fn.fused:  # the summed loss of the fused head: no (B, T, vocab) logits here either
                loss = t.forward(x, y) / (y != IGNORE_INDEX).sum().clamp(min=1)
            else:
                loss = full_value(cross_entropy(t.model(x), y))
            losses.append(loss)
    for part in t.parts:
        part.train()
    mean = torch.stack(losses).mean()
    if t.meshes.dims.dp_cp > 1:  # data and context parallel ranks: equal shares of the tokens
        dist.all_reduce(mean, group=t.meshes.loss.get_group())
        mean = mean / t.meshes.dims.dp_cp
    return mean.item()


class Validation:
    """The trainer's validation loss, measured when due by the training loop (maybe_evaluate). `loaders()`
    makes fresh loaders over each source's validation split with its share (RunData.val_loaders; {}: none).
    From start() on, a checkpoint saved at a step with an evaluation records its loss (checkpoint.keep_best).
    The warning above the unigram baseline is given once per trainer, however many fit() calls."""

    def __init__(self, run: RunState, loaders: Callable[[], dict[str, tuple[Any, float]]]):
        self.run, self.loaders = run, loaders

    def start(self) -> None:
        """A run starts (run.checkpointer exists): its saves describe the evaluation of their step."""
        self._evaluated: tuple[int, float] | None = None
        self.run.checkpointer.describers.append(self._describe)

    def _describe(self, step: int, t) -> dict[str, float]:
        return {"val_loss": self._evaluated[1]} if self._evaluated and self._evaluated[0] == step else {}

    def maybe_evaluate(self, step: int) -> dict[str, float] | None:
        """Every eval.every_steps steps and at the last: the loss of each source's validation split, logged;
        returns what goes into the run's final metrics (val_loss, the total: the sources weighed by their
        share), or None when no evaluation is due (or there is no validation split)."""
        run = self.run
        every, steps = run.cfg.eval.every_steps, run.cfg.train.steps
        if not every or not (step % every == 0 or step == steps) or not (loaders := self.loaders()):
            return None
        losses, total, scored, held, final = {}, 0.0, 0, 0, {}
        for name, (val, share) in loaders.items():  # one corpus, or each source of a mixture
            batches = min(run.cfg.eval.num_batches, max(1, val.steps_per_epoch))
            losses[name] = evaluate(run.t, val, batches)
            total += share * losses[name]
            counted = scored_tokens(val, batches)
            scored, held = scored + counted[0], held + counted[1]
        if len(losses) > 1 or "" not in losses:  # a mixture: each source's loss; the total weighs them by share
            run.metrics.log(step, {f"loss_{name}": loss for name, loss in losses.items()}, prefix="val")
            final.update({f"val_loss_{name}": loss for name, loss in losses.items()})
        if held:  # how much of the held-out split the figure scored: the first windows of each split, in order
            run.metrics.log(step, {"scored_tokens": scored, "heldout_tokens": held}, prefix="val")
            final.update(val_scored_tokens=scored, val_heldout_tokens=held)
        final["val_loss"] = total
        self._evaluated = (step, total)
        if run.env.is_main and (problem := self._above_baseline(total)):
            warn(problem)
        return final

    _baseline: float | None = None  # (None again when unigram_baseline has none: asked once per evaluation)
    _lowest = math.inf
    _warned = False

    def _above_baseline(self, loss: float) -> str | None:
        """Once a run: a warning when the validation loss, having been below the unigram entropy of the
        validation split, rises above it again (a model worse than token frequencies: memorising, or a
        learning rate too high). For one local corpus; a mixture's or a remote corpus's split is not read."""
        run = self.run
        if self._warned or run.data_dir is None:
            return None
        if self._baseline is None:
            self._baseline = unigram_baseline(run.cfg, run.data_dir)
        if self._baseline is None:
            return None
        self._lowest, lowest = min(self._lowest, loss), self._lowest
        if not rose_above(lowest, loss, self._baseline):
            return None
        self._warned = True
        return (
            f"validation loss {loss:.3f} is above the unigram entropy of the validation text ({self._baseline:.3f}): "
            "the model predicts worse than token frequencies would; it is memorising its training data (see the "
            "epochs warning, if any) or optim.lr is too high; keep the checkpoint with the best validation loss "
            "(checkpoint.keep_best=true)"
        )


def scored_tokens(loader, batches: int) -> tuple[int, int]:
    """(target tokens the first `batches` batches of a validation loader score, tokens of its held-out split);
    (0, 0) for a loader that does not count them (fine-tuning's samples). The loader is not shuffled: every
    evaluation scores the same first windows of the split, so two sources whose held-out splits begin with the
    same text score the same windows and show the same loss."""
    dataset = getattr(loader, "dataset", None)
    held = getattr(dataset, "num_tokens", 0)
    if not held or not hasattr(loader, "seq_len"):
        return 0, 0
    windows = min(batches * loader.global_batch_size, loader.num_windows)
    return windows * loader.seq_len, int(held)


def rose_above(lowest: float, loss: float, baseline: float) -> bool:
    """Whether a validation loss that was once below the baseline (`lowest` so far) is now above it."""
    return lowest < baseline < loss


_BASELINES: dict[tuple[str, int], float] = {}


def unigram_baseline(cfg, data_dir) -> float | None:
    """The unigram entropy of the validation split of one local corpus, read once per prepared directory (its
    manifest's mtime in the key) for the run's warning and its end report; None for a mixture (its total
    weighs its sources) or a corpus on S3 (not downloaded for it)."""
    if cfg.data.sources or is_remote_source(cfg.data.source):
        return None
    from pathlib import Path

    manifest = Path(data_dir) / "manifest.json"
    key = (str(Path(data_dir).resolve()), manifest.stat().st_mtime_ns)
    if key not in _BASELINES:
        _BASELINES[key] = unigram_entropy(data_dir, "val")
    return _BASELINES[key]
