"""Measuring activation memory: the bytes autograd keeps for backward, read from the tensors it saves
(saved-tensor hooks, each storage counted once, parameters and buffers left out) plus what selective
activation checkpointing keeps in torch's own cache, which those hooks do not see.

    with SavedBytes(model) as saved:
        loss = loss_fn(model(x), y)
    saved.total, saved.per_block, saved.blocks   # the whole pass; inside model.layers' blocks; block calls

The planner's memory model is checked against this (tests/parallel/test_plan_vs_runtime.py), and bench/memory.py
prints it per token and layer next to Megatron's formula."""

from __future__ import annotations

from contextlib import ExitStack

import torch
from torch import nn

from plait.core.torch_private import is_checkpoint_wrapper, local_tensor, sac_cached_tensors, view_base

_active: list[SavedBytes] = []  # the measurements running now (selective AC reports its caches to them)


def track_sac_cache(caching_mode) -> None:
    """Called by activation checkpointing for each selective region it opens: its cache is counted."""
    for saved in _active:
        saved._caches.append((caching_mode, saved._in_block))


def _local(t: torch.Tensor) -> torch.Tensor:
    t = local_tensor(t)  # a DTensor's shard
    return getattr(t, "elem", t)  # an AsyncCollectiveTensor wraps the collective's output


HOST_SCALAR_ELEMENTS = 2  # a seed and an offset


class SavedBytes:
    """Bytes saved for backward inside the `with` statement: `total` over the whole pass, `per_block` inside
    the blocks of model.layers (their sum), `blocks` the number of block calls, `devices` the devices the
    counted tensors were on (one: the compute device, or something was left elsewhere), `placed` one
    description (shape, dtype) per device of a tensor saved there.

    Tensors of at most two elements on the CPU are host scalars or placeholders, which CUDA kernels take as
    arguments and may return: the RNG seed and offset of flash attention, say (0-dim), which checkpointing
    caches with the attention's output, or an empty bias (shape (0,)). They are counted, not taken as a sign
    of something left on the host (measured on an H200: selective and full checkpointing of llama3 blocks)."""

    def __init__(self, model: nn.Module | None = None):
        self.model = model
        self.total = self.per_block = self.blocks = 0
        self.devices: set[torch.device] = set()
        self.placed: dict[torch.device, str] = {}
        self._seen: set = set()
        self._caches: list = []
        self._in_block = False
        self._stack = ExitStack()
        if model is not None:  # parameters and buffers are states, not activations
            for t in [*model.parameters(), *model.buffers()]:
                self._seen.add(self._key(_local(t))[0])

    @staticmethod
    def _key(t: torch.Tensor):
        try:
            storage = t.untyped_storage()
            return (storage.data_ptr(), storage.nbytes()), storage.nbytes()
        except (RuntimeError, NotImplementedError):
            return ("id", id(t)), t.numel() * t.element_size()

    def _count(self, tensor: torch.Tensor, in_block: bool) -> None:
        base = view_base(tensor)  # e.g. weight.t() inside F.linear
        if isinstance(base, nn.Parameter):
            return
        key, size = self._key(_local(tensor))
        if key in self._seen:
            return
        self._seen.add(key)
        if self.model is not None and key in self._parameter_storages():
            return  # a parameter used through a view of its local tensor (expert parallelism's experts)
        local = _local(tensor)
        if local.numel() > HOST_SCALAR_ELEMENTS or local.device.type != "cpu":
            self.devices.add(local.device)
            self.placed.setdefault(local.device, f"{tuple(local.shape)} {str(local.dtype).removeprefix('torch.')}")
        self.total += size
        if in_block:
            self.per_block += size

    def _parameter_storages(self) -> set:
        """The storages of the model's parameters as they are now (FSDP swaps in gathered ones for forward)."""
        assert self.model is not None, "measured while a model runs"
        return {self._key(_local(p))[0] for p in self.model.parameters()}

    def _pack(self, tensor):
        self._count(tensor, self._in_block)
        return tensor

    def _enter_block(self, module, args, kwargs):
        self._in_block = True
        self.blocks += 1
        if is_checkpoint_wrapper(module):  # checkpointing keeps its keyword inputs for the recompute (not saved:
            for value in kwargs.values():  # held by its closure), e.g. RETRO's encoded neighbours
                if isinstance(value, torch.Tensor) and value.requires_grad:
                    self._count(value, True)

    def _leave_block(self, *_):
        self._in_block = False

    def __enter__(self) -> SavedBytes:
        self._stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t))
        layers = getattr(self.model, "layers", None) or []
        for block in layers.values() if isinstance(layers, nn.ModuleDict) else layers:
            pre = block.register_forward_pre_hook(self._enter_block, with_kwargs=True)
            post = block.register_forward_hook(self._leave_block)
            self._stack.callback(pre.remove)
            self._stack.callback(post.remove)
        _active.append(self)
        self._stack.callback(_active.remove, self)
        return self

    def __exit__(self, *exc) -> None:
        for mode, in_block in self._caches:
            for tensor in sac_cached_tensors(mode):
                self._count(tensor, in_block)
        self._caches = []
        self._stack.close()
