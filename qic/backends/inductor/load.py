"""The inductor back end's run half: load an AOTInductor package whose weights are trailing inputs, and bind
memory-mapped tensors; before that, refuse a graph compiled for an instruction set or GPU this machine lacks.

Uses torch's C++ package loader directly: the Python route (torch._inductor.aoti_load_package)
imports the whole compiler (about 2 s) before loading. This binding is internal torch API: the package
as a whole accepts the torch range its model and build code are tested on (2.9 for the neuron back end's
torch-xla, 2.13), but the inductor back end refuses any torch series not in TESTED_TORCH.
"""

from __future__ import annotations

import re
import shutil
import tempfile
import threading
from pathlib import Path

import torch

# torch (major, minor) series the runtime tests have loaded AOTInductor packages with; `qic doctor`
# reports whether the running torch is one of them.
TESTED_TORCH = ((2, 13),)


def check_torch() -> None:
    from qic.errors import ConfigError
    series = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    if series not in TESTED_TORCH:
        tested = ", ".join(".".join(map(str, s)) for s in TESTED_TORCH)
        raise ConfigError(f"the inductor back end binds AOTInductor packages through torch internals tested on "
                          f"torch {tested}; this is torch {torch.__version__}",
                          f"use torch {tested} for inductor bundles (`make install` sets up .venv)")


def check(bundle: Path, manifest: dict, device: str) -> None:
    """Refuse, before any compiled code is loaded, a graph compiled for an instruction set or GPU this
    machine lacks (torch itself only warns, after loading, if the process survives the load)."""
    from qic.backends.inductor import RUN_DEVICES
    from qic.backends.inductor.target import target_mismatch
    from qic.errors import BundleError
    if device not in RUN_DEVICES:   # else torch's own error, about its device strings, after the checks
        raise BundleError(f"{bundle}: an inductor bundle runs on device {' or '.join(RUN_DEVICES)}, not {device!r}",
                          "pass --device cpu or cuda, or leave --device out (the bundle's own)")
    for g in manifest["graphs"]:
        reason = target_mismatch(g.get("target", manifest["backend"].get("target")), device)
        if reason:
            raise BundleError(f"{bundle}: graph {g['name']} cannot run on this machine: {reason}",
                              "rebuild the bundle (or warm its cache) on a machine like this one")


def describe(manifest: dict) -> tuple[list[str], dict]:
    """What `qic inspect` adds for this back end: (lines, {column: graph -> text}); nothing here."""
    return [], {}


_extract_lock = threading.Lock()


def _open_package(path: Path):
    """torch's loader extracts the package into a fresh directory under the temp dir and removes it only when the
    loader is destroyed; a process that ends without destroying it (a server stopped by SIGTERM, a rank killed with
    its group) leaves ~4 MB a graph behind, every start. The extracted library is loaded (mapped) by then and
    nothing reads the directory again, so remove it at once: a mapped file outlives its name, and nothing is left
    behind however the process ends. The directory is the one holding a file this process mapped during the load
    (torch names it aotinductor_*: only such a directory is removed); the lock keeps two loads' maps apart."""
    temp = Path(tempfile.gettempdir())
    with _extract_lock:
        before = _mapped_dirs(temp)
        loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
        for extracted in _mapped_dirs(temp) - before:
            if extracted.name.startswith("aotinductor_"):
                shutil.rmtree(extracted, ignore_errors=True)
    return loader


def _mapped_dirs(temp: Path) -> set[Path]:
    """The directories right under `temp` that hold a file this process has mapped (Linux; elsewhere none)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return set()
    prefix = re.escape(str(temp).rstrip("/"))
    return {temp / name for name in re.findall(rf" {prefix}/([^/\s]+)/", maps)}


def load(path: Path, weights: list[torch.Tensor], device: str, rank: int = 0, world: int = 1,
         manifest: dict | None = None):
    check_torch()
    return _bound(_open_package(path), weights, device)


def _bound(loader, weights: list[torch.Tensor], device: str):
    """The loaded package as a callable over the graph's inputs, `weights` appended; `rebind(other)` gives the same
    library over other weights (torch never unloads a package's library, so loading it again per weight set would
    map another copy of its code each time: ~1 MB a graph)."""
    bound = [w if w.device.type == device else w.to(device) for w in weights]

    def run(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        # Inference mode keeps the package's collectives in C++. Its run holds the GIL throughout, and a gloo
        # worker thread releases a finished collective's tensors while holding the work queue's lock; a tensor
        # Python has seen needs the GIL for that. Without the autograd keys, the Python autograd kernels that
        # torch.distributed._functional_collectives registers (imported with torch._inductor or torch._dynamo)
        # are never entered, so they never wrap the collectives' tensors; with them, the run deadlocks at its next
        # collective, and its peer fails in wait_tensor (docs/parallelism.md, "Why compile on a fake group").
        with torch.inference_mode():
            return loader.run(list(inputs) + bound)

    run.loader = loader
    run.rebind = lambda other: _bound(loader, other, device)
    return run
