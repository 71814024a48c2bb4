"""Benchmark: the whole denoise step per parallel layout (TP x Ulysses x CFG-parallel) on this machine.

    .venv/bin/python -m benchmarks.layouts [--layers 4] [--heads 8] [--head-dim 64] [--size 256] [--bucket 98]
                                          [--steps 5] [--warmup 2] [--compiled]
    .venv/bin/python -m benchmarks.layouts --smoke   # 1 block of 2 x 32, 32x48 px, 2 layouts, 1 step (eager)

A synthetic Qwen-Image denoiser (diffusers layout, `--heads` x `--head-dim` wide, `--layers` blocks) in qic's
step graph (qic.models.qwen_image.graphs.denoiser_graph: true CFG, norm rescale, Euler) at `--size` px square and a
text bucket of `--bucket` (the denoiser sees bucket - 34 tokens), eager fp32 by default (`--compiled`: one
AOTInductor package per layout, compiled as `qic build` does, in a process of its own on a fake process
group, and run by every rank). Each layout runs in fresh
processes on loopback with gloo, the machine's cores split between its ranks (at least one thread each: a
world larger than the cores oversubscribes them). The table gives rank 0's median seconds per step (after a
barrier) and the next latents' rel-L2 against TP 1. On a 2-core machine this proves the layouts run and
agree, not that they are fast: more ranks than cores only add the collectives' cost. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import parse_args, timed_ranks
from benchmarks.tp import _config

LAYOUTS = [(1, 1, 1), (1, 1, 2), (1, 2, 1), (2, 1, 1), (2, 2, 1), (2, 1, 2), (1, 2, 2)]


def _step(spec: dict, layout, rank: int):
    """The layout's step graph for `rank` (its TP shard, the mesh's hooks) and its inputs with the rank's
    coordinates."""
    from safetensors.torch import load_file

    from qic.builder.graphs import make_graph
    from qic.checkpoint import presets
    from qic.models.qwen_image.components import COMPONENTS
    from qic.models.qwen_image.mmdit import MMDiTConfig, QwenMMDiT
    from qic.parallel.mesh import RANK_INPUTS
    from qic.parallel.tp import apply_tp, shard_state_dict
    cfg = MMDiTConfig.from_dict(spec["config"])
    coords = layout.coords(rank)
    module = QwenMMDiT(cfg, layout.tp).eval()
    module.load_state_dict(shard_state_dict("denoiser", load_file(spec["weights"]), coords["tp"], layout.tp))
    if layout.tp > 1:
        apply_tp(module, layout.group_name("tp"))
    vae = COMPONENTS["vae_decoder"].parse_config(presets.preset("tiny")["vae"])
    configs = {"denoiser": cfg, "vae_decoder": vae}
    size = spec["size"]
    g = make_graph("denoiser", module, configs, {"resolution": [size, size], "bucket": spec["bucket"]}, "float32",
                   layout)
    gen = torch.Generator().manual_seed(0)
    inputs = []
    for name, t in g.inputs:
        if name in RANK_INPUTS:
            inputs.append(torch.tensor([coords[RANK_INPUTS[name]]]))
        elif t.is_floating_point() and t.dim() > 1:
            inputs.append(torch.randn(t.shape, generator=gen))
        else:
            inputs.append(t)
    return g, inputs


def _rank(rank: int, world: int, spec: dict, layout) -> dict:
    from qic.parallel.mesh import join
    join(layout)
    g, inputs = _step(spec, layout, rank)
    if spec["compiled"]:
        run = _compiled(rank, g, inputs, _work(spec, layout))
    else:
        def run():
            with torch.no_grad():
                return g.module(*inputs)
    return timed_ranks(run, rank, spec["warmup"], spec["steps"])


def compile_layout(spec: dict, layout, work: Path) -> None:
    """As `qic build` compiles: in a process of its own with a fake process group of the layout's world (rank 0's
    graph; only weights and rank inputs differ between ranks), qic's inductor back end, weights as inputs."""
    from qic.backends.inductor.build import InductorBackend
    from qic.builder.binding import fake_world_for
    from qic.weights import named_tensors
    with fake_world_for(layout):
        g, _ = _step(spec, layout, 0)
        backend = InductorBackend("cpu")
        work.mkdir(parents=True, exist_ok=True)
        compiled = backend.compile(backend.trace(g, named_tensors(g.module)), work)
    (work / "file").write_text(compiled.file)


def _compiled(rank: int, g, inputs, work: Path):
    """Every rank loads the package compile_layout made, with its own shard."""
    from qic.backends.inductor.load import load
    from qic.weights import named_tensors
    tensors = named_tensors(g.module)
    run = load(work / (work / "file").read_text(), [t.detach() for t in tensors.values()], "cpu")
    return lambda: run(list(inputs))[0]


def _work(spec: dict, layout) -> Path:
    return Path(spec["workdir"]) / f"layout-{layout.tp}-{layout.ulysses}-{layout.cfg}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.layouts", description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--size", type=int, default=256, help="pixels, square (default 256: 256 image tokens)")
    ap.add_argument("--bucket", type=int, default=98, help="text bucket (default 98: 64 text tokens)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--compiled", action="store_true", help="AOTInductor packages instead of eager")
    ap.add_argument("--layouts", help="TPxUxCFG,... (e.g. 1x1x1,2x1x1): the first is the reference; default all")
    args = parse_args(ap, argv, {"layers": 1, "heads": 4, "head_dim": 32, "size": 32, "bucket": 43, "steps": 1,
                                 "warmup": 0})
    from safetensors.torch import save_file

    from qic.models.qwen_image.mmdit import MMDiTConfig, QwenMMDiT
    from qic.parallel.mesh import Layout
    from qic.parallel.tp import spawn

    chosen = [tuple(int(v) for v in x.split("x")) for x in args.layouts.split(",")] if args.layouts else None
    layouts = [Layout(*t) for t in (chosen or (LAYOUTS if not args.smoke else LAYOUTS[:3:2]))]
    raw = _config(args)
    raw["in_channels"], raw["out_channels"] = 64, 16     # the real latent packing: VAE z 16 x 2 x 2
    torch.manual_seed(0)
    full = QwenMMDiT(MMDiTConfig.from_dict(raw))
    with torch.no_grad():
        for p in full.parameters():
            p.normal_(0, 0.05)
    n_params = sum(p.numel() for p in full.parameters())
    cores = os.cpu_count() or 1
    results = {}
    with tempfile.TemporaryDirectory(prefix="qic-bench-layouts-") as tmp:
        weights = Path(tmp) / "denoiser.safetensors"
        save_file({k: v.contiguous() for k, v in full.state_dict().items()}, str(weights))
        del full
        spec = {"config": raw, "weights": str(weights), "size": args.size, "bucket": args.bucket,
                "steps": args.steps, "warmup": args.warmup, "compiled": args.compiled, "workdir": tmp}
        for layout in layouts:
            threads = max(1, cores // layout.world)
            t0 = time.perf_counter()
            if args.compiled:
                import multiprocessing
                proc = multiprocessing.get_context("spawn").Process(target=compile_layout,
                                                                    args=(spec, layout, _work(spec, layout)))
                proc.start()
                proc.join()
                if proc.exitcode != 0:
                    raise SystemExit(f"compiling the step graph for {layout.describe()} failed ({proc.exitcode})")
            out = spawn(_rank, layout.world, spec, layout, threads=threads, timeout=3600)
            results[layout] = (threads, out[0])
            print(f"  {layout.describe()}: done in {time.perf_counter() - t0:.0f} s", flush=True)
    ref = results[layouts[0]][1]["out"].double()
    kind = "AOTInductor" if args.compiled else "eager"
    tokens = (args.size // 16) ** 2
    print(f"\nDenoise step (true CFG), {kind} fp32, {args.layers} blocks of {args.heads}x{args.head_dim} "
          f"({n_params / 1e6:.1f}M parameters), {tokens} image + {args.bucket - 34} text tokens; "
          f"{platform.processor() or platform.machine()}, {cores} CPUs, torch {torch.__version__}")
    print("| layout | ranks x threads | s/step (median) | range | rel-L2 vs first |")
    print("|---|---|---|---|---|")
    for layout, (threads, r0) in results.items():
        t, out = r0["times"], r0["out"].double()
        err = float((out - ref).norm() / ref.norm())
        print(f"| {layout.describe()} | {layout.world} x {threads} | {statistics.median(t):.3f} | "
              f"{min(t):.3f}-{max(t):.3f} | {err:.1e} |")
    print(json.dumps({layout.describe(): statistics.median(r0["times"]) for layout, (_, r0) in results.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
