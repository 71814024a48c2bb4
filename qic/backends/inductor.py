"""torch.export + AOTInductor: one weight-free .pt2 package per graph, for CPU or CUDA."""

from __future__ import annotations

import platform
import warnings
from pathlib import Path

import torch

from qic.backends.base import Backend, CompiledGraph
from qic.errors import ConfigError

# Weights reach the graph as inputs (see qic.build.compile), so the package holds no weights to
# leave out; the defaults stay explicit here because they are part of every cache key.
INDUCTOR_CONFIGS: dict = {}


class InductorBackend(Backend):
    name = "inductor"

    def __init__(self, device: str):
        from qic.backends.inductor_loader import check_torch
        check_torch()
        if device not in ("cpu", "cuda"):
            raise ConfigError(f"the inductor back end targets cpu or cuda, not {device!r}")
        if device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device cuda asked for, but torch sees no CUDA device",
                              "build on a machine with a GPU, or use --device cpu")
        super().__init__(device)

    def identity(self) -> dict:
        ident = {"backend": self.name, "torch": torch.__version__, "device": self.device,
                 "machine": platform.machine(), "configs": INDUCTOR_CONFIGS}
        if self.device == "cuda":
            ident["cuda"] = torch.version.cuda
            ident["capability"] = list(torch.cuda.get_device_capability())
        return ident

    def compile(self, program, out_dir: Path) -> CompiledGraph:
        from torch._inductor import aoti_compile_and_package

        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / "graph.pt2"
        with warnings.catch_warnings():
            # Inductor deep-copies the graph, constructing torch's own deprecated pytree LeafSpec: a
            # notice to torch's developers that tells a qic user nothing. Only that one is silenced.
            warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                                    category=FutureWarning)
            aoti_compile_and_package(program, package_path=str(path), inductor_configs=dict(INDUCTOR_CONFIGS))
        loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
        baked = loader.get_constant_fqns()
        if baked:  # a weight-dependent constant would silently pin one checkpoint's values
            raise RuntimeError(f"compiled graph holds constants {baked[:3]}; expected none")
        return CompiledGraph(file=path.name)
