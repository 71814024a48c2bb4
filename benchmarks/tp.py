"""Benchmark: denoiser forward time at TP=1 vs TP=2 on one machine, same total thread count.

    .venv/bin/python -m benchmarks.tp [--layers 4] [--heads 8] [--head-dim 64] [--grid 16x16] [--text 64]
                                     [--threads 2] [--steps 5] [--warmup 2] [--compiled]
    .venv/bin/python -m benchmarks.tp --smoke   # 1 block of 2 x 32, 2x2 grid, 8 text tokens, 1 step (eager)

A synthetic Qwen-Image denoiser (diffusers layout, `--heads` x `--head-dim` wide, `--layers` blocks,
joint dim = inner dim) runs one CFG-batched forward (batch 2: `--grid` packed image tokens plus
`--text` text tokens) per step, eager fp32 by default (`--compiled`: one AOTInductor package per TP
size, compiled once on rank 0 and run by every rank). Every configuration runs in fresh processes
spawned on loopback with gloo (qic.parallel.tp.spawn):

- `tp1`: one rank with `--threads` threads (`tp1-half-threads`: with half of them, for scale);
- `tp2`: two ranks with `--threads // 2` threads each (the same cores in total), all_reduce inside;
- `tp2-noreduce`: tp2 with every all_reduce removed (the all_gathers stay: the shapes need them):
  compute alone, a wrong result, so the gap to tp2 is what the all_reduces cost.

The table gives the median seconds per step (rank 0's, after a barrier; ranks are in lock-step through
their all_reduces) and the range over `--steps`, plus the output's rel-L2 against tp1. A benchmark,
not a test: it asserts nothing about speed.
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


def _config(args) -> dict:
    inner = args.heads * args.head_dim
    a0 = 2 * (args.head_dim // 8)              # frame axis; the real model's (16, 56, 56) has 16 of 128
    a1 = 2 * ((args.head_dim - a0) // 4)
    axes = [a0, a1, args.head_dim - a0 - a1]
    return {"_class_name": "QwenImageTransformer2DModel", "attention_head_dim": args.head_dim,
            "axes_dims_rope": axes, "guidance_embeds": False, "in_channels": 64,
            "joint_attention_dim": inner, "num_attention_heads": args.heads, "num_layers": args.layers,
            "out_channels": 16, "patch_size": 2}


def _inputs(cfg, rows: int, cols: int, text: int):
    from qic.models.qwen_image.mmdit import rope_tables
    g = torch.Generator().manual_seed(0)
    img = torch.randn(2, rows * cols, cfg.in_channels, generator=g)
    txt = torch.randn(2, text, cfg.joint_attention_dim, generator=g)
    t = torch.tensor([0.5, 0.5])
    cos, sin = rope_tables(cfg, rows, cols, text)
    return (img, txt, None, t, cos, sin)


def _rank(rank: int, tp: int, spec: dict) -> dict:
    from safetensors.torch import load_file

    from qic.models.qwen_image.mmdit import MMDiTConfig, QwenMMDiT
    from qic.parallel import tp as T

    cfg = MMDiTConfig.from_dict(spec["config"])
    module = QwenMMDiT(cfg, tp).eval()
    module.load_state_dict(T.shard_state_dict("denoiser", load_file(spec["weights"]), rank, tp))
    T.apply_tp(module)
    if spec["noreduce"]:  # the all_reduces only: the all_gathers (column-parallel modulation) make the shapes
        for m in module.modules():
            if "reduce" in vars(m):
                delattr(m, "reduce")   # back to the class default, no reduction (as T.clear_tp does for both)
    inputs = _inputs(cfg, *spec["grid"], spec["text"])
    if spec["compiled"]:
        run = _compiled(rank, module, inputs, Path(spec["workdir"]) / f"tp{tp}{'-noreduce' * spec['noreduce']}")
    else:
        def run():
            with torch.no_grad():
                return module(*inputs)
    return timed_ranks(run, rank, spec["warmup"], spec["steps"])


def _compiled(rank: int, module, inputs, work: Path):
    """Rank 0 compiles (torch.export of weights-as-inputs + AOTInductor); every rank loads the package."""
    from qic.backends.base import Traced
    from qic.backends.inductor.build import InductorBackend, WeightsAsInputs
    from qic.backends.inductor.load import load

    names = [n for n, _ in module.named_parameters()]
    weights = dict(module.named_parameters())
    args = tuple(x for x in inputs if x is not None)
    done = work / "done"
    if rank == 0:
        work.mkdir(parents=True, exist_ok=True)

        class NoMask(torch.nn.Module):  # the mask-free fast path, with positional tensor inputs only
            def __init__(self, m):
                super().__init__()
                self.m = m

            def forward(self, img, txt, t, cos, sin):
                return self.m(img, txt, None, t, cos, sin)

        wrapped = NoMask(module)
        full_names = ["m." + n for n in names]
        with torch.no_grad():
            program = torch.export.export(WeightsAsInputs(wrapped, full_names), (args, [weights[n] for n in names]))
        InductorBackend("cpu").compile(Traced(None, names, program), work)
        done.write_text("ok")
    else:
        while not done.exists():
            time.sleep(0.5)
    run = load(work / "graph.pt2", [weights[n].detach() for n in names], "cpu")
    return lambda: run(list(args))[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.tp", description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--grid", default="16x16", help="packed image grid, rows x cols (default 16x16: 256 tokens)")
    ap.add_argument("--text", type=int, default=64, help="text tokens (default 64)")
    ap.add_argument("--threads", type=int, default=2, help="total threads; TP=2 gives each rank half")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--compiled", action="store_true", help="AOTInductor packages instead of eager")
    args = parse_args(ap, argv, {"layers": 1, "heads": 2, "head_dim": 32, "grid": "2x2", "text": 8, "steps": 1,
                                 "warmup": 0})

    from safetensors.torch import save_file

    from qic.models.qwen_image.mmdit import MMDiTConfig, QwenMMDiT
    from qic.parallel.tp import spawn

    rows, cols = (int(v) for v in args.grid.lower().split("x"))
    load0 = os.getloadavg()
    raw = _config(args)
    cfg = MMDiTConfig.from_dict(raw)
    torch.manual_seed(0)
    full = QwenMMDiT(cfg)
    n_params = sum(p.numel() for p in full.parameters())
    with tempfile.TemporaryDirectory(prefix="qic-bench-tp-") as tmp:
        weights = Path(tmp) / "denoiser.safetensors"
        save_file({k: v.contiguous() for k, v in full.state_dict().items()}, str(weights))
        del full
        base = {"config": raw, "weights": str(weights), "grid": [rows, cols], "text": args.text,
                "steps": args.steps, "warmup": args.warmup, "compiled": args.compiled, "workdir": tmp}
        runs = [("tp1", 1, max(1, args.threads), False),
                ("tp1-half-threads", 1, max(1, args.threads // 2), False),
                ("tp2", 2, max(1, args.threads // 2), False),
                ("tp2-noreduce", 2, max(1, args.threads // 2), True)]
        results = {}
        for name, tp, threads, noreduce in runs:
            t0 = time.perf_counter()
            out = spawn(_rank, tp, dict(base, noreduce=noreduce), threads=threads, timeout=1800)
            results[name] = (tp, threads, out[0], time.perf_counter() - t0)
            print(f"  {name}: done in {results[name][3]:.0f} s", flush=True)

    ref = results["tp1"][2]["out"].double()
    kind = "AOTInductor" if args.compiled else "eager"
    print(f"\nDenoiser forward, {kind} fp32, {args.layers} blocks of {args.heads}x{args.head_dim} "
          f"({n_params / 1e6:.1f}M parameters), batch 2, {rows * cols} image + {args.text} text tokens; "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"{args.threads} threads in total; load average before/after {load0[0]:.2f}/{os.getloadavg()[0]:.2f}")
    print("| run | ranks x threads | s/step (median) | range | rel-L2 vs tp1 |")
    print("|---|---|---|---|---|")
    for name, (tp, threads, r0, _) in results.items():
        t = r0["times"]
        out = r0["out"].double()
        err = float((out - ref).norm() / ref.norm())
        print(f"| {name} | {tp} x {threads} | {statistics.median(t):.3f} | {min(t):.3f}-{max(t):.3f} | {err:.1e} |")
    print(json.dumps({k: {"median_s": statistics.median(v[2]["times"]), "times": v[2]["times"]}
                      for k, v in results.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
