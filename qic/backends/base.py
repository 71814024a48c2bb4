"""The back-end interface: what the build stages need from a compiler, and nothing more.

The stages export each graph with torch.export first (its code names the graph in the compile cache,
independent of the weights), then hand the exported program to the back end.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass
class CompiledGraph:
    """What a compile produced: the artifact file (weights are trailing inputs, never inside it)."""
    file: str                       # file name inside the graph's directory
    meta: dict = field(default_factory=dict)


class Backend(ABC):
    name: str

    def __init__(self, device: str):
        self.device = device

    @abstractmethod
    def identity(self) -> dict:
        """Versions and flags that determine an artifact: part of cache keys and of the manifest."""

    @abstractmethod
    def compile(self, program: torch.export.ExportedProgram, out_dir: Path) -> CompiledGraph:
        """Compile an exported program into out_dir, leaving its weights out of the artifact."""
