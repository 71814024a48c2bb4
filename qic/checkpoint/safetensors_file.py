"""Reading safetensors headers without reading tensors, and tensor bytes by positional reads.

A header is 8 bytes of little-endian length followed by JSON: {name: {dtype, shape, data_offsets}}.
Parsing it lets us validate a file (truncation, overlapping ranges) and plan a shard stage that
streams byte ranges, without touching the tensor data.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from qic.errors import CheckpointError

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    name: str
    path: Path
    dtype: str          # safetensors dtype name, e.g. "BF16"
    shape: tuple[int, ...]
    start: int          # absolute byte offset of the data in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclass(frozen=True)
class Header:
    path: Path
    raw: bytes                  # the header JSON bytes, as stored (hashable identity of the layout)
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    size: int


def read_header(path: Path) -> Header:
    """Parse and validate a safetensors header; a clear error names the file when it is bad."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                raise CheckpointError(f"{path}: corrupt or truncated safetensors header (claims {n} bytes)")
            raw = f.read(n)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    try:
        table = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CheckpointError(f"{path}: corrupt safetensors header (not JSON)") from None
    if not isinstance(table, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header")
    metadata = table.pop("__metadata__", None) or {}
    base = 8 + n
    tensors = {}
    data_end = 0
    for name, entry in table.items():
        try:
            dtype, shape, (a, b) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: corrupt header entry for tensor {name}") from None
        if dtype not in DTYPES:
            raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {dtype}")
        expected = DTYPES[dtype].itemsize * _numel(shape)
        if b - a != expected or a < 0:
            raise CheckpointError(f"{path}: tensor {name} has {b - a} bytes, its shape {shape} needs {expected}")
        tensors[name] = TensorInfo(name, path, dtype, shape, base + a, base + b)
        data_end = max(data_end, b)
    if base + data_end > size:
        raise CheckpointError(
            f"{path}: truncated safetensors file ({size} bytes, header needs {base + data_end})",
            "re-download or regenerate the checkpoint")
    return Header(path, raw, tensors, metadata, size)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def read_tensor(info: TensorInfo) -> torch.Tensor:
    """One tensor by a positional read (no memory map kept alive)."""
    buf = bytearray(info.nbytes)
    with open(info.path, "rb", buffering=0) as f:
        view = memoryview(buf)
        got = 0
        while got < info.nbytes:
            k = os.preadv(f.fileno(), [view[got:]], info.start + got)
            if k <= 0:
                raise CheckpointError(f"{info.path}: truncated while reading tensor {info.name}")
            got += k
    if info.nbytes == 0:
        return torch.empty(info.shape, dtype=info.torch_dtype)
    return torch.frombuffer(buf, dtype=info.torch_dtype).reshape(info.shape)
