"""Run-time benchmark: `qic run` against diffusers on one checkpoint, in one run.

    python -m benchmarks.run [--preset small] [--steps 8] [--images 5] [--dir DIR] [--cache-dir DIR]
    python -m benchmarks.run --smoke   # the tiny preset, 2 steps, 1 image, under a temporary directory

Measures, on the embedded preset (built into artifacts/bench-run/ unless present):
- cold: process start to PNG, `qic run` vs a diffusers script doing from_pretrained + one image;
- warm: per-image latency in resident mode vs diffusers' per-image pipeline call (medians);
- the denoise step: time per step vs its FLOP count (torch's FlopCounterMode on the eager step) at
  this machine's measured fp32 matmul rate, i.e. the achieved fraction.
Prints a table and its markdown form for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks import parse_args, smoke_dir

PROMPT = "a red bicycle leaning against a blue wall"


def matmul_gflops(smoke: bool = False, reps: int = 5) -> float:
    """GFLOP/s of a 2048^3 fp32 matmul; --smoke's is 256^3 (the rate it prints means nothing, the path is what it
    proves)."""
    n = 256 if smoke else 2048
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n ** 3 * reps / (time.perf_counter() - t) / 1e9


def cold(cmd: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.run")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--images", type=int, default=5)
    ap.add_argument("--dir", type=Path, default=Path("artifacts/bench-run"))
    ap.add_argument("--cache-dir", type=Path, help="qic's compile cache for the build (default: DIR/cache)")
    args = parse_args(ap, argv, {"preset": "tiny", "steps": 2, "images": 1, "dir": None})
    args.dir = args.dir or smoke_dir("run")

    from qic.checkpoint.embedded import write_checkpoint
    from qic.checkpoint.presets import preset
    h, w = preset(args.preset)["default_resolution"]
    ckpt = write_checkpoint(args.dir / f"ckpt-{args.preset}", args.preset)
    bundle = args.dir / f"bundle-{args.preset}"
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "qic.cli", "build", "--model", str(ckpt), "--output", str(bundle),
                    "--cache-dir", str(args.cache_dir or args.dir / "cache"), "--resolution", f"{h}x{w}",
                    "--text-buckets", "128"],
                   check=True, capture_output=True)
    build_s = time.perf_counter() - t

    common = dict(prompt=PROMPT, steps=args.steps, seed=0)
    qic_cold = cold([sys.executable, "-m", "qic.cli", "run", str(bundle), "--prompt", PROMPT, "--steps",
                     str(args.steps), "--output", str(args.dir / "cold.png")])
    diffusers_script = (
        "import torch; from diffusers import QwenImagePipeline;"
        f"p = QwenImagePipeline.from_pretrained({str(ckpt)!r}, torch_dtype=torch.float32);"
        "p.set_progress_bar_config(disable=True);"
        f"p({PROMPT!r}, negative_prompt=' ', true_cfg_scale=4.0, num_inference_steps={args.steps}, height={h},"
        f" width={w}, generator=torch.Generator('cpu').manual_seed(0)).images[0].save({str(args.dir / 'd.png')!r})")
    # --smoke leaves the diffusers cold start out (a fresh interpreter importing diffusers, ~5 s of a core): the
    # same from_pretrained and pipeline call run in this process below, so the smoke still proves the API.
    diffusers_cold = None if args.smoke else cold([sys.executable, "-c", diffusers_script])

    from diffusers import QwenImagePipeline

    from qic.runtime.bundle import Bundle
    from qic.runtime.generate import Request, generate
    b = Bundle(bundle)
    generate(b, Request(height=h, width=w, **common))
    qic_warm, step_times = [], []
    for _ in range(args.images):
        t = time.perf_counter()
        r = generate(b, Request(height=h, width=w, **common))
        qic_warm.append(time.perf_counter() - t)
        step_times += [v for k, v in r.timings.items() if k.startswith("step")]
    pipe = QwenImagePipeline.from_pretrained(str(ckpt), torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    diffusers_warm = []
    for i in range(args.images + 1):
        t = time.perf_counter()
        pipe(PROMPT, negative_prompt=" ", true_cfg_scale=4.0, num_inference_steps=args.steps, height=h, width=w,
             generator=torch.Generator("cpu").manual_seed(0))
        if i:
            diffusers_warm.append(time.perf_counter() - t)

    flops = step_flops(ckpt, h, w)
    rate = matmul_gflops(args.smoke)
    step = statistics.median(step_times)
    achieved = flops / step / 1e9
    qw, dw = statistics.median(qic_warm), statistics.median(diffusers_warm)
    rows = [
        ("build (cold cache)", f"{build_s:.1f} s", "", ""),
        ("cold: process start to PNG", f"{qic_cold:.2f} s", *((f"{diffusers_cold:.2f} s",
         f"{diffusers_cold / qic_cold:.1f}x") if diffusers_cold else ("-", "-"))),
        (f"warm: per image ({args.steps} steps, CFG)", f"{qw:.3f} s", f"{dw:.3f} s", f"{dw / qw:.2f}x"),
        ("denoise step (median)", f"{step * 1e3:.1f} ms", "", ""),
        ("step FLOPs (batch 2)", f"{flops / 1e9:.2f} GFLOP", "", ""),
        ("achieved / fp32 matmul rate", f"{achieved:.1f} / {rate:.1f} GFLOP/s", "", f"{achieved / rate:.0%}"),
    ]
    print(f"preset {args.preset}, {h}x{w}, {args.steps} steps, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print("| measure | qic | diffusers | diffusers / qic |\n|---|--:|--:|--:|")
    for r in rows:
        print("| " + " | ".join(r) + " |")


def step_flops(ckpt: Path, h: int, w: int) -> float:
    """FLOPs of one CFG step (batch 2) counted on the eager graph qic compiles."""
    from torch.utils.flop_counter import FlopCounterMode

    from qic.builder.eager import EagerModel
    m = EagerModel(ckpt, [(h, w)], [128])
    g = m.graph("denoiser", (h, w), 128)
    args = [t.clone() for _, t in g.examples]
    with FlopCounterMode(display=False) as counter:
        g(*args)
    return float(counter.get_total_flops())


if __name__ == "__main__":
    main()
