"""Every benchmark still runs: `python -m benchmarks.NAME --smoke`, the same code path at the smallest sizes.

A smoke proves that the benchmark runs against the current code and prints its figures; the figures mean
nothing and nothing is asserted about them. The benchmarks that build the embedded tiny model (run, serve,
nocfg, realwidth, noop_build) build into the session's compile cache, so they compile only graphs no other test
builds (the no-CFG step graph). xla_lowering runs in the lowering environment (.venv-xla); its `tp`, `real`,
`depth-sizes` and `sensitivity` modes run in full in tests/test_neuron_xla.py, its smoke runs `depth`.

The smokes are mostly process starts, imports and single-threaded C++ compiles, so they run two at a time
(one beside another xdist worker; a module fixture starts them, in the order below, when the first test
asks); each test waits for its own.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests import zygote_client as zygote
from tests.conftest import ROOT, xdist_worker

pytestmark = pytest.mark.slow   # each smoke runs a benchmark: builds, compiles, serves

XLA_PYTHON = ROOT / ".venv-xla" / "bin" / "python"
# These take --dir and --cache-dir.
BUILDS = ("run", "serve", "nocfg", "realwidth", "soak", "shapes_quality", "step_cache", "noop_build", "per_image",
          "lora_slots")
# Two lanes on two cores: two smokes at a time, or one beside the other xdist worker (`make test`'s -n 2), so the
# seconds allowed below hold the same load either way.
PARALLEL = 1 if xdist_worker() else 2

# name -> (seconds allowed, lines it must print: regular expressions, each matching a whole line of its own).
# The longest first, so that the two-wide queue ends together.
SMOKES = {
    "depth": (420, [r"\| looped +\| +1 \| .*\| +[\d.]+ \| +[\d.e+-]+ \|", r"\| unrolled +\| +1 \| .*\| +[\d.]+ \|.*"]),
    "serve": (600, [r"\| request 2 latency \| \d+ ms \| +\|",
                    r"\| same requests, batch_sizes \[1, 2\] \(\d+ of 2 images batched\) \| [\d.]+ img/s .*"]),
    "nocfg": (420, [r"\| no-CFG graph \(batch 1\) \| [\d.]+ s \| .*", r"\| CFG graph \(batch 2\) \| [\d.]+ s \| .*"]),
    "per_image": (420, [r"\| float32 \| 48x80 \| short \(\d+/\d+\) \| "
                        r"(qic|qic-128|diffusers|diffusers-compile) \| [\d.]+ s \| [\d.]+x \| \d+ ms \| "
                        r"[\d.]+ s \| [\d.]+ s \| [\d.]+ s \| -?[\d.]+ s \| [\d.]+ \| .*"] * 4),
    "run": (420, [r"\| warm: per image \(2 steps, CFG\) \| [\d.]+ s \| [\d.]+ s \| [\d.]+x \|",
                  r"\| achieved / fp32 matmul rate \| .* GFLOP/s \| .*"]),
    "noop_build": (420, [r"\| (no-op build|qic run cold start|import torch) \| [\d.]+ s \| [\d.]+ s \|"] * 3
                   + [r"\| no-op build / cold start \| [\d.]+x \| [\d.]+x \|"]),
    "realwidth": (420, [r"\| denoise step \(median\) \| 48x80 \| [\d.]+ s \| [\d.]+ s \| [\d.]+x \|",
                        r"\| pixel diff max / mean \(of 255\) \| 48x80 \| \d+ / [\d.]+ \| \| \|",
                        r"wrote .*/img/realwidth-step-time\.png"]),
    "package_gap": (420, [r"\| (inproc|inproc_cpp|package) \| [\d.]+ s \| [\d.]+x \| [\d.e+-]+ \|"] * 3),
    "step_profile": (420, [r"\| (matmul|attention|fused|other|step) \| [\d.]+ \| .*"] * 5),
    "tp": (300, [r"\| (tp1|tp1-half-threads|tp2|tp2-noreduce) \| [12] x [12] \| [\d.]+ \| .*"] * 4),
    "layouts": (300, [r"\| TP 1 \(world 1\) \| 1 x \d+ \| [\d.]+ \| .*",
                      r"\| TP 1 x Ulysses 2 \(world 2\) \| 2 x \d+ \| [\d.]+ \| .*"]),
    "xla_lowering": (300, [r"\{.*\}"]),
    "shard": (300, [r"\| qic stage 1, TP=2, bf16 \| [\d.]+ \| .*", r".*check: rank 1: 3 tensors equal"]),
    "cpu_target": (300, [r"\| x86-64-v3 \| [\d.]+ \| [\d.]+ \| - \| (0|-) \| [\d.e+-]+ \| \d+ \|"]),
    "shapes_quality": (300, [r"\| (held-out|training) \| (128x128|all) \| 2 \| [\d.]+ \| [\d.]+ \| [\d.]+ \| "
                             r"[\d.]+ \|"] * 4),
    "step_cache": (420, [r"\| tiny \| 3 \| 3 \| (uncached|threshold [\d.e+-]+|mask 3/3) \| [\d.]+ \| [\d.]+ \| .*"] * 5
                   + [r"\| tiny \| 3 \| 3 \| mask 3/3( \| [\d.]+){7} \| - \|",   # qic's stages: all 3 computed
                      r"wrote .*/img/step-cache\.png"]),
    "q21_step": (300, [r"\| (text|text \+ one 64x64 image) \| [\d.]+ s \| [\d.]+ s \| [\d.]+x \| "
                       r"[\d.]+ s \| [\d.]+ s \| [\d.]+ s \| [\d.]+x \| [\d.e+-]+ \| \d+ s \|"] * 2),
    "edit": (300, [r"\| (vision|language model|vae_encoder|steps|decoder|all stages) \| [\d.]+ \| [\d.]+ \| "
                   r"[\d.]+x \|"] * 6 + [r"default Plus build .*: 29 graphs, about [\d.]+ min of compiling .*"]),
    "lora_slots": (300, [r"\| (slot-free|R 4, empty|R 4, filled) \| \d+ ms \| [\d.]+x \|"] * 3),
    "peak": (180, [r"\| tiny \| (text_encoder@L72|denoiser@48x80@L72|vae_decoder@48x80) \| [\d.]+ \| .*"] * 3),
}


class Smokes:
    """The selected smokes, run `PARALLEL` at a time in their own process groups."""

    def __init__(self, names: list[str], cache_dir, work):
        self.procs: dict[str, subprocess.Popen] = {}
        self.work = work
        self.pool = ThreadPoolExecutor(PARALLEL)
        self.futures = {n: self.pool.submit(self._run, n, cache_dir, work / n) for n in SMOKES if n in names}

    def _run(self, name: str, cache_dir, work) -> tuple[int, str, str, float]:
        """The smoke in a session of its own (what it starts is killed with it), forked from the zygote of its
        python (tests/zygote.py: the interpreter and torch already started), its streams written to files."""
        python = str(XLA_PYTHON) if name == "xla_lowering" else sys.executable
        args = ["--dir", work, "--cache-dir", cache_dir] if name in BUILDS else []
        argv = [python, "-m", f"benchmarks.{name}", "--smoke", *map(str, args)]
        env = {**os.environ, "PYTHONPATH": str(ROOT)} if name == "xla_lowering" else dict(os.environ)
        streams = self.work / f"{name}.stdout", self.work / f"{name}.stderr"
        t0 = time.perf_counter()
        proc = self.procs[name] = zygote.popen(argv, env, ROOT, *streams, start_new_session=True)
        try:
            code = proc.wait(timeout=SMOKES[name][0])
        except subprocess.TimeoutExpired:
            self._kill(proc)
            proc.wait()
            code = -1
        out, err = (path.read_text(errors="replace") for path in streams)
        return code, out, err, time.perf_counter() - t0

    @staticmethod
    def _kill(proc) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)   # its own session: the benchmark and what it started
        except ProcessLookupError:
            pass

    def close(self) -> None:
        for f in self.futures.values():
            f.cancel()
        for proc in self.procs.values():
            if proc.poll() is None:
                self._kill(proc)
        self.pool.shutdown(wait=True)


@pytest.fixture(scope="module")
def smokes(request, cache_dir, tmp_path_factory):
    names = [item.callspec.params["name"] for item in request.session.items
             if item.module is request.module and hasattr(item, "callspec")]
    runner = Smokes(names, cache_dir, tmp_path_factory.mktemp("smokes"))
    yield runner
    runner.close()


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.timeout(t + 60)) for n, (t, _) in SMOKES.items()])
def test_benchmark_smoke_runs_and_prints_its_figures(name, smokes):
    if name == "xla_lowering":   # `make test` installs it: its absence is a failed set-up, not a skip
        assert XLA_PYTHON.is_file(), f"{XLA_PYTHON} is missing: `make xla-env` creates the lowering environment"
    limit, patterns = SMOKES[name]
    rc, out, err, seconds = smokes.futures[name].result()
    print(f"benchmarks.{name} --smoke: {seconds:.1f} s (two smokes at a time)")
    assert rc != -1, f"benchmarks.{name} --smoke ran past {limit} s:\n{out}\n{err[-6000:]}"
    assert rc == 0, f"benchmarks.{name} --smoke failed ({rc}):\n{out}\n{err[-6000:]}"
    lines = out.splitlines()
    matched: set[int] = set()
    for pattern in patterns:
        hit = next((i for i, line in enumerate(lines) if i not in matched and re.fullmatch(pattern, line)), None)
        assert hit is not None, f"benchmarks.{name} --smoke printed no line matching {pattern!r}:\n{out}"
        matched.add(hit)
    if name == "xla_lowering":
        result = json.loads(lines[-1])
        assert {"looped", "unrolled", "host_loop"} <= set(result) and "step_seconds" in result["host_loop"]["1"]
    if name == "realwidth":   # the plots go to the work directory, never into docs/img
        wrote = [line for line in lines if line.startswith("wrote ")]
        assert wrote and all(line.startswith(f"wrote {smokes.work / name}/") for line in wrote), out


def test_step_profile_puts_inductors_kernels_apart_from_the_ops_they_feed():
    # inductor names a kernel after the ops its outputs feed: the one writing q, k, v for SDPA is no attention
    from benchmarks.step_profile import category
    assert category("graph_3_cpp_fused__scaled_dot_product_flash_attention_for_cpu_add_addmm") == "fused"
    assert category("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert category("aten::mm") == "matmul" and category("aten::copy_") == "other"
