"""Per-request LoRA's cost: the denoise step of a slotted bundle (`--lora-slots R`) with empty slots and with an
adapter of rank R in them, against the same model's slot-free bundle, at the real widths.

    python -m benchmarks.lora_slots [--size 128] [--ranks 16,64] [--depth 2] [--steps 8] [--rounds 3]
    python -m benchmarks.lora_slots --smoke   # the embedded tiny model, 48x80, figures meaningless

One process: each bundle built (the default build: exact-length text, packed CFG; inductor), then in rounds, the
bundles one after another, each round starting at the next (so the machine's drift spreads over all of them),
`--steps` steps of one image each: slot-free, then per rank R the slots empty (zeros: a request without adapters)
and filled (a random adapter of rank R on every Linear of the denoiser, scale 1). Per step: the median of the step
times over the rounds. The slots' FLOPs: 2 x rows x tokens x R x (in + out) per Linear, against the Linear's own
2 x rows x tokens x in x out.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from benchmarks import parse_args, smoke_dir
from benchmarks.realwidth import write_realwidth_checkpoint

PROMPT = "a red bicycle leaning on a stone wall at dusk"


def build(ckpt: Path, out: Path, cache: Path, size: str, rank: int) -> None:
    cmd = [sys.executable, "-m", "qic.cli", "build", "--model", str(ckpt), "--output", str(out), "--cache-dir",
           str(cache), "--resolution", size, *(["--lora-slots", str(rank)] if rank else [])]
    subprocess.run(cmd, check=True, capture_output=True)


def adapter(bundle, rank: int, path: Path, seed: int = 0) -> Path:
    """A random adapter of `rank` on every slotted module (PEFT names), scaled so that it changes the output."""
    from qic.runtime.lora import Adapters
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in Adapters(bundle).modules.items():
        module, (n_out, n_in) = name.removesuffix(".weight"), shape.shape
        tensors[f"{module}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) / n_in ** 0.5
        tensors[f"{module}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * 0.1 / rank ** 0.5
    save_file(tensors, str(path))
    return path


def step_seconds(bundle, size: tuple[int, int], steps: int, lora: list | None) -> list[float]:
    from qic.runtime.generate import Request, generate
    res = generate(bundle, Request(PROMPT, steps=steps, height=size[0], width=size[1], lora=lora))
    return [v for k, v in res.timings.items() if k.startswith("step")]


def bench(args) -> dict:
    from qic.runtime.bundle import Bundle
    d: Path = args.dir
    d.mkdir(parents=True, exist_ok=True)
    cache = args.cache_dir or d / "cache"
    if args.tiny:
        from qic.checkpoint.embedded import write_checkpoint
        ckpt = write_checkpoint(d / "ckpt-tiny", "tiny")
    else:
        ckpt = write_realwidth_checkpoint(d / f"ckpt-depth{args.depth}", args.depth)
    h, w = (int(x) for x in args.size.split("x")) if "x" in args.size else (int(args.size),) * 2
    size = f"{h}x{w}"
    sides: dict[str, tuple] = {}
    for rank in [0, *args.ranks]:
        out = d / f"bundle-r{rank}"
        build(ckpt, out, cache, size, rank)
        bundle = Bundle(out)
        if rank == 0:
            sides["slot-free"] = (bundle, None)
        else:
            sides[f"R {rank}, empty"] = (bundle, None)
            sides[f"R {rank}, filled"] = (bundle, [str(adapter(bundle, rank, d / f"adapter-r{rank}.safetensors"))])
    times: dict[str, list[float]] = {k: [] for k in sides}
    for name, (bundle, lora) in sides.items():   # warm-up: first touches, the adapter read
        step_seconds(bundle, (h, w), 2, lora)
    names = list(sides)
    for r in range(args.rounds):   # each round starts at the next side: no side is always first after a switch
        for name in names[r % len(names):] + names[:r % len(names)]:
            bundle, lora = sides[name]
            times[name] += step_seconds(bundle, (h, w), args.steps, lora)
            print(f"{name}: {statistics.median(times[name]) * 1e3:.0f} ms a step", flush=True)
    return {"size": size, "depth": args.depth, "tiny": args.tiny, "steps": args.steps, "rounds": args.rounds,
            "median": {k: statistics.median(v) for k, v in times.items()}}


def table(res: dict) -> str:
    base = res["median"]["slot-free"]
    what = "tiny" if res["tiny"] else f"real width, depth {res['depth']}"
    out = [f"{what}, {res['size']}, true CFG, exact-length text; median step of {res['rounds']} rounds x "
           f"{res['steps']} steps", "", "| step graph | per step | / slot-free |", "|---|--:|--:|"]
    for name, s in res["median"].items():
        out.append(f"| {name} | {s * 1e3:.0f} ms | {s / base:.3f}x |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.lora_slots", description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="128", help="N (NxN) or HxW")
    ap.add_argument("--ranks", default="16,64", help="slot ranks, comma-separated")
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="the embedded tiny checkpoint instead of the real widths")
    ap.add_argument("--dir", type=Path, default=Path("artifacts/lora-slots"))
    ap.add_argument("--cache-dir", type=Path, help="qic's compile cache (default: DIR/cache)")
    args = parse_args(ap, argv, {"tiny": True, "size": "48x80", "ranks": "4", "steps": 2, "rounds": 1, "dir": None})
    args.dir = args.dir or smoke_dir("lora_slots")
    args.ranks = [int(r) for r in args.ranks.split(",")]
    print(table(bench(args)))


if __name__ == "__main__":
    main()
