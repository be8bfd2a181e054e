"""The training loss: next-token cross-entropy normalised by the global number of scored target tokens, so a
step's loss and gradient are the same for every layout and micro-batch size (masked fine-tuning included),
and a user's own loss averaged over micro-batches and data-parallel ranks."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from plait.model.head import IGNORE_INDEX  # a target that is not scored: the loader writes it
from plait.parallel.dims import Meshes


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
    masked (unscored) tokens fall. A micro-batch with no scored token contributes 0, not NaN.

    fused: the model's output is already the summed loss (its fused head, plait.model.head, was given the
    targets) instead of logits."""

    def __init__(self, fused: bool = False):
        self.scale: float | torch.Tensor = 1.0
        self.fused = fused

    def __call__(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        summed = output if self.fused else cross_entropy(output, targets, reduction="sum")
        return summed * self.scale

    def for_step(self, targets: torch.Tensor, meshes: Meshes, num_micro: int, accumulated: int = 1) -> None:
        """scale = dp x cp x m / N: N scored tokens in the global batch (one all-reduce of a count over the
        ranks holding different tokens: data and context parallel); the gradient reduction averages over those
        dp x cp ranks and the pipeline schedule over its m micro-batches (m = 1 for gradient accumulation,
        which sums), so both are undone here."""
        count = (targets != IGNORE_INDEX).sum().to(torch.float64)
        if meshes.dims.dp_cp > 1:
            dist.all_reduce(count, group=meshes.loss.get_group())
        # a 0-d tensor on the device, never read on the host: no sync (the step's one is the guard's)
        self.scale = (meshes.dims.dp_cp * num_micro / count.clamp(min=1.0)).float()  # (as a Python float was)


class MeanLoss:
    """A user's loss, loss_fn(output, targets) -> the mean over its micro-batch: each micro-batch counts
    1/m, so a step's loss (and gradient) is the mean over micro-batches, and the gradient reduction of data
    parallelism (FSDP averages) and the pipeline schedule's (it averages over its m micro-batches) give the
    mean over the global batch."""

    fused = False  # the model returns its output; loss_fn turns it into the loss

    def __init__(self, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        self.loss_fn, self.scale = loss_fn, 1.0

    def __call__(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(output, targets) * self.scale

    def for_step(self, targets: torch.Tensor, meshes: Meshes, num_micro: int, accumulated: int = 1) -> None:
        """num_micro: the pipeline schedule's micro-batches (it averages them itself); accumulated: the
        micro-batches of gradient accumulation, which sums them."""
        del targets, meshes, num_micro
        self.scale = 1.0 / accumulated
