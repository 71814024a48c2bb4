"""Compiler back ends behind one small interface (qic/backends/base.py says what a back end provides).

This registry is the only place that lists them. It imports a back end's package (`__init__`, light) to
learn its devices, its `build` module only to build and its `load` module only to run: the run side never
imports the build side.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

from qic.errors import BundleError, ConfigError

NAMES = ("inductor", "neuron", "export")   # the first is the default


def info(name: str) -> ModuleType:
    """The back end's package: NAME, DEVICES (built for), DEFAULT_DEVICE, RUN_DEVICES (run on)."""
    if name not in NAMES:
        raise ConfigError(f"unknown back end {name!r}; known: {', '.join(NAMES)}")
    return importlib.import_module(f"qic.backends.{name}")


def for_device(device: str) -> str:
    """The back end that builds for `device`."""
    for name in NAMES:
        if device in info(name).DEVICES:
            return name
    raise ConfigError(f"no back end builds for device {device!r}; devices: {', '.join(all_devices())}")


def all_devices() -> tuple[str, ...]:
    return tuple(d for name in NAMES for d in info(name).DEVICES)


def get_backend(name: str, device: str, **options):
    """The build half of back end `name` for `device`."""
    info(name)
    return importlib.import_module(f"qic.backends.{name}.build").BACKEND(device, **options)


def backend_for(spec):
    """The build half a build spec asks for, with the spec's options for it."""
    info(spec.backend)
    return importlib.import_module(f"qic.backends.{spec.backend}.build").BACKEND.from_spec(spec)


def loader(name: str) -> ModuleType:
    """The run half of back end `name` (check, load, describe)."""
    if name not in NAMES:
        raise BundleError(f"bundle uses back end {name!r}, which this qic cannot load (known: {', '.join(NAMES)})")
    return importlib.import_module(f"qic.backends.{name}.load")


def lockstep(name: str, device: str) -> bool:
    """Whether back end `name` runs a multi-rank bundle's graphs on `device` in lockstep: every rank must call the
    same graphs in the same order (its load module's LOCKSTEP_DEVICES), so a run whose ranks would diverge
    (CFG groups deciding their own cached steps, an idle group) is refused before it starts."""
    return device in getattr(loader(name), "LOCKSTEP_DEVICES", ())


def load_graph(manifest: dict, path: Path, weights: list, device: str, rank: int = 0, world: int = 1):
    """A callable over one of the manifest's graphs' inputs; `weights` (its weight_inputs order) are appended."""
    return loader(manifest["backend"]["backend"]).load(Path(path), weights, device, rank=rank, world=world,
                                                       manifest=manifest)
