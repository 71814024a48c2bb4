"""The back-end interface: what the build stages need from a compiler, and nothing more."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass
class CompiledGraph:
    """What a compile produced: the artifact file and the weights it expects to be bound by name."""
    file: str                       # file name inside the graph's directory
    weight_names: list[str]         # constants the runtime binds from the weight shards
    extra_constants: dict[str, torch.Tensor] = field(default_factory=dict)  # graph-owned (not checkpoint) tensors
    meta: dict = field(default_factory=dict)


class Backend(ABC):
    name: str

    def __init__(self, device: str):
        self.device = device

    @abstractmethod
    def identity(self) -> dict:
        """Versions and flags that determine an artifact: part of cache keys and of the manifest."""

    @abstractmethod
    def compile(self, module: torch.nn.Module, example_inputs: tuple, out_dir: Path,
                dynamic_shapes=None) -> CompiledGraph:
        """Compile `module` for these example inputs into out_dir, leaving the weights out."""
