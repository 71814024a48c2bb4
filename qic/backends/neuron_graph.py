"""Run side of neuron bundles: a graph folder holds the HLO module, params.json and (unless the bundle is
lower-only) the NEFF. `device` picks how it runs:
- "neuron": the NEFF on a NeuronCore through libnrt (qic.backends.neuron_loader);
- "xla-cpu": the HLO module on XLA:CPU through torch-xla (qic.backends.xla_runtime), e.g. to check a
  bundle, or a lower-only one, on a machine without Neuron hardware.
Imports neither model code nor compilers.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from qic.errors import BundleError


def load(path: Path, weights: list[torch.Tensor], device: str, rank: int = 0, world: int = 1, lnc: int = 1,
         outputs: list[dict] | None = None):
    """`path`: the graph's file as its manifest names it (the HLO module); params.json and model.neff
    sit beside it."""
    folder = Path(path).parent
    params = json.loads((folder / "params.json").read_text())["params"]
    if device == "xla-cpu":
        if world > 1:
            raise BundleError(f"{folder.parent.parent}: --device xla-cpu runs tp=1 neuron bundles only (one XLA:CPU "
                              f"device per process; this one was built for tp={world})",
                              "rebuild with --tp 1 to run it here; TP graphs are checked on XLA:CPU devices by "
                              "`python -m qic.bench.xla_lowering tp N`")
        from qic.backends import xla_runtime
        return xla_runtime.load(Path(path), params, weights)
    if device != "neuron":
        raise BundleError(f"a neuron bundle runs on device neuron or xla-cpu, not {device!r}")
    neff = folder / "model.neff"
    if not neff.is_file():
        raise BundleError(f"{folder.parent.parent}: lower-only bundle (no NEFFs: built where neuronx-cc was absent)",
                          "rebuild it on a Trainium host, or run it with --device xla-cpu")
    from qic.backends import neuron_loader
    # The NEFF's inputs are the HLO's parameters, in order: the graph inputs it reads, then its weights.
    inputs_used = [i for kind, i in params if kind == "input"]
    fn = neuron_loader.load(neff, [weights[j] for kind, j in params if kind == "weight"], "neuron",
                            rank=rank, world=world, lnc=lnc, outputs=outputs)

    def run(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        return fn([inputs[i] for i in inputs_used])

    run.close = getattr(fn, "close", None)
    return run
