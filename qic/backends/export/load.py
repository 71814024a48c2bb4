"""The export back end's run half: a saved torch.export program, its weights bound as trailing inputs, run by
torch under inference mode (the same mode as the inductor back end's runs, for the same reason: load.py there)."""

from __future__ import annotations

import threading
from pathlib import Path

import torch


def check(bundle: Path, manifest: dict, device: str) -> None:
    """A saved program runs wherever its torch runs; only the device is checked here."""
    from qic.backends.export import RUN_DEVICES
    from qic.errors import BundleError
    if device not in RUN_DEVICES:
        raise BundleError(f"{bundle}: an export bundle runs on device {' or '.join(RUN_DEVICES)}, not {device!r}",
                          "leave --device out (the bundle's own)")


def describe(manifest: dict) -> tuple[list[str], dict]:
    """What `qic inspect` adds for this back end: (lines, {column: graph -> text})."""
    return ["graphs are torch.export programs run by torch, not compiled (the export back end)"], {}


def load(path: Path, weights: list[torch.Tensor], device: str, rank: int = 0, world: int = 1,
         manifest: dict | None = None):
    """The program is read at its first call, not here: reading one back (torch.export.load and .module(), which
    rebuild its graph and Python code) takes about half a second on two cores, and a run calls only the graphs of
    its resolution, bucket and images, so a bundle of 11 programs started in 5 s where one image needed 4 of them,
    and a request refused for its input had read them all first. The files were verified when the bundle opened."""
    return _bound(path, [], threading.Lock(), weights, device)


def _bound(path: Path, module: list, lock, weights: list[torch.Tensor], device: str):
    """The program (read once, shared: `module`) over `weights`; `rebind(other)` gives it over other weights (a
    request's LoRA slots, a weight set)."""
    bound = [w if w.device.type == device else w.to(device) for w in weights]

    def run(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        if not module:
            with lock:   # a server's compute threads may reach a graph's first call together
                if not module:
                    module.append(torch.export.load(str(path)).module())
        with torch.inference_mode():
            out = module[0](tuple(inputs), bound)
        return list(torch.utils._pytree.tree_leaves(out))

    run.rebind = lambda other: _bound(path, module, lock, other, device)
    return run
