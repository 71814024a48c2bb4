"""Every benchmark still runs: `python -m benchmarks.NAME --smoke`, the same code path at the smallest sizes.

A smoke proves the benchmark runs against the current code and prints its figures; the figures mean nothing
and nothing is asserted about them. The benchmarks that build the embedded tiny model (run, serve, nocfg,
realwidth) use the session's compile cache, so they compile only the graphs no other test builds (the no-CFG
step graph). The neuron back end's benchmark runs in the lowering environment (.venv-xla); its `tp`, `real`,
`depth-sizes` and `sensitivity` modes run in full in tests/test_neuron_xla.py, its smoke runs `depth`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT

XLA_PYTHON = ROOT / ".venv-xla" / "bin" / "python"
BUILDS = ("run", "serve", "nocfg", "realwidth")   # take --dir and --cache-dir

# name -> (seconds allowed, lines it must print: regular expressions, each matched against a whole line)
SMOKES = {
    "depth": (420, [r"\| looped +\| +1 \| .*\| +[\d.]+ \| +[\d.e+-]+ \|", r"\| unrolled +\| +1 \| .*\| +[\d.]+ \|.*"]),
    "nocfg": (420, [r"\| no-CFG graph \(batch 1\) \| [\d.]+ s \| .*", r"\| CFG graph \(batch 2\) \| [\d.]+ s \| .*"]),
    "package_gap": (420, [r"\| (inproc|inproc_cpp|package) \| [\d.]+ s \| [\d.]+x \| [\d.e+-]+ \|"] * 3),
    "peak": (180, [r"\| tiny \| (text_encoder@L72|denoiser@48x80@L72|vae_decoder@48x80) \| [\d.]+ \| .*"] * 3),
    "realwidth": (420, [r"\| denoise step \(median\) \| 48x80 \| [\d.]+ s \| [\d.]+ s \| [\d.]+x \|",
                        r"\| pixel diff max / mean \(of 255\) \| 48x80 \| \d+ / [\d.]+ \| \| \|",
                        r"wrote .*/img/realwidth-step-time\.png"]),
    "run": (420, [r"\| warm: per image \(2 steps, CFG\) \| [\d.]+ s \| [\d.]+ s \| [\d.]+x \|",
                  r"\| achieved / fp32 matmul rate \| .* GFLOP/s \| .*"]),
    "serve": (600, [r"\| request 2 latency \| \d+ ms \| \|",
                    r"\| same requests, batch_sizes \[1, 2\] \(\d+ of 2 images batched\) \| [\d.]+ img/s .*"]),
    "shard": (300, [r"\| qic stage 1, TP=2, bf16 \| [\d.]+ \| .*", r".*check: rank 1: 3 tensors equal"]),
    "step_profile": (420, [r"\| (matmul|attention|fused|other|step) \| [\d.]+ \| .*"] * 5),
    "tp": (300, [r"\| (tp1|tp1-half-threads|tp2|tp2-noreduce) \| [12] x [12] \| [\d.]+ \| .*"] * 4),
    "xla_lowering": (300, [r"\{.*\}"]),
}


def _smoke(name: str, args: list, timeout: int) -> subprocess.CompletedProcess:
    python = str(XLA_PYTHON) if name == "xla_lowering" else sys.executable
    try:
        proc = subprocess.run([python, "-m", f"benchmarks.{name}", "--smoke", *map(str, args)], cwd=ROOT,
                              capture_output=True, text=True, env=dict(os.environ), timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"benchmarks.{name} --smoke ran past {timeout} s:\n{e.stdout}\n{e.stderr}")
    assert proc.returncode == 0, f"benchmarks.{name} --smoke failed ({proc.returncode}):\n{proc.stdout}\n" \
                                 f"{proc.stderr[-6000:]}"
    return proc


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.timeout(t + 30)) for n, (t, _) in SMOKES.items()])
def test_benchmark_smoke_runs_and_prints_its_figures(name, cache_dir, tmp_path):
    if name == "xla_lowering" and not XLA_PYTHON.is_file():
        pytest.skip(f"{XLA_PYTHON} is missing: `make xla-env` creates the lowering environment")
    timeout, patterns = SMOKES[name]
    args = ["--dir", tmp_path / "work", "--cache-dir", cache_dir] if name in BUILDS else []
    out = _smoke(name, args, timeout).stdout
    lines = out.splitlines()
    matched = set()
    for pattern in patterns:
        hit = next((i for i, line in enumerate(lines) if i not in matched and re.fullmatch(pattern, line)), None)
        assert hit is not None, f"benchmarks.{name} --smoke printed no line matching {pattern!r}:\n{out}"
        matched.add(hit)
    if name == "xla_lowering":
        result = json.loads(lines[-1])
        assert {"looped", "unrolled", "host_loop"} <= set(result) and "step_seconds" in result["host_loop"]["1"]
    if name == "realwidth":   # the plots go to the work directory, never into docs/img
        assert all(str(tmp_path) in line for line in lines if line.startswith("wrote ")), out
