"""Run side of neuron bundles: a graph folder holds the HLO module, params.json and (unless the bundle is
lower-only) the NEFF. `device` picks how it runs:
- "neuron": the NEFF on a NeuronCore through libnrt (qic.backends.neuron.nrt);
- "xla-cpu": the HLO module on XLA:CPU through torch-xla (qic.backends.neuron.xla_runtime), e.g. to check a
  bundle, or a lower-only one, on a machine without Neuron hardware; a multi-rank bundle's ranks all run on
  rank 0's XLA:CPU devices, one device each.
Imports neither model code nor compilers.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from qic.backends.neuron import NEFF_FILE, PARAMS_FILE, RUN_DEVICES
from qic.errors import BundleError

# On XLA:CPU rank 0 runs every rank's graph as one program on its devices (xla_runtime.py): the ranks must call
# the same graphs in the same order (qic.backends.lockstep).
LOCKSTEP_DEVICES = ("xla-cpu",)


def check(bundle: Path, manifest: dict, device: str) -> None:
    """Nothing to refuse before loading: a NEFF's fitness is the runtime's to judge (load says why not)."""
    if device not in RUN_DEVICES:
        raise BundleError(f"{bundle}: a neuron bundle runs on device {' or '.join(RUN_DEVICES)}, not {device!r}")


def describe(manifest: dict) -> tuple[list[str], dict]:
    """What `qic inspect` adds: the NEFF state, and per graph its HLO size, XLA:CPU check and NEFF."""
    state = ("lower-only: HLO modules checked on XLA:CPU, no NEFFs (neuronx-cc was absent at build)"
             if manifest.get("lower_only") else f"NEFFs compiled by neuronx-cc {manifest['neuron']['neuronx_cc']}")

    def check_text(g: dict) -> str:
        rel = g["checks"].get("xla_cpu_rel_l2")
        return f"{rel:.2g}" if rel is not None else g["checks"].get("xla_cpu_check", "not run")

    return [f"neuron: {state}; lnc {manifest['neuron']['lnc']}"], {
        "HLO": lambda g: f"{g['hlo_bytes'] / 1e6:.2f} MB", "XLA:CPU rel-L2": check_text,
        "NEFF": lambda g: "yes" if g["neff"] else "no"}


def load(path: Path, weights: list[torch.Tensor], device: str, rank: int = 0, world: int = 1,
         manifest: dict | None = None, lnc: int | None = None, outputs: list[dict] | None = None):
    """`path`: the graph's file as its manifest names it (the HLO module); params.json and model.neff
    sit beside it."""
    if lnc is None:
        lnc = ((manifest or {}).get("neuron") or {}).get("lnc", 1)
    folder = Path(path).parent
    params = json.loads((folder / PARAMS_FILE).read_text())["params"]
    if device == "xla-cpu":
        from qic.backends.neuron import xla_runtime
        return xla_runtime.load(Path(path), params, weights, rank=rank, world=world)
    check(folder.parent.parent, manifest or {}, device)
    neff = folder / NEFF_FILE
    if not neff.is_file():
        raise BundleError(f"{folder.parent.parent}: lower-only bundle (no NEFFs: built where neuronx-cc was absent)",
                          "rebuild it on a Trainium host, or run it with --device xla-cpu")
    from qic.backends.neuron import nrt as neuron_loader
    # The NEFF's inputs are the HLO's parameters, in order: the graph inputs it reads, then its weights.
    inputs_used = [i for kind, i in params if kind == "input"]
    fn = neuron_loader.load(neff, [weights[j] for kind, j in params if kind == "weight"], "neuron",
                            rank=rank, world=world, lnc=lnc, outputs=outputs)

    def run(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        return fn([inputs[i] for i in inputs_used])

    run.close = getattr(fn, "close", None)
    return run
