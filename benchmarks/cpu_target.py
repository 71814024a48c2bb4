"""What does compiling for a portable CPU level cost? The denoise step compiled native vs x86-64-v3 vs x86-64-v4.

    python -m benchmarks.cpu_target [--size 512] [--depth 1] [--runs 7] [--targets native,x86-64-v3,x86-64-v4]
    python -m benchmarks.cpu_target --smoke   # the embedded tiny model's widths, 32x32, 1 run, v3 only

One step graph (benchmarks.step_profile.step_module: real widths, hidden 3072, CFG batch 2, bucket 128,
`--depth` blocks), exported with its weights as inputs and compiled by qic's back end
(qic.backends.inductor.build.InductorBackend(cpu_target=...).compile, as `qic build` does) once per target,
each in a child process of its own (all at once: compile time is not the point here). One process then
loads every package through the runtime's loader (qic.backends.inductor.load.load), checks each against
eager (rel-L2), and times `--runs` rounds in alternation (the machine's load drifts) with `--threads`
threads (default 1: on a shared machine a multi-threaded OpenMP step collapses when the cores are
oversubscribed; benchmarks.depth measured it). Targets this machine cannot run are skipped. Prints the
median ms/step, the ratio to native, and how many instructions on AVX-512 (zmm) registers each compiled
.so holds (objdump -d, where installed).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

TARGETS = ("native", "x86-64-v3", "x86-64-v4")


def _graph(size: int, depth: int, tiny: bool):
    """(module, weight names, weights, inputs) of the step graph; the seed makes every process's weights equal."""
    from benchmarks.step_profile import step_module
    module, inputs = step_module(size, 128, depth, tiny)
    tensors = dict(module.named_parameters()) | dict(module.named_buffers())
    return module, list(tensors), list(tensors.values()), inputs


def child_compile(target: str, out: Path, size: int, depth: int, tiny: bool) -> None:
    import torch

    from qic.backends.base import Traced
    from qic.backends.inductor.build import InductorBackend, WeightsAsInputs
    module, names, weights, inputs = _graph(size, depth, tiny)
    with torch.no_grad():
        program = torch.export.export(WeightsAsInputs(module, names), (tuple(inputs), weights))
    t0 = time.perf_counter()
    InductorBackend("cpu", cpu_target=target).compile(Traced(None, names, program), out)
    print("COMPILED " + json.dumps({"compile_s": time.perf_counter() - t0}))


# An instruction line of `objdump -d`: its address, a colon and a tab ("  1a40:\t62 f1 ...\tvmovups %zmm0,...").
# Only these count: the header names the library's path, which a temp directory or a content hash can spell
# "zmm" in, and symbol lines hold names.
_INSTRUCTION = re.compile(r"^\s*[0-9a-f]+:\t")


def zmm_instructions(disassembly: str) -> int:
    """Instructions that name an AVX-512 (zmm) register (`%zmm` in AT&T syntax) in `objdump -d` output."""
    return sum(bool(_INSTRUCTION.match(line)) and "%zmm" in line for line in disassembly.splitlines())


def zmm_count(pt2: Path) -> int | None:
    """Instructions on AVX-512 (zmm) registers in the package's compiled code (None without objdump)."""
    if not shutil.which("objdump"):
        return None
    with zipfile.ZipFile(pt2) as z, tempfile.TemporaryDirectory() as tmp:
        sos = [z.extract(n, tmp) for n in z.namelist() if n.endswith(".so")]
        dis = "".join(subprocess.run(["objdump", "-d", so], capture_output=True, text=True, check=True).stdout
                      for so in sos)
    return zmm_instructions(dis)


def bench(args, work: Path) -> dict:
    import torch

    from qic.backends.inductor.load import load
    from qic.backends.inductor.target import host_target, target_mismatch
    if args.threads:
        torch.set_num_threads(args.threads)
    runnable = [t for t in args.targets if t == "native" or not target_mismatch(host_target("cpu", t), "cpu")]
    res = {"size": args.size, "depth": args.depth, "tiny": args.tiny, "runs": args.runs,
           "threads": torch.get_num_threads(), "skipped": [t for t in args.targets if t not in runnable], "targets": {}}
    base = [sys.executable, "-m", "benchmarks.cpu_target", "--size", str(args.size), "--depth", str(args.depth)]
    procs = {t: subprocess.Popen([*base, *(["--tiny"] if args.tiny else []), "--compile-child", t, str(work / t)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for t in runnable}
    for t, p in procs.items():
        out, err = p.communicate()
        if p.returncode:
            raise SystemExit(f"compiling for {t} failed ({p.returncode}):\n{err[-4000:]}")
        line = next(x for x in out.splitlines() if x.startswith("COMPILED "))
        res["targets"][t] = json.loads(line[len("COMPILED "):]) | {"zmm": zmm_count(work / t / "graph.pt2")}
    module, _, weights, inputs = _graph(args.size, args.depth, args.tiny)
    runners = {t: load(work / t / "graph.pt2", weights, "cpu") for t in runnable}
    with torch.no_grad():
        want = module(*inputs)
        want = want[0] if isinstance(want, (list, tuple)) else want
        walls: dict[str, list[float]] = {t: [] for t in runnable}
        for t, run in runners.items():   # warm-up, and numerics against eager
            got = run(inputs)[0]
            res["targets"][t]["rel_l2"] = float((got - want).norm() / want.norm())
        for _ in range(args.runs):
            for t, run in runners.items():
                t0 = time.perf_counter()
                run(inputs)
                walls[t].append(time.perf_counter() - t0)
    for t in runnable:
        res["targets"][t] |= {"step_ms": statistics.median(walls[t]) * 1e3, "min_ms": min(walls[t]) * 1e3}
    return res


def table(res: dict) -> str:
    width = "tiny" if res["tiny"] else "real (hidden 3072)"
    native = res["targets"].get("native", {}).get("step_ms")
    lines = [f"{width} width, depth {res['depth']}, {res['size']}x{res['size']}, bucket 128, CFG batch 2, fp32, "
             f"{res['threads']} threads; medians of {res['runs']} alternating runs"
             + (f"; skipped (this CPU cannot run them): {', '.join(res['skipped'])}" if res["skipped"] else ""),
             "| cpu_target | ms / step | min | / native | zmm instructions | rel-L2 vs eager | compile s (at once) |",
             "|---|--:|--:|--:|--:|--:|--:|"]
    for t, r in res["targets"].items():
        ratio = f"{r['step_ms'] / native:.3f}x" if native else "-"
        zmm = "-" if r["zmm"] is None else str(r["zmm"])
        lines.append(f"| {t} | {r['step_ms']:.1f} | {r['min_ms']:.1f} | {ratio} | {zmm} | {r['rel_l2']:.1e} | "
                     f"{r['compile_s']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from benchmarks import parse_args
    ap = argparse.ArgumentParser(prog="python -m benchmarks.cpu_target", description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--depth", type=int, default=1)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--threads", type=int, default=1, help="threads for the timed steps (0: torch's default)")
    ap.add_argument("--tiny", action="store_true", help="the embedded tiny model's widths instead of the real ones")
    ap.add_argument("--compile-child", nargs=2, metavar=("TARGET", "DIR"), help=argparse.SUPPRESS)
    args = parse_args(ap, argv, {"size": 32, "depth": 1, "runs": 1, "tiny": True,
                                       "targets": "x86-64-v3"})   # a compile is the smoke's cost (~25 s)
    if args.compile_child:
        return child_compile(args.compile_child[0], Path(args.compile_child[1]), args.size, args.depth, args.tiny)
    args.targets = [t for t in args.targets.split(",") if t]
    with tempfile.TemporaryDirectory(prefix="qic-cpu-target-") as tmp:
        print(table(bench(args, Path(tmp))))


if __name__ == "__main__":
    main()
