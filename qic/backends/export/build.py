"""The export back end's build half: the graph exported as the inductor back end exports it, its unread
module state dropped (the weights are inputs), saved with torch.export.save."""

from __future__ import annotations

from pathlib import Path

import torch

from qic.backends.base import Backend, CompiledGraph, Traced
from qic.backends.export import DEVICES, NAME
from qic.backends.inductor.build import baked_tensors, export_graph, saveable
from qic.errors import ConfigError


class ExportBackend(Backend):
    name = NAME

    def __init__(self, device: str):
        if device not in DEVICES:
            raise ConfigError(f"the export back end targets {' or '.join(DEVICES)}, not {device!r}")
        super().__init__(device)

    def identity(self) -> dict:
        # A saved program is read back by the torch that runs it: its version decides the artifact.
        return {"backend": self.name, "torch": torch.__version__, "torch_git": torch.version.git_version,
                "device": self.device}

    def trace(self, gdef, tensors: dict) -> Traced:
        return export_graph(gdef, tensors)

    def compile(self, traced: Traced, out_dir: Path) -> CompiledGraph:
        program = traced.payload
        baked = baked_tensors(program)
        if baked:   # the same refusal as the inductor back end's: the weights are bound at load
            raise RuntimeError(f"the exported graph holds tensors of its own {baked[:3]}; every tensor must be an "
                               "input (the graph's weights are bound at load)")
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / "graph.pt2"
        torch.export.save(saveable(program), str(path))
        return CompiledGraph(file=path.name)


BACKEND = ExportBackend
