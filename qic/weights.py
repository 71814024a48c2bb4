"""Memory-mapped safetensors: tensors that share the page cache instead of copying it.

Used by the runtime to bind weights to compiled graphs, and by the build to give export real
(but untouched) parameters. A private copy-on-write map keeps tensors writable for torch without
ever writing to the file.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import torch

from qic.checkpoint.safetensors_file import read_header


def mmap_safetensors(path: Path) -> dict[str, torch.Tensor]:
    header = read_header(Path(path))
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if header.size else None
    out = {}
    for name, info in header.tensors.items():
        if info.nbytes == 0:
            out[name] = torch.empty(info.shape, dtype=info.torch_dtype)
            continue
        flat = torch.frombuffer(mm, dtype=info.torch_dtype, count=info.nbytes // info.torch_dtype.itemsize,
                                offset=info.start)
        out[name] = flat.view(info.shape)
    return out


def named_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A module's tensors by name as its state dict names them: parameters, then buffers."""
    return dict(module.named_parameters()) | dict(module.named_buffers())
