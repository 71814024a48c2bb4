"""The export back end's build half: the graph exported as the inductor back end exports it, its unread
module state dropped (the weights are inputs), saved with torch.export.save."""

from __future__ import annotations

from pathlib import Path

import torch

from qic.backends.base import Backend, CompiledGraph, Traced
from qic.backends.export import DEVICES, NAME
from qic.backends.inductor.build import baked_tensors, export_graph
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


def saveable(program):
    """The program as torch.export.save should write it: without the module state it lists but never reads (export
    lifts every parameter and buffer of the module it is given, also those the weights, its inputs, replace, and
    save would write a copy of the checkpoint into every graph), and with each constant in a storage of its own
    (RoPE's text and image tables are two views of one; save writes a storage once, from one tensor that must
    cover the others, and warns when none does). The program is changed in place: it is compiled once."""
    from torch.export.graph_signature import ExportGraphSignature, InputKind
    graph = program.graph_module.graph
    unread = {n.name for n in graph.nodes if n.op == "placeholder" and not n.users}
    dropped = [s for s in program.graph_signature.input_specs
               if s.kind in (InputKind.PARAMETER, InputKind.BUFFER) and s.arg.name in unread]
    for node in [n for n in graph.nodes if n.op == "placeholder" and n.name in {s.arg.name for s in dropped}]:
        graph.erase_node(node)
    program.graph_module.recompile()
    targets = {s.target for s in dropped}
    signature = ExportGraphSignature([s for s in program.graph_signature.input_specs if s not in dropped],
                                     program.graph_signature.output_specs)
    constants = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in program.constants.items()}
    return torch.export.ExportedProgram(
        root=program.graph_module, graph=graph, graph_signature=signature,
        state_dict={k: v for k, v in program.state_dict.items() if k not in targets},
        range_constraints=program.range_constraints, module_call_graph=program.module_call_graph,
        constants=constants, verifiers=program.verifiers)


BACKEND = ExportBackend
