"""Run-side loaders: bind weights to a compiled artifact and return a callable.

Imported by qic.runtime, so it must stay light: no torch._inductor, no model code, no compiler.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path

import torch

from qic.errors import BundleError

_LOADERS = {"inductor": "qic.backends.inductor_loader", "neuron": "qic.backends.neuron_graph"}

Graph = Callable[[list[torch.Tensor]], list[torch.Tensor]]


def load_graph(backend: str, path: Path, weights: list[torch.Tensor], device: str, **placement) -> Graph:
    """A callable over the graph's inputs; `weights` (in the graph's weight_inputs order) are appended.
    `placement`: what a multi-device back end needs (neuron: rank, world, lnc, outputs)."""
    try:
        module = importlib.import_module(_LOADERS[backend])
    except KeyError:
        raise BundleError(f"bundle uses back end {backend!r}, which this qic cannot load "
                          f"(known: {', '.join(_LOADERS)})") from None
    return module.load(Path(path), weights, device, **placement)
