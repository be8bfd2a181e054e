"""Model weights as a stream of tensors: a checkpoint written, or read, one tensor at a time.

A Hugging Face import, a ``finetune.init_from`` of a Hugging Face directory and an export never hold the
whole model: the largest model plait can hand over is bounded by its largest tensor, not by its size.

- ``save_streamed`` writes a weights checkpoint through ``torch.distributed.checkpoint`` from a state dict of
  meta tensors (names, shapes, dtypes: all the save plan needs); the writer asks for each value when it
  reaches it (``SavePlanner.resolve_data``), so one is made, written and dropped at a time.
- ``CheckpointTensors`` reads one tensor of a checkpoint into a fresh fp32 tensor, through plait's checked
  loader (metadata hash, shapes, no pickles, record checksums); DCP reassembles tensors saved by any number
  of ranks.
- ``StreamedHash`` takes the lineage weights hash (``plait.core.digest``: per-tensor digests, in any order) of
  tensors seen one at a time, so the pass that writes the weights also hashes them.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import WriteItemType

from plait.core.digest import combine, partial_digest
from plait.core.errors import PlaitError
from plait.core.storage import DCP_METADATA, Location, dcp_writer, parse_metadata, read_bytes
from plait.engine.checkpoint import load_model_weights
from plait.interop.hf import param_shapes, saved_tensors
from plait.model.llama import ModelArgs, Transformer
from plait.model.lora import apply_lora, fold, lora_shapes

_NO_DIST_WARNING = "torch.distributed is disabled"  # DCP 'assumes' a single process without a group: intended


class StreamedHash:
    """``plait.core.digest.weights_hash`` of tensors seen one at a time, in any order.

    Each tensor is digested on a background thread while the caller goes on (torch's kernels release the
    GIL): the digest of one tensor overlaps the writing of it, or the reading of the next. At most one
    digest is in flight: ``add`` (and ``wait``) first waits for the previous one, so the thread holds one
    tensor, and only one the caller has just had anyway.
    """

    def __init__(self) -> None:
        self._digests: dict[str, list[int]] = {}
        self._meta: dict[str, tuple[str, tuple[int, ...]]] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="plait-digest")
        self._pending: tuple[str, Future] | None = None

    def add(self, name: str, tensor: torch.Tensor, *, as_dtype: torch.dtype | None = None) -> None:
        """Digest ``tensor`` (cast to ``as_dtype`` first, on the thread, if given) under ``name``."""
        self.wait()
        dtype = as_dtype or tensor.dtype
        self._meta[name] = (str(dtype).removeprefix("torch."), tuple(tensor.shape))
        cast = (lambda t: t.to(as_dtype)) if as_dtype is not None else (lambda t: t)
        self._pending = name, self._pool.submit(lambda: partial_digest(name, cast(tensor)))

    def wait(self) -> None:
        if self._pending is not None:
            name, future = self._pending
            self._pending = None
            self._digests[name] = future.result()

    def hexdigest(self) -> str:
        self.wait()
        self._pool.shutdown()
        return combine(self._digests, self._meta)


# ----------------------------------------------------------------------------------------------- writing


def checkpoint_sources(args: ModelArgs) -> dict[str, str]:
    """Checkpoint key (as ``get_model_state_dict`` names a Transformer of this shape, tied ``output.weight``
    included, as CheckpointManager saves it) -> the parameter (or persistent buffer) that holds its value."""
    with torch.device("meta"):
        model = Transformer(args)
    owner = {id(t): name for name, t in saved_tensors(model)}
    return {key: owner[id(value)] for key, value in model.state_dict(keep_vars=True).items()}


class _ProducingSavePlanner(DefaultSavePlanner):
    """DCP's own planner over a state dict of meta tensors, except that each value is made by ``produce``
    (from the key without its ``model.`` prefix) when the writer asks for it."""

    def __init__(self, produce: Callable[[str], torch.Tensor]):
        super().__init__()
        self._produce = produce

    def resolve_data(self, write_item):
        if write_item.type == WriteItemType.BYTE_IO:
            return super().resolve_data(write_item)
        fqn = write_item.index.fqn
        tensor = self._produce(fqn.removeprefix("model."))
        expected = tuple(write_item.tensor_data.size)
        if tuple(tensor.shape) != expected or tensor.dtype != write_item.tensor_data.properties.dtype:
            raise PlaitError(f"internal: {fqn} was made as {tuple(tensor.shape)} {tensor.dtype}, planned {expected}")
        return tensor


def save_streamed(
    ckpt_dir: Location, shapes: Mapping[str, Sequence[int]], produce: Callable[[str], torch.Tensor]
) -> None:
    """A DCP checkpoint ``{"model": {name: tensor}}`` of fp32 tensors with these shapes, ``produce(name)``
    making each when the writer reaches it. One file per tensor (``dcp_writer(single_file_per_rank=False)``),
    record checksums as every plait checkpoint: the process holds at most the tensor being written, the one
    before it (DCP drops its reference only when it gets the next) and whatever ``produce`` reads from."""
    state = {"model": {name: torch.empty(tuple(s), device="meta") for name, s in shapes.items()}}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_DIST_WARNING)
        dcp.save(
            state,
            storage_writer=dcp_writer(ckpt_dir, single_file_per_rank=False),
            planner=_ProducingSavePlanner(produce),
            no_dist=True,
        )


# ----------------------------------------------------------------------------------------------- reading


class CheckpointTensors:
    """The model tensors of a plait checkpoint (any layout, any number of ranks that saved it), each read
    into a fresh fp32 tensor by plait's checked loader. The checkpoint's tensor list is compared with the
    model's shape up front, so a mismatch fails before anything is written from it.

    A LoRA run's checkpoint (``lora``: its rank, alpha and targets) is read as the model it trained: each
    adapted weight comes back with its adapter folded in (W + (alpha / r) B A, ``plait.model.lora.fold``),
    so an export of the run is the adapted model, never its frozen base alone.

    Reading one tensor holds it, plus what DCP's reader holds while decoding a record: the record's bytes
    and the tensor ``torch.load`` makes from them, before it is copied in (so about 3x the tensor at peak).
    """

    def __init__(self, ckpt: Location, args: ModelArgs, lora: tuple[int, float, str] | None = None):
        self.ckpt, self.shapes = ckpt, param_shapes(args)
        self.adapters, self.scaling = ({}, 0.0) if lora is None else (_adapter_shapes(args, lora), lora[1] / lora[0])
        try:
            saved = parse_metadata(read_bytes(ckpt / DCP_METADATA)).state_dict_metadata
        except PlaitError as e:
            raise PlaitError(f"checkpoint {ckpt} cannot be read: {e}") from None
        except OSError as e:
            raise PlaitError(f"checkpoint {ckpt} cannot be read: its {DCP_METADATA} is missing ({e})") from None
        problems = []
        for name, shape in {**self.shapes, **self.adapters}.items():
            entry = saved.get(f"model.{name}")
            if not isinstance(entry, TensorStorageMetadata) or tuple(entry.size) != tuple(shape):
                found = "missing" if entry is None else tuple(getattr(entry, "size", ())) or "not a tensor"
                problems.append(f"model.{name} {found} in the checkpoint, {tuple(shape)} in its config")
        if problems:  # one line: how many, and the first (a wrong config makes every tensor differ)
            many = f"{len(problems)} tensors differ, e.g. " if len(problems) > 1 else ""
            raise PlaitError(f"checkpoint {ckpt} does not match its own config: {many}{problems[0]}")

    def read(self, name: str) -> torch.Tensor:
        value = self._read(name, self.shapes[name])
        module = name.removesuffix(".weight")
        if f"{module}.lora_a" in self.adapters:
            lora_a, lora_b = (self._read(f"{module}.{p}", self.adapters[f"{module}.{p}"]) for p in ("lora_a", "lora_b"))
            value = fold(value, lora_a, lora_b, self.scaling)
        return value

    def _read(self, name: str, shape) -> torch.Tensor:
        value = torch.empty(shape, dtype=torch.float32)
        root, (module, leaf) = _holding(name, value)
        try:
            load_model_weights(root, self.ckpt)
        finally:
            # torch's state-dict helpers leave the module in a reference cycle (a recursive closure), which
            # only the cyclic GC frees: without this the tensor would live on, one more per read, until then.
            delattr(module, leaf)
        return value


def _adapter_shapes(args: ModelArgs, lora: tuple[int, float, str]) -> dict[str, tuple[int, ...]]:
    """{name: shape} of a LoRA run's adapter tensors, from a model on the meta device (nothing allocated)."""
    with torch.device("meta"):
        model = Transformer(args)
        apply_lora(model, lora[0], lora[1], lora[2])
    return lora_shapes(model)


def _holding(name: str, value: torch.Tensor) -> tuple[nn.Module, tuple[nn.Module, str]]:
    """A module whose one parameter is ``value`` under the dotted ``name`` (``layers.0.attention.wq.weight``),
    so that ``load_model_weights`` fills exactly that tensor of a checkpoint; and (its owner, its name)."""
    root = module = nn.Module()
    *path, leaf = name.split(".")
    for part in path:
        child = nn.Module()
        module.add_module(part, child)
        module = child
    module.register_parameter(leaf, nn.Parameter(value, requires_grad=False))
    return root, (module, leaf)
