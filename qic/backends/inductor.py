"""torch.export + AOTInductor: one weight-free .pt2 package per graph, for CPU or CUDA."""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import warnings
from pathlib import Path

import torch

from qic.backends.base import Backend, CompiledGraph
from qic.errors import ConfigError
from qic.target import host_target

# Weights reach the graph as inputs (see qic.build.compile), so the package holds no weights to
# leave out; the defaults stay explicit here because they are part of every cache key.
INDUCTOR_CONFIGS: dict = {}
# qic's own post-grad pass for CPU graphs (why: in that file). Keyed by its source's digest, read without
# importing it: importing inductor's pass base class costs a second on no-op builds.
PASSES_FILE = Path(__file__).with_name("inductor_passes.py")


def passes_digest() -> str:
    return hashlib.sha256(PASSES_FILE.read_bytes()).hexdigest()[:16]


def takes_qic_passes(device: str) -> bool:
    """Whether graphs on `device` get qic's own passes (CPU graphs: why in inductor_passes.py). The one
    place that decides, read by compile_options (which installs them) and identity (which keys on them)."""
    return device == "cpu"


def compile_options(device: str, passes: bool = True) -> dict:
    """The inductor configs qic compiles a graph with on `device` (passes=False: without qic's pass, for
    the before/after of qic.bench.step_profile)."""
    options = dict(INDUCTOR_CONFIGS)
    if passes and takes_qic_passes(device):
        from qic.backends.inductor_passes import UnfuseCpuBiasAddmm
        options["post_grad_custom_post_pass"] = UnfuseCpuBiasAddmm()
    return options


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
        """Everything that decides whether an artifact is right and can run here. Inductor's own config
        defaults are fixed by torch's version and git hash; what changes them is our INDUCTOR_CONFIGS and
        TORCHINDUCTOR_* variables (read at import), so those are recorded instead of importing the
        compiler (6 s) on every build, including no-op ones."""
        ident = {"backend": self.name, "torch": torch.__version__, "torch_git": torch.version.git_version,
                 "device": self.device, "configs": INDUCTOR_CONFIGS, "env": _compiler_env(),
                 "passes": {"unfuse_cpu_bias_addmm": passes_digest()} if takes_qic_passes(self.device) else {},
                 "cxx": cxx_version(), "target": host_target(self.device)}
        if self.device == "cuda":
            ident["cuda"] = torch.version.cuda
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
            aoti_compile_and_package(program, package_path=str(path), inductor_configs=compile_options(self.device))
        loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
        baked = loader.get_constant_fqns()
        if baked:  # a weight-dependent constant would silently pin one checkpoint's values
            raise RuntimeError(f"compiled graph holds constants {baked[:3]}; expected none")
        return CompiledGraph(file=path.name)


def _compiler_env() -> dict:
    # The cache location does not change what is compiled.
    return {k: v for k, v in sorted(os.environ.items())
            if (k.startswith("TORCHINDUCTOR_") and k != "TORCHINDUCTOR_CACHE_DIR")
            or k in ("ATEN_CPU_CAPABILITY", "CXX")}


@functools.lru_cache(maxsize=4)
def cxx_version(cxx: str | None = None) -> str:
    """The C++ compiler inductor uses for CPU code (cpp.cxx: $CXX, else g++), as `--version` names it."""
    cxx = cxx or os.environ.get("CXX", "g++")
    path = shutil.which(cxx)
    if path is None:
        return f"{cxx}: not found"
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30,
                             env={**os.environ, "LC_ALL": "C"}).stdout
    except (OSError, subprocess.SubprocessError):
        return f"{path}: no version"
    return f"{path}: {out.splitlines()[0] if out else 'no version'}"
