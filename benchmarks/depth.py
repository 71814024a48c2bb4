"""Benchmark: does compiling the denoise step stay flat in depth when its blocks run as a scan?

    .venv/bin/python -m benchmarks.depth [--size 256] [--text 32] [--runs 5] [--threads 1]
        [--looped 4,16,60] [--unrolled 4,16] [--latency 4,16] [--keep DIR]
    .venv/bin/python -m benchmarks.depth --smoke   # depth 1 of each form, 32x32 px, one timed round

One denoiser width, the real head size: 4 heads of 128 (inner dim 512, MLP 2048), joint dim 256,
in_channels 64, RoPE axes (16, 56, 56); only num_layers varies. The graph is the build's step graph
(qic.models.qwen_image.graphs.denoiser_graph: StepGraph(DenoiseStep(...)), CFG batch of 2) at --size x --size pixels
(VAE scale 8, so (size/16)^2 packed image tokens) and a text bucket of --text tokens, fp32, exported with
the weights as inputs (qic.backends.inductor.build.WeightsAsInputs) and compiled by
qic.backends.inductor.build.InductorBackend.compile, then run through qic.backends.inductor.load.load, as the
build and the runtime do.

Forms: `looped` (qic.models.looped.LoopedMMDiT: one scan over stacked block weights) and `unrolled`
(qic.models.qwen_image.mmdit.QwenMMDiT: one graph copy per block). Each compile runs in a child process of its own,
with inductor's caches off and a fresh cache directory (the looped graphs of every depth share one block
body, which a warm cache would otherwise serve to the later compiles), from uninitialised, never-touched
weights: compiling reads none. Reported per graph: export seconds, compile seconds
(InductorBackend.compile: AOTInductor compile + package + its no-constant check) and .pt2 bytes.

Latency, for each depth in --latency: one child process loads both forms' packages bound to the same
random weights (matrices normal(0, 1/sqrt(fan_in)), norm weights 1 +- 0.1, other vectors 0.1 normal),
runs each once (warm-up; the rel-L2 of its step update against eager QwenMMDiT is reported), then times
--runs rounds alternating looped / unrolled, so that both forms see the same load on a shared machine;
the median is reported. Timing runs with --threads OpenMP threads (OMP_NUM_THREADS; 0 = the library
default, all cores). The default is 1: on a shared machine a multi-threaded OpenMP step collapses when
the cores are oversubscribed (measured here, the same depth-4 step: 0.20 s with 1 thread, 1.1-1.8 s
with 2 threads while another job ran), which drowns the looped/unrolled difference.

This is a benchmark, not a test: it prints a table and asserts nothing about speed. With --smoke the children
keep inductor's caches as inherited (they prove the code runs; cold compile times are not its point).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import parse_args

WIDTH = {
    "patch_size": 2, "in_channels": 64, "out_channels": 16, "attention_head_dim": 128,
    "num_attention_heads": 4, "joint_attention_dim": 256, "axes_dims_rope": [16, 56, 56],
}
VAE_SCALE = 8


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


# ------------------------------------------------------------------------------------------ children

def _step_graph(form: str, depth: int, size: int, text: int, reference=None):
    """(module, weight names, weights, example args) of the build's step graph; weights uninitialised
    (never touched) unless a reference QwenMMDiT gives them."""
    import torch

    from qic.host.prompt import DROP_TOKENS
    from qic.models.looped import stack_block_weights
    from qic.models.qwen_image.graphs import denoiser_graph
    from qic.models.qwen_image.mmdit import LoopedMMDiT, MMDiTConfig, QwenMMDiT

    config = MMDiTConfig.from_dict({**WIDTH, "num_layers": depth})
    with torch.device("meta"):
        model = (LoopedMMDiT if form == "looped" else QwenMMDiT)(config)
    model.to_empty(device="cpu")  # untouched pages: a compile-only depth costs no memory
    if reference is not None:
        sd = reference.state_dict()
        model.load_state_dict(stack_block_weights(sd, "transformer_blocks", depth) if form == "looped" else sd)
    gdef = denoiser_graph(model.eval(), config, VAE_SCALE, size, size, DROP_TOKENS + text, "float32")
    module = gdef.module.eval()
    tensors = dict(module.named_parameters())
    tensors.update(module.named_buffers())
    names = list(tensors)
    args = [t.clone() for _, t in gdef.inputs]
    g = torch.Generator().manual_seed(1)
    args[0] = torch.randn(args[0].shape, generator=g)
    args[1] = torch.randn(args[1].shape, generator=g)
    args[2][1, text // 2:] = 0  # the uncond prompt is shorter: a real mask
    return module, names, [tensors[n] for n in names], args


def _child_compile(form: str, depth: int, size: int, text: int, out_dir: Path) -> dict:
    import torch

    from qic.backends.base import Traced
    from qic.backends.inductor.build import InductorBackend, WeightsAsInputs

    module, names, weights, args = _step_graph(form, depth, size, text)
    t0 = time.perf_counter()
    with torch.no_grad():
        program = torch.export.export(WeightsAsInputs(module, names), (tuple(args), weights))
    export_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = InductorBackend("cpu").compile(Traced(None, names, program), out_dir)
    compile_s = time.perf_counter() - t0
    return {"export_s": export_s, "compile_s": compile_s, "pt2_bytes": (out_dir / compiled.file).stat().st_size}


def _child_latency(depth: int, size: int, text: int, runs: int, work: Path) -> dict:
    """Both forms of one depth in one process, timed in alternation so that they share the machine's noise."""
    import torch

    from qic.backends.inductor.load import load
    from qic.models.qwen_image.mmdit import MMDiTConfig, QwenMMDiT

    torch.manual_seed(0)
    reference = QwenMMDiT(MMDiTConfig.from_dict({**WIDTH, "num_layers": depth})).eval()
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if p.dim() > 1:
                p.normal_(0, p.shape[-1] ** -0.5)
            elif name.endswith("weight"):  # the 1-D weights are RMSNorm scales
                p.copy_(1 + 0.1 * (2 * torch.rand(p.shape) - 1))
            else:
                p.normal_(0, 0.1)
    runners, out = {}, {}
    for form in FORMS:
        module, _, weights, args = _step_graph(form, depth, size, text, reference)
        runners[form] = load(work / f"{form}-{depth}" / "graph.pt2", weights, "cpu")
    with torch.no_grad():
        want = _step_graph("unrolled", depth, size, text, reference)[0](*args)
        times = {form: [] for form in FORMS}
        for form in FORMS:  # warm-up, and numerics of the compiled step's update vs eager
            got = runners[form](args)[0]
            upd, ref_upd = (got - args[0]).double(), (want - args[0]).double()
            out[f"{form}_rel_l2"] = float((upd - ref_upd).norm() / ref_upd.norm())
        for _ in range(runs):
            for form in FORMS:
                t0 = time.perf_counter()
                runners[form](args)
                times[form].append(time.perf_counter() - t0)
    for form in FORMS:
        out[f"{form}_latency_s"] = statistics.median(times[form])
        out[f"{form}_latency_runs"] = times[form]
    return out


# ------------------------------------------------------------------------------------------ parent

FORMS = ("looped", "unrolled")
SMOKE = {"size": 32, "text": 8, "runs": 1, "looped": [1], "unrolled": [1], "latency": [1], "threads": 1}


def _spawn(child_args: list[str], args, work: Path, threads: int = 0) -> dict:
    env = dict(os.environ)
    if not args.smoke:  # cold compiles: no cache serves a later depth the block body an earlier one compiled
        cache = Path(tempfile.mkdtemp(prefix="inductor-", dir=work))
        env.update(TORCHINDUCTOR_FORCE_DISABLE_CACHES="1", TORCHINDUCTOR_CACHE_DIR=str(cache))
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    result_file = Path(tempfile.mkstemp(suffix=".json", dir=work)[1])
    cmd = [sys.executable, "-m", "benchmarks.depth", "--child", *child_args, str(result_file), "--work", str(work),
           "--size", str(args.size), "--text", str(args.text), "--runs", str(args.runs)]
    proc = subprocess.run(cmd, env=env, cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(child_args)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return json.loads(result_file.read_text())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=256, help="image height = width in pixels (multiple of 16)")
    ap.add_argument("--text", type=int, default=32, help="text tokens the step sees (the bucket minus the template)")
    ap.add_argument("--runs", type=int, default=5, help="timed step runs per graph (median reported)")
    ap.add_argument("--looped", type=_ints, default=[4, 16, 60], help="looped depths to compile")
    ap.add_argument("--unrolled", type=_ints, default=[4, 16], help="unrolled depths to compile")
    ap.add_argument("--latency", type=_ints, default=[4, 16], help="depths whose step latency is timed")
    ap.add_argument("--threads", type=int, default=1, help="OpenMP threads for timing (0: library default)")
    ap.add_argument("--keep", type=Path, default=None, help="keep the packages in this directory")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    ap.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parse_args(ap, argv, SMOKE)

    if args.child:
        kind, *rest, result_file = args.child
        if kind == "compile":
            form, depth = rest[0], int(rest[1])
            res = _child_compile(form, depth, args.size, args.text, args.work / f"{form}-{depth}")
        else:
            res = _child_latency(int(rest[0]), args.size, args.text, args.runs, args.work)
        Path(result_file).write_text(json.dumps(res))
        return

    import torch

    side = args.size // (2 * VAE_SCALE)
    print(f"benchmarks.depth: step graph, 4 heads x 128 (dim 512), joint 256, {args.size}x{args.size} px "
          f"({side * side} image + {args.text} text tokens, CFG batch 2), fp32, AOTInductor CPU")
    print(f"torch {torch.__version__}, {platform.machine()}, {os.cpu_count()} CPUs; timing: {args.runs} alternating "
          f"rounds, {args.threads or 'default'} thread(s)", flush=True)
    work = Path(tempfile.mkdtemp(prefix="qic-bench-depth-")) if args.keep is None else args.keep
    work.mkdir(parents=True, exist_ok=True)
    results: dict[tuple[str, int], dict] = {}
    latency_depths = [d for d in args.latency if d in args.looped and d in args.unrolled]
    jobs = [("looped", d) for d in args.looped] + [("unrolled", d) for d in args.unrolled]
    for form, depth in jobs:
        t0 = time.perf_counter()
        r = results[form, depth] = _spawn(["compile", form, str(depth)], args, work)
        print(f"  compiled {form:8s} depth {depth:3d}: export {r['export_s']:6.1f} s, compile {r['compile_s']:6.1f} s, "
              f".pt2 {r['pt2_bytes'] / 1e6:6.2f} MB   [{time.perf_counter() - t0:.0f} s wall]", flush=True)
    for depth in latency_depths:
        lat = _spawn(["latency", str(depth)], args, work, threads=args.threads)
        for form in FORMS:
            results[form, depth].update(latency_s=lat[f"{form}_latency_s"], rel_l2=lat[f"{form}_rel_l2"],
                                        latency_runs=lat[f"{form}_latency_runs"])
        print(f"  timed depth {depth:3d}: " + ", ".join(
            f"{form} {lat[f'{form}_latency_s'] * 1e3:.1f} ms (rel-L2 {lat[f'{form}_rel_l2']:.1e})" for form in FORMS),
            flush=True)

    print()
    print(f"| form     | depth | export s | compile s | .pt2 MB | step ms (median of {args.runs}) | rel-L2 vs eager |")
    print("|----------|------:|---------:|----------:|--------:|----------------------:|----------------:|")
    for (form, depth), r in results.items():
        lat = f"{r['latency_s'] * 1e3:.1f}" if "latency_s" in r else "-"
        rel = f"{r['rel_l2']:.1e}" if "rel_l2" in r else "-"
        print(f"| {form:8s} | {depth:5d} | {r['export_s']:8.1f} | {r['compile_s']:9.1f} | "
              f"{r['pt2_bytes'] / 1e6:7.2f} | {lat:>21} | {rel:>15} |")
    print()
    lo = args.looped
    if len(lo) >= 2:
        a, b = results["looped", min(lo)], results["looped", max(lo)]
        print(f"looped depth {max(lo)} vs {min(lo)}: compile time x{b['compile_s'] / a['compile_s']:.2f}, "
              f".pt2 size x{b['pt2_bytes'] / a['pt2_bytes']:.3f}")
    un = sorted(d for d in args.unrolled if ("looped", d) in results)
    for d in un:
        u, lp = results["unrolled", d], results["looped", d]
        line = (f"depth {d}: looped/unrolled compile time {lp['compile_s'] / u['compile_s']:.2f}, "
                f".pt2 size {lp['pt2_bytes'] / u['pt2_bytes']:.2f}")
        if "latency_s" in u and "latency_s" in lp:
            line += f", step latency {lp['latency_s'] / u['latency_s']:.2f}"
        print(line)
    if args.keep is None:
        import shutil
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
