"""Hugging Face weight files written one tensor at a time, split and named as transformers' ``save_pretrained``
splits and names them: ``model.safetensors``, or ``model-0000i-of-0000N.safetensors`` plus
``model.safetensors.index.json`` past ``max_shard_size``."""

from __future__ import annotations

import json
import re
import struct
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from plait.core.errors import ConfigError, PlaitError

_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
DEFAULT_MAX_SHARD_SIZE = "5GB"  # huggingface_hub's default (and the Hub's habit); transformers 5 writes 50GB
INDEX_FILE = "model.safetensors.index.json"


_SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]B)", re.IGNORECASE)
_SIZE_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}


def parse_shard_size(size: int | str) -> int:
    """Bytes of a ``max_shard_size`` read as transformers' ``save_pretrained`` reads it (huggingface_hub's
    rule): an integer number of bytes, or a number with KB, MB, GB or TB (powers of 10, any case)."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        text = str(size).strip()
        match = _SIZE.fullmatch(text)
        if text.isdigit():
            value = int(text)
        elif match:
            value = int(float(match[1]) * _SIZE_UNITS[match[2].upper()])
        else:
            raise ConfigError(
                f"--max-shard-size={size!r} is not a size: give bytes (1000000) or a number with KB, MB, GB or "
                f"TB (500MB, 5GB; powers of 10, as transformers' max_shard_size)"
            )
    if value < 1:
        raise ConfigError(f"--max-shard-size={size!r} must be at least 1 byte, e.g. 5GB")
    return value


@dataclass
class ShardSplit:
    filename_to_tensors: dict[str, list[str]]
    tensor_to_filename: dict[str, str]
    metadata: dict[str, int]

    @property
    def is_sharded(self) -> bool:
        return len(self.filename_to_tensors) > 1


def split_into_shards(sizes: Mapping[str, int], max_bytes: int) -> ShardSplit:
    """Which tensor (of `sizes` bytes, in order) goes to which file: huggingface_hub's splitter, which
    transformers' save_pretrained calls (equal to it: tests/test_hf_export.py). Tensors fill a file in order
    until the next would pass max_bytes; one larger than max_bytes gets a file of its own, placed before the
    file being filled. One file: model.safetensors; more: model-0000i-of-0000N.safetensors."""
    files: list[list[str]] = []
    current: list[str] = []
    current_bytes = 0
    for name, nbytes in sizes.items():
        if nbytes > max_bytes:
            files.append([name])
            continue
        if current_bytes + nbytes > max_bytes:
            files.append(current)
            current, current_bytes = [], 0
        current.append(name)
        current_bytes += nbytes
    if current:
        files.append(current)
    if len(files) == 1:
        names = {"model.safetensors": files[0]}
    else:
        names = {f"model-{i + 1:05d}-of-{len(files):05d}.safetensors": f for i, f in enumerate(files)}
    where = {tensor: filename for filename, tensors in names.items() for tensor in tensors}
    return ShardSplit(names, where, {"total_size": sum(sizes.values())})


class SafetensorsShards:
    """Weight files written one tensor at a time: ``model.safetensors`` when everything fits ``max_bytes``,
    else ``model-0000i-of-0000N.safetensors`` plus ``model.safetensors.index.json``. Which tensor goes to which
    file is decided as huggingface_hub's splitter (what transformers' ``save_pretrained`` calls) decides it
    (``split_into_shards``) in the order of ``shapes``, so names, sizes and the index are transformers' own; a
    tensor larger than ``max_bytes`` gets a file of its own, as there.

    safetensors writes a file only from all of its tensors at once. Here every file's header (each name,
    dtype, shape and byte range: all known from the shapes) is written first, and each tensor, in any order,
    is written at its place as it arrives: the same layout, and no more than one tensor held. Each finished
    file is opened with safetensors, which checks its header against its size.
    """

    def __init__(self, directory: Path, shapes: Mapping[str, Sequence[int]], dtype: torch.dtype, max_bytes: int):
        if sys.byteorder != "little":
            raise PlaitError("safetensors files are little-endian; exporting on a big-endian machine is not supported")
        self.directory, self.dtype, self.shapes = directory, dtype, {k: tuple(v) for k, v in shapes.items()}
        sizes = {name: _numel(shape) * dtype.itemsize for name, shape in self.shapes.items()}
        self.split = split_into_shards(sizes, max_bytes)
        self._place: dict[str, tuple[str, int]] = {}  # tensor -> (file, byte offset in it), until written
        self._left: dict[str, int] = {}  # file -> tensors still to come
        for filename, names in self.split.filename_to_tensors.items():
            header = self._header(names)
            with open(directory / filename, "wb") as f:
                f.write(header)
            offset = len(header)
            for name in names:
                self._place[name] = (filename, offset)
                offset += _numel(self.shapes[name]) * dtype.itemsize
            self._left[filename] = len(names)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name not in self._place or tuple(tensor.shape) != self.shapes[name]:
            raise PlaitError(f"internal: {name} {tuple(tensor.shape)} is not a tensor still to write")
        filename, offset = self._place.pop(name)
        data = tensor.detach().to("cpu", self.dtype).contiguous()
        with open(self.directory / filename, "r+b") as f:
            f.seek(offset)
            f.write(data.reshape(-1).view(torch.uint8).numpy().data)
        self._left[filename] -= 1
        if not self._left[filename]:
            self._check(filename)

    def finish(self) -> None:
        """Check that every tensor came, and write the index (for more than one file)."""
        if self._place:
            raise PlaitError(f"internal: the export ended before {sorted(self._place)[:4]} were written")
        if self.split.is_sharded:
            total = sum(_numel(s) for s in self.shapes.values())
            index = {
                "metadata": {"total_parameters": total, **self.split.metadata},
                "weight_map": self.split.tensor_to_filename,
            }
            (self.directory / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")

    def _header(self, names: Sequence[str]) -> bytes:
        header: dict[str, dict] = {"__metadata__": {"format": "pt"}}  # what save_pretrained writes
        offset = 0
        for name in names:
            nbytes = _numel(self.shapes[name]) * self.dtype.itemsize
            header[name] = {
                "dtype": _SAFETENSORS_DTYPES[self.dtype],
                "shape": list(self.shapes[name]),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # safetensors pads its header with spaces to 8-byte alignment
        return struct.pack("<Q", len(text)) + text

    def _check(self, filename: str) -> None:
        try:
            with safe_open(str(self.directory / filename), framework="pt") as f:
                written = set(f.keys())  # noqa: SIM118 (a safe_open handle is not a dict)
        except SafetensorError as e:
            raise PlaitError(f"internal: the written {filename} does not read back: {e}") from None
        if written != set(self.split.filename_to_tensors[filename]):
            raise PlaitError(f"internal: {filename} reads back other tensors than were written")


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
