"""Does the AOTInductor package run the real-width step slower than inductor's in-process compile?

    python -m benchmarks.package_gap [--size 512] [--depth 1] [--runs 7] [--tiny]
    python -m benchmarks.package_gap --smoke   # the embedded tiny model's widths, 32x32, 1 run

One step graph (benchmarks.step_profile.step_module: real widths, CFG batch 2, bucket 128), with its
weights as inputs as qic exports it (qic.backends.inductor.build.WeightsAsInputs), compiled three ways with qic's
inductor options and timed in alternation in one process:
- inproc: torch.compile, inductor's Python wrapper (what step_profile measures);
- inproc_cpp: torch.compile with cpp_wrapper, the C++ wrapper AOTInductor also emits, run in-process;
- package: torch.export + aoti_compile_and_package, loaded as qic's runtime loads it (what bundles hold).
Each is checked against eager (rel-L2). Prints the medians and each variant's ratio to inproc.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import parse_args
from benchmarks.step_profile import step_module
from qic.backends.inductor.build import WeightsAsInputs, compile_options


def variants(size: int, depth: int, workdir: Path, tiny: bool = False) -> tuple[dict, dict]:
    """name -> zero-argument callable running one step; name -> rel-L2 against eager."""
    from torch._inductor import aoti_compile_and_package
    module, inputs = step_module(size, 128, depth, tiny)
    tensors = dict(module.named_parameters()) | dict(module.named_buffers())
    names, weights = list(tensors), list(tensors.values())
    wrapped = WeightsAsInputs(module, names).eval()
    args = tuple(inputs)
    fns, errors = {}, {}
    with torch.no_grad():
        eager = wrapped(args, weights)
        for name, extra in (("inproc", {}), ("inproc_cpp", {"cpp_wrapper": True})):
            torch._dynamo.reset()
            fn = torch.compile(wrapped, fullgraph=True, options=compile_options("cpu") | extra)
            fns[name] = lambda fn=fn: fn(args, weights)
        program = torch.export.export(wrapped, (args, weights))
        path = workdir / "graph.pt2"
        aoti_compile_and_package(program, package_path=str(path), inductor_configs=compile_options("cpu"))
        loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)  # as the runtime does
        flat = [*inputs, *weights]
        fns["package"] = lambda: loader.run(flat)
        for name, fn in fns.items():
            out = fn()
            out, ref = (out[0], eager[0]) if isinstance(out, (list, tuple)) else (out, eager)
            errors[name] = float((out - ref).norm() / ref.norm())
    return fns, errors


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.package_gap", description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--depth", type=int, default=1)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--tiny", action="store_true", help="the embedded tiny model's widths instead of the real ones")
    args = parse_args(ap, argv, {"size": 32, "depth": 1, "runs": 1, "tiny": True})
    with tempfile.TemporaryDirectory() as tmp:
        fns, errors = variants(args.size, args.depth, Path(tmp), args.tiny)
        walls: dict[str, list[float]] = {n: [] for n in fns}
        with torch.no_grad():
            for _ in range(args.runs):   # alternating: the machine's load drifts between runs
                for name, fn in fns.items():
                    t0 = time.perf_counter()
                    fn()
                    walls[name].append(time.perf_counter() - t0)
    base = statistics.median(walls["inproc"])
    width = "tiny" if args.tiny else "real"
    print(f"{width} width, depth {args.depth}, {args.size}x{args.size}, bucket 128, CFG batch 2, fp32, "
          f"{torch.get_num_threads()} threads; medians of {args.runs} alternating runs")
    print("| variant | step (median) | / inproc | rel-L2 vs eager |\n|---|--:|--:|--:|")
    for name, w in walls.items():
        med = statistics.median(w)
        print(f"| {name} | {med:.3f} s | {med / base:.3f}x | {errors[name]:.1e} |")


if __name__ == "__main__":
    main()
