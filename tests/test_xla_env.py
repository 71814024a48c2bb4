"""`make xla-env` installs what pip resolves for torch 2.9 + torch-xla 2.9 + qic, less the GPU-only packages that
lowering on XLA:CPU never loads (scripts/xla_env_requirements.py; the lowering tests, tests/test_neuron_xla.py,
run in the environment it makes)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT

SCRIPT = ROOT / "scripts" / "xla_env_requirements.py"


def _item(name: str, version: str, editable: bool = False) -> dict:
    info = {"url": "file:///src", "dir_info": {"editable": True}} if editable else {"url": f"file:///{name}.whl"}
    return {"metadata": {"name": name, "version": version}, "download_info": info}


def test_the_requirements_are_the_resolved_set_less_gpu_only_packages_and_the_project(tmp_path):
    report = {"install": [_item("torch", "2.9.0"), _item("triton", "3.5.0"), _item("nvidia-cudnn-cu12", "9.10.2.21"),
                          _item("nvidia_cusolver_cu12", "11.7.3.90"), _item("nvidia-cuda-nvrtc-cu12", "12.8.93"),
                          _item("nvidia-nvtx-cu12", "12.8.90"), _item("qic", "0.1.0", editable=True),
                          _item("Torch_XLA", "2.9.0")]}
    (tmp_path / "plan.json").write_text(json.dumps(report))
    out = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "plan.json")], capture_output=True, text=True,
                         check=True).stdout.split()
    # cudnn stays: libtorch_cuda.so names libcudnn.so.9, and `import torch` loads it on a CPU too.
    assert out == ["nvidia-cudnn-cu12==9.10.2.21", "torch-xla==2.9.0", "torch==2.9.0"]
