"""`qic doctor`: which back ends, devices and compilers this machine has, and why not where not.

Every probe is cheap and read-only: it looks things up, runs `--version`-style commands, and imports
nothing heavy (torch-xla is looked for, not imported, in this environment; the repository's .venv-xla
is asked for its versions in a subprocess).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

import click

REPO = Path(__file__).resolve().parents[2]
XLA_VENV_PYTHON = Path(".venv-xla") / "bin" / "python"
PRODUCT_NAME = Path("/sys/devices/virtual/dmi/id/product_name")


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


def collect(root: Path = REPO) -> list[Check]:
    """Every probe, in the order printed."""
    return [_torch(), _cxx(), _cuda(), _cpu_target(), _xla_here(), _xla_venv(root), _neuronx_cc(), _libnrt(),
            _devices(), _instance()]


def backends(checks: list[Check]) -> list[Check]:
    """What the probes add up to: each back end and stage, usable or not, and the first reason why not."""
    c = {k.name: k for k in checks}

    def need(name: str, *parts: str) -> Check:
        missing = [c[p] for p in parts if not c[p].ok]
        return Check(name, not missing, "; ".join(f"{m.name}: {m.detail}" for m in missing) or "ready")

    xla = c["torch-xla"] if c["torch-xla"].ok else c[".venv-xla"]
    lowering = Check("neuron lowering (HLO, checked on XLA:CPU)", xla.ok,
                     "ready" if xla.ok else f"torch-xla: {c['torch-xla'].detail}; .venv-xla: {c['.venv-xla'].detail}")
    return [need("inductor --device cpu", "torch", "c++ compiler", "cpu target"),
            need("inductor --device cuda", "torch", "c++ compiler", "cuda", "cpu target"),
            lowering,
            need("neuron compile (NEFF)", "neuronx-cc"),
            need("neuron run", "libnrt", "neuron devices")]


def run_doctor(as_json: bool = False, root: Path = REPO) -> None:
    checks = collect(root)
    summary = backends(checks)
    if as_json:
        click.echo(json.dumps({"checks": [asdict(k) for k in checks], "backends": [asdict(k) for k in summary]},
                              indent=2))
        return
    click.echo("this machine:")
    for k in checks:
        click.echo(f"  {'ok' if k.ok else '--':2}  {k.name:15} {k.detail}")
    click.echo("back ends:")
    for k in summary:
        click.echo(f"  {'ok' if k.ok else 'no':2}  {k.name}" + ("" if k.ok else f": {k.detail}"))


def _torch() -> Check:
    import torch

    from qic.backends.inductor.load import TESTED_TORCH
    have = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    tested = ", ".join(f"{a}.{b}" for a, b in TESTED_TORCH)
    if have in TESTED_TORCH:
        return Check("torch", True, f"{torch.__version__} (the AOTInductor loader is tested on {tested})")
    return Check("torch", False, f"{torch.__version__}, outside the AOTInductor loader's tested {tested}: "
                                 "inductor bundles may not load")


def _cxx() -> Check:
    for name in filter(None, (os.environ.get("CXX"), "g++", "c++", "clang++")):
        path = shutil.which(name)
        if path:
            return Check("c++ compiler", True, f"{path} ({_first_line([path, '--version'])})")
    return Check("c++ compiler", False, "no CXX, g++, c++ or clang++ on PATH (inductor compiles C++)")


def _cuda() -> Check:
    import torch
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        return Check("cuda", True, f"{n} device(s), {torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}")
    if torch.version.cuda is None:
        return Check("cuda", False, f"this torch ({torch.__version__}) is a CPU-only build")
    return Check("cuda", False, f"torch is built for CUDA {torch.version.cuda} but sees no device "
                                "(no GPU, no driver, or CUDA_VISIBLE_DEVICES hides it)")


def _cpu_target() -> Check:
    """Which CPU levels this machine runs, and what inductor builds here compile CPU code for."""
    from qic.backends.inductor import target
    from qic.errors import QicError
    runs = target.runnable_levels()
    try:
        chosen = target.resolve_cpu_target()
    except QicError as e:
        return Check("cpu target", False, str(e))
    how = f"the default, {target.DEFAULT_CPU_TARGET}; a build's cpu_target or --cpu-target chooses another"
    lacks = target.target_mismatch(target.host_target("cpu", chosen), "cpu")
    detail = (f"{platform.machine()}, runs {', '.join(runs) or 'no declared level'}; builds compile CPU code for "
              f"{chosen} ({how})")
    return Check("cpu target", not lacks, detail + (f", which this machine cannot run: {lacks}" if lacks else ""))


def _xla_here() -> Check:
    if importlib.util.find_spec("torch_xla") is None:
        return Check("torch-xla", False, "not installed in this environment")
    return Check("torch-xla", True, f"{importlib.metadata.version('torch-xla')} in this environment")


def _xla_venv(root: Path) -> Check:
    python = Path(root) / XLA_VENV_PYTHON
    if not python.exists():
        return Check(".venv-xla", False, f"no {python} (`make xla-env` creates it)")
    probe = "import torch, torch_xla; print(torch.__version__, torch_xla.__version__)"
    try:
        proc = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        return Check(".venv-xla", False, f"{python} did not answer: {e}")
    parts = proc.stdout.split()
    if proc.returncode != 0 or len(parts) != 2:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return Check(".venv-xla", False, f"{python} cannot import torch and torch_xla: {last}")
    return Check(".venv-xla", True, f"torch {parts[0]}, torch-xla {parts[1]} ({python})")


def _neuronx_cc() -> Check:
    from qic.backends.neuron import cc as neuron_cc
    from qic.errors import QicError
    path, why = neuron_cc.find()
    if path is None:
        return Check("neuronx-cc", False, why)
    try:
        return Check("neuronx-cc", True, f"{neuron_cc.version(path)} ({path})")
    except QicError as e:
        return Check("neuronx-cc", False, str(e))


def _libnrt() -> Check:
    import ctypes

    from qic.backends.neuron import nrt as neuron_loader
    path, why = neuron_loader.find_library()
    if path is None:
        return Check("libnrt", False, why)
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        return Check("libnrt", False, f"{path} cannot be loaded: {e}")
    if not hasattr(lib, "nrt_load_collectives"):
        return Check("libnrt", False, f"{path} lacks nrt_load_collectives")
    return Check("libnrt", True, path)


def _devices() -> Check:
    found = sorted(str(p) for p in Path("/dev").glob("neuron*"))
    if found:
        return Check("neuron devices", True, f"{len(found)}: {' '.join(found[:4])}{' ...' if len(found) > 4 else ''}")
    return Check("neuron devices", False, "no /dev/neuron* (not a Trainium host, or the aws-neuronx-dkms "
                                          "driver is not loaded)")


def _instance() -> Check:
    try:
        name = PRODUCT_NAME.read_text().strip()
    except OSError:
        return Check("instance type", False, f"{PRODUCT_NAME} is not readable")
    trainium = name.startswith(("trn1", "trn2", "trn3"))
    return Check("instance type", trainium, name + ("" if trainium else " (not a Trainium instance)"))


def _first_line(cmd: list[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        return (out.stdout or out.stderr).strip().splitlines()[0]
    except (OSError, subprocess.TimeoutExpired, IndexError):
        return "version unknown"
