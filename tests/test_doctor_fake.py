"""`qic doctor` with the FAKE neuronx-cc, FAKE libnrt and a FAKE .venv-xla python present, and without
them: each probe says what it found or why not, and the back-end summary follows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from qic.backends.neuron import nrt as neuron_loader
from qic.cli import doctor as cli_doctor

FAKES = Path(__file__).resolve().parent / "fakes"


def by_name(checks) -> dict:
    return {c.name: c for c in checks}


def test_doctor_with_fakes(tmp_path, monkeypatch, fake_libnrt):
    lib = fake_libnrt
    venv_python = tmp_path / ".venv-xla" / "bin" / "python"       # a FAKE interpreter answering the probe
    venv_python.parent.mkdir(parents=True)
    venv_python.write_text("#!/bin/sh\necho 2.9.0 2.9.0\n")
    venv_python.chmod(0o755)
    monkeypatch.setenv("PATH", f"{FAKES}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("QIC_LIBNRT", str(lib))
    checks = by_name(cli_doctor.collect(root=tmp_path))
    assert checks["neuronx-cc"].ok and checks["neuronx-cc"].detail.startswith("2.99.0.0+fake")
    assert checks["libnrt"].ok and checks["libnrt"].detail == str(lib)
    assert checks[".venv-xla"].ok and checks[".venv-xla"].detail.startswith("torch 2.9.0, torch-xla 2.9.0")
    summary = by_name(cli_doctor.backends(list(checks.values())))
    assert summary["neuron compile (NEFF)"].ok
    assert summary["neuron lowering (HLO, checked on XLA:CPU)"].ok
    # The fake library is no device: running still needs /dev/neuron*, and says so.
    if not checks["neuron devices"].ok:
        assert not summary["neuron run"].ok and "no /dev/neuron*" in summary["neuron run"].detail


def test_doctor_without_neuron(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))                    # nothing on PATH: no compilers at all
    monkeypatch.delenv("QIC_LIBNRT", raising=False)
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(neuron_loader.ctypes.util, "find_library", lambda name: None)
    monkeypatch.setattr(neuron_loader, "DEFAULT_LIBNRT", str(tmp_path / "libnrt.so.1"))
    checks = by_name(cli_doctor.collect(root=tmp_path))
    assert "not on PATH" in checks["neuronx-cc"].detail and not checks["neuronx-cc"].ok
    assert "libnrt (the Neuron runtime) not found" in checks["libnrt"].detail
    assert "make xla-env" in checks[".venv-xla"].detail
    assert not checks["c++ compiler"].ok
    summary = by_name(cli_doctor.backends(list(checks.values())))
    assert not summary["inductor --device cpu"].ok and "c++ compiler" in summary["inductor --device cpu"].detail
    assert not summary["neuron compile (NEFF)"].ok and not summary["neuron run"].ok


def test_doctor_command(tmp_path):
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root)}
    env.pop("QIC_LIBNRT", None)
    proc = subprocess.run([sys.executable,
                           "-m", "qic.cli", "doctor", "--json"], capture_output=True, text=True, env=env, cwd=root)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    names = [c["name"] for c in report["checks"]]
    assert names[:3] == ["torch", "c++ compiler", "cuda"] and "neuronx-cc" in names
    assert {b["name"] for b in report["backends"]} >= {"inductor --device cpu", "neuron run"}
