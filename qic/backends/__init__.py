"""Compiler back ends behind one small interface.

Build side (`get_backend(name)`): export/compile a graph from example inputs into files, weights kept
out. Run side (`load_graph(name, ...)` in qic.backends.loaders): bind weights by name and return a
callable over a flat list of tensors. The run side never imports the build side.
"""

from __future__ import annotations

import importlib

from qic.backends.base import Backend, CompiledGraph
from qic.errors import ConfigError

_BUILDERS = {"inductor": "qic.backends.inductor:InductorBackend", "neuron": "qic.backends.neuron:NeuronBackend"}


def get_backend(name: str, device: str, **options) -> Backend:
    try:
        module, cls = _BUILDERS[name].split(":")
    except KeyError:
        raise ConfigError(f"unknown back end {name!r}; known: {', '.join(_BUILDERS)}") from None
    return getattr(importlib.import_module(module), cls)(device, **options)


__all__ = ["Backend", "CompiledGraph", "get_backend"]
