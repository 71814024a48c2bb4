"""Run a lowered graph's HLO module on XLA:CPU (torch-xla): the neuron bundle's graphs, executed exactly
as serialized, on a machine without Neuron hardware. Run side: imports torch and torch-xla only.

Weights move to the XLA device once, at load; each call moves the inputs and reads the outputs back.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

os.environ.setdefault("PJRT_DEVICE", "CPU")


def load(hlo: Path, params: list[list], weights: list[torch.Tensor]):
    """`params`: per HLO parameter ["input", i] or ["weight", j] (params.json); a callable over the
    graph's inputs returning its outputs as CPU tensors."""
    import torch_xla
    run_hlo = _runner(Path(hlo).read_bytes(), f"qic::{Path(hlo).parent.name}")
    device = torch_xla.device()
    bound = {j: weights[j].to(device) for kind, j in params if kind == "weight"}

    def run(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        return run_hlo([inputs[i].to(device) if kind == "input" else bound[i] for kind, i in params])

    return run


def run_once(proto: bytes, values: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every parameter given, as CPU tensors in parameter order (the build's check)."""
    import torch_xla
    device = torch_xla.device()
    return _runner(proto, "qic::graph")([v.to(device) for v in values])


def _runner(proto: bytes, op: str):
    import torch_xla
    import torch_xla.core.xla_builder as xb
    computation = xb.computation_from_module_proto("qic_graph", proto)
    return lambda args: [o.cpu() for o in torch_xla._XLAC._xla_user_computation(op, args, computation)]
