"""The back-end interface: what the build stages and the runtime need from a compiler, and nothing more.

A back end is a package `qic/backends/<name>/` with three parts, so that no stage, CLI verb or runtime
module ever names one:
- `__init__.py` (light, no torch): NAME, DEVICES it builds for, DEFAULT_DEVICE, RUN_DEVICES it runs on;
- `build.py`: a `Backend` subclass, the build half (below);
- `load.py`: the run half, a module with `check(bundle, manifest, device)` (refuse, before any compiled
  code is loaded, what this machine cannot run), `load(path, weights, device, rank, world, manifest)`
  (a callable over a graph's inputs; it may carry `rebind(weights)`, the same loaded code over other weights, which
  a server's weight sets use instead of loading the code again) and `describe(manifest)` (what `qic inspect` adds
  for it); optionally LOCKSTEP_DEVICES, the devices on which it runs a multi-rank bundle's graphs in lockstep
  (every rank must call the same graphs in the same order: qic.backends.lockstep).

The build half, in the order the stages call it for each graph and then once per build:
  trace(gdef, tensors) -> Traced        the graph in the form the compiler takes, and what names it
  compile(traced, out_dir) -> Compiled  the artifact files (weights are trailing inputs, never inside)
  compile_task(traced, out_dir, scratch) the same compile as a call another process can make, or None
  finish(artifacts, cache_dir, progress) -> Finished   a build-wide step after every graph (NEFFs)
  graph_fields / bundle_fields          what the bundle's manifest records for it
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Traced:
    """A graph traced for a back end: `digest` is a hashlib object fed with what the compiler will see (the
    stages finish it into the graph key); `weight_names` the weight inputs in order; `constants` tensors the
    tracing made that travel with the graph; `payload` what compile() needs, opaque to the stages."""
    digest: object
    weight_names: list[str]
    payload: object
    constants: dict = field(default_factory=dict)


@dataclass
class CompiledGraph:
    """What a compile produced: the artifact file, other files beside it, and fields for the entry's meta."""
    file: str                       # file name inside the graph's directory
    extra_files: list[str] = field(default_factory=list)
    meta: dict = field(default_factory=dict)


@dataclass
class Finished:
    """What a back end's build-wide step returns: the artifacts (with any new meta), one row per item it
    produced (stage, item, cached, bytes, seconds), and warnings of one line each."""
    artifacts: list
    rows: list[tuple] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


class Backend(ABC):
    name: str

    def __init__(self, device: str):
        self.device = device

    @classmethod
    def from_spec(cls, spec) -> Backend:
        """The back end a build spec asks for (a back end with options reads them from the spec)."""
        return cls(spec.device)

    @abstractmethod
    def identity(self) -> dict:
        """Versions and flags that determine an artifact: part of cache keys and of the manifest."""

    @abstractmethod
    def trace(self, gdef, tensors: dict) -> Traced:
        """Trace the GraphDef's module, whose parameters and buffers are `tensors`, for this compiler."""

    @abstractmethod
    def compile(self, traced: Traced, out_dir: Path) -> CompiledGraph:
        """Compile a traced graph into out_dir, leaving its weights out of the artifact."""

    def compile_task(self, traced: Traced, out_dir: Path, scratch: Path):
        """compile(traced, out_dir) as (function, args) that a spawned process can call (a build's compile workers,
        qic.builder.workers), with what it reads written under `scratch`; None (the default): this graph compiles
        in the build's process."""
        return None

    def finish(self, artifacts: list, cache_dir: Path, progress=None) -> Finished:
        """A step over every compiled graph of a build; none by default."""
        return Finished(artifacts)

    def graph_fields(self, meta: dict, folder: str) -> tuple[dict, list[tuple[Path, str]]]:
        """(fields of the graph's manifest entry, [(file, name in the graph's folder)] to copy there)."""
        return {}, []

    def bundle_fields(self, graphs: list[dict]) -> dict:
        """Top-level manifest fields for this back end."""
        return {}
