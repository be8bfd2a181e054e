"""The learned retriever's index through a run (model.retrieval_learned; plait.model.retrieval_learned,
plait.data.retrieval_live): a fresh run sets the encoder's table to the database's lexical encoder and indexes the
database with it before the first step; every model.retrieval_refresh_steps = N steps the table's values are
snapshotted at the end of the step and indexed on a background thread, and that index is searched from the end of
the step N // 2 (at least 1) steps later: the loop waits for the build only if it takes longer than that.

The schedule is fixed by the step numbers alone, so the neighbours every step reads do not depend on how fast the
background build runs, and the snapshots are buffers of the model (index_table, pending_table, index_steps), in
every checkpoint: a resumed run rebuilds the same two indexes and reads the same neighbours as the uninterrupted
run (the training loader reads batch by batch for this: plait.engine.inputs, prefetch 0)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from plait.data.retrieval_live import LiveIndex
from plait.engine.callbacks import Callback, RunState
from plait.engine.metrics import info
from plait.model.retrieval import whole
from plait.model.retrieval_learned import LearnedRetriever


def install_lag(refresh_steps: int) -> int:
    """Steps from a snapshot to the step whose end swaps its index in (the build's time in the background)."""
    return max(1, refresh_steps // 2)


def learned_retriever(parts: list[nn.Module]) -> LearnedRetriever | None:
    return next((m for part in parts for m in part.modules() if isinstance(m, LearnedRetriever)), None)


def local(buffer: torch.Tensor) -> torch.Tensor:
    """A buffer as this rank holds it: under tensor parallelism a replicated DTensor, whose local tensor is whole
    (FSDP leaves buffers unsharded)."""
    return buffer.to_local() if isinstance(buffer, DTensor) else buffer


@torch.no_grad()
def set_whole(param: torch.Tensor, full: torch.Tensor) -> None:
    """Set a parameter, sharded or not, to a value every rank holds whole (each rank keeps its own shard of it)."""
    if isinstance(param, DTensor):
        full = distribute_tensor(full.to(param.device, param.dtype), param.device_mesh, param.placements,
                                 src_data_rank=None)  # fmt: skip
    param.copy_(full)


class IndexRefresh(Callback):
    """The learned retriever's index: built at the start, refreshed in the background (see the module docstring)."""

    def __init__(self, live: LiveIndex | None) -> None:
        self.live = live  # None: the run has no learned retriever (RunData.live), and this does nothing
        self.retriever: LearnedRetriever | None = None

    def on_start(self, run: RunState) -> None:
        if self.live is None:
            return
        self.retriever = r = learned_retriever(run.t.parts)
        assert r is not None, "model.retrieval_learned without a learned retriever in the model"
        if int(local(r.index_steps)[0]) < 0:  # a fresh model: start from the database's lexical encoder
            from plait.data.lexical import lexical_table

            lexical = torch.from_numpy(lexical_table(self.live.home, self.live.chunk, r.table.shape[1]))
            table = torch.zeros(r.table.shape, dtype=torch.float32)
            table[: len(lexical)] = lexical
            set_whole(r.table, table)
            local(r.index_table).copy_(table)
            local(r.index_steps).copy_(torch.tensor([run.state.step, -1]))
        self._sync(r)
        if run.env.is_main:
            every = run.cfg.model.retrieval_refresh_steps
            info(
                f"learned retriever: {self.live.stored:,} database chunks indexed with its encoder (from step "
                f"{int(local(r.index_steps)[0])}), again every {every} steps in the background, each index searched "
                f"from {install_lag(every)} steps after its snapshot"
            )

    def _sync(self, r: LearnedRetriever) -> None:
        """The live index as the buffers say (at the start, or after a rollback loaded others)."""
        assert self.live is not None
        current, pending = (int(s) for s in local(r.index_steps))
        self.live.start(current, local(r.index_table).float().cpu().numpy())
        self.live.pending = None
        if pending >= 0:
            self.live.submit(pending, local(r.pending_table).float().cpu().numpy())

    def after_step(self, run: RunState, step: int, result: Any) -> None:
        r, live = self.retriever, self.live
        if r is None or live is None:
            return
        steps, pending_table = local(r.index_steps), local(r.pending_table)
        current, pending = (int(s) for s in steps)
        assert live.current is not None
        if live.current[0] != current or (live.pending is None) != (pending < 0):  # rolled back to a checkpoint
            self._sync(r)
        every = run.cfg.model.retrieval_refresh_steps
        if pending >= 0 and step >= pending + install_lag(every):
            waited = live.install()
            local(r.index_table).copy_(pending_table)
            steps.copy_(torch.tensor([pending, -1]))
            if waited > 0.05 and run.env.is_main:
                info(f"step {step}: waited {waited:.2f} s for the learned retriever's index of step {pending}")
        if step % every == 0:
            snapshot = whole(r.table.detach()).float()  # under FSDP every rank gathers it, at the same step
            pending_table.copy_(snapshot)
            steps[1] = step
            live.submit(step, np.asarray(snapshot.cpu()))

    def close(self, run: RunState) -> None:
        if self.live is not None:
            self.live.close()
