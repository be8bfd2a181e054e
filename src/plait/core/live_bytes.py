"""Bytes of tensor storage alive on one device, op by op, and their peak: a CPU's stand-in for the CUDA
allocator's statistics (`torch.cuda.max_memory_allocated`), which `plait fit` reads on a GPU.

Every storage an aten op returns on the device is counted once from when it appears until it is freed (a weak
reference to the storage: the count drops when its last tensor dies); FSDP2's resizing of its gathered
parameters' storages counts too. The peak is taken after every op. What this does not see, and the CUDA
allocator would: a kernel's workspace inside one op, tensors made by compiled code, and the allocator's own
rounding and fragmentation.
"""

from __future__ import annotations

import contextlib
import weakref
from functools import partial

import torch

from plait.core.torch_private import watch_allocations


class LiveBytes:
    """`with LiveBytes(device) as live:` ... `live.current`, `live.peak` (bytes), `live.reset_peak()`."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.current = 0
        self.peak = 0
        self._live: dict[int, tuple[weakref.ref, int]] = {}
        self._stack = contextlib.ExitStack()

    def _here(self, device: torch.device) -> bool:
        return device.type == self.device.type and (self.device.index is None or device.index == self.device.index)

    def _add(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        key = id(storage)
        old = self._live.get(key)
        if old is not None:
            self.current += nbytes - old[1]
            self._live[key] = (old[0], nbytes)
        else:
            self._live[key] = (weakref.ref(storage, partial(self._freed, key)), nbytes)
            self.current += nbytes
        self.peak = max(self.peak, self.current)

    def _freed(self, key: int, _ref) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self.current -= entry[1]

    def _on_tensor(self, tensor: torch.Tensor) -> None:
        if not self._here(tensor.device):
            return
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a tensor without storage of its own
            return
        if id(storage) not in self._live:
            self._add(storage, storage.nbytes())

    def _on_resize(self, storage: torch.UntypedStorage, _before: int, after: int) -> None:
        if self._here(storage.device):
            self._add(storage, after)

    def reset_peak(self) -> None:
        self.peak = self.current

    def __enter__(self) -> LiveBytes:
        self._stack.enter_context(watch_allocations(self._on_tensor, self._on_resize))
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()
