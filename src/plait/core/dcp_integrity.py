"""What makes DCP's files safe to read: every tensor record carries its length and CRC32 (a DCP stream
extension, so a flipped or cut byte fails the load instead of loading silently), and DCP's ``.metadata`` is
read by an unpickler that builds only DCP's own metadata classes (torch 2.13 reads it with a plain
``pickle.load``, which runs arbitrary code from a crafted checkpoint). plait.core.storage's readers and writers
use both."""

from __future__ import annotations

import io
import pickle
import struct
import zlib
from typing import IO, cast

import torch
from torch.distributed.checkpoint.metadata import Metadata

from plait.core import torch_private
from plait.core.errors import PlaitError

DCP_METADATA = ".metadata"

# ------------------------------------------------------------------------------- record checksums (CRC32)


class RecordChecksum(torch_private.dcp_stream_extension()):  # type: ignore[misc]  # DCP's class, from torch_private
    """A DCP stream extension that appends (payload length, CRC32, magic) to every record on save and checks
    them on load. DCP stores the descriptor in its metadata, so records written without it load as before."""

    TRAILER = struct.Struct("<QI4s")
    MAGIC = b"PLC1"

    @staticmethod
    def registry_name() -> str:
        return "plait.crc32"

    @staticmethod
    def from_descriptor(version: str) -> RecordChecksum:
        if version != "1":
            raise ValueError(f"plait.crc32 version {version!r} is not known to this plait")
        return RecordChecksum()

    def get_descriptor(self) -> str:
        return f"{self.registry_name()}/1"

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        return cast(IO[bytes], _ChecksumWriter(output, self.TRAILER, self.MAGIC))

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        data = input.read()
        where = getattr(input, "plait_where", "a record")
        size = self.TRAILER.size
        if len(data) < size:
            raise ChecksumError(f"{where} is cut short ({len(data)} bytes, not even its checksum)")
        length, crc, magic = self.TRAILER.unpack_from(data, len(data) - size)
        payload = memoryview(data)[: len(data) - size]
        if magic != self.MAGIC or length != len(payload):
            raise ChecksumError(f"{where}: record trailer damaged (length {length} vs {len(payload)} bytes read)")
        actual = zlib.crc32(payload)
        if actual != crc:
            raise ChecksumError(f"{where}: CRC32 mismatch (stored {crc:08x}, read {actual:08x}): data is corrupt")
        return io.BytesIO(payload)


class ChecksumError(ValueError):
    pass


class _ChecksumWriter(io.RawIOBase):
    def __init__(self, output: IO[bytes], trailer: struct.Struct, magic: bytes):
        self.output, self.trailer, self.magic = output, trailer, magic
        self.crc, self.length = 0, 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        view = memoryview(b).cast("B")
        self.crc = zlib.crc32(view, self.crc)
        self.length += view.nbytes
        self.output.write(view)
        return view.nbytes

    def close(self) -> None:
        if not self.closed:
            self.output.write(self.trailer.pack(self.length, self.crc, self.magic))
            self.output.close()  # DCP's wrapper: flushes, leaves the file open for the next record
        super().close()


# --------------------------------------------------------------------------------- metadata without pickle

_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    *((module, cls) for module in ("pathlib", "pathlib._local") for cls in ("PosixPath", "PurePosixPath")),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata dataclasses, torch.Size, dtypes and layouts, and nothing else: a crafted
    ``.metadata`` that names any other callable (os.system, builtins.eval, ...) is refused, not called."""

    def find_class(self, module: str, name: str):
        if (module, name) in _METADATA_CLASSES or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")


def parse_metadata(data: bytes) -> Metadata:
    try:
        md = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as e:
        raise PlaitError(f"its {DCP_METADATA} file is damaged or not DCP metadata ({e})") from None
    if not isinstance(md, Metadata):
        raise PlaitError(f"its {DCP_METADATA} file holds a {type(md).__name__}, not DCP metadata")
    return md
