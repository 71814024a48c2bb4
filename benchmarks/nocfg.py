"""No-CFG step graph vs the CFG step graph at guidance 1, per image, in one run.

    python -m benchmarks.nocfg [--preset small] [--steps 8] [--images 5] [--dir DIR] [--cache-dir DIR]
    python -m benchmarks.nocfg --smoke   # tiny preset, 2 steps (the scheduler's fewest), 1 image, in a temp dir

Builds the embedded preset with both step graphs (`cfg: [true, false]`) into artifacts/bench-nocfg/, then
times whole images at guidance 1: with the no-CFG graph (batch 1, what `qic run` picks) and with the
CFG graph forced (batch 2, the uncond row repeating the prompt: what qic ran before the no-CFG graph).
The two images must be the same image (max 1/255 apart); medians over --images, alternating.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks import parse_args, smoke_dir

PROMPT = "a red bicycle leaning against a blue wall"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.nocfg")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--images", type=int, default=5)
    ap.add_argument("--dir", type=Path, default=Path("artifacts/bench-nocfg"))
    ap.add_argument("--cache-dir", type=Path, help="qic's compile cache (default: DIR/cache)")
    # 72 holds PROMPT with the template's 53 tokens; the smoke's 72 makes its no-CFG graph the suite's (a cache hit).
    ap.add_argument("--text-bucket", type=int, default=128)
    args = parse_args(ap, argv, {"preset": "tiny", "steps": 2, "images": 1, "dir": None, "text_bucket": 72})
    args.dir = args.dir or smoke_dir("nocfg")

    import numpy as np

    from qic.checkpoint.embedded import write_checkpoint
    from qic.checkpoint.presets import preset
    from qic.runtime.bundle import Bundle
    from qic.runtime.generate import Request, generate
    h, w = preset(args.preset)["default_resolution"]
    ckpt = write_checkpoint(args.dir / f"ckpt-{args.preset}", args.preset)
    config = args.dir / "build.yaml"
    config.write_text(json.dumps({"model": str(ckpt), "resolutions": [f"{h}x{w}"], "text_buckets": args.text_bucket,
                                  "cfg": [True, False], "output": str(args.dir / "bundle"),
                                  "cache_dir": str(args.cache_dir or args.dir / "cache")}))
    subprocess.run([sys.executable, "-m", "qic.cli", "build", str(config)], check=True, capture_output=True)

    b = Bundle(args.dir / "bundle")
    forced = Bundle(args.dir / "bundle")
    forced.has_graph = lambda component, resolution=None, bucket=None, cfg=True, batch=1: cfg  # hide the no-CFG graph
    req = dict(prompt=PROMPT, steps=args.steps, guidance=1.0, seed=0, height=h, width=w)
    images = {}
    times: dict[str, list] = {"no-CFG graph (batch 1)": [], "CFG graph (batch 2)": []}
    steps: dict[str, list] = {k: [] for k in times}
    for i in range(args.images + 1):  # the first round warms both up
        for label, bundle in zip(times, (b, forced)):
            t = time.perf_counter()
            result = generate(bundle, Request(**req))
            images[label] = result.image
            if i:
                times[label].append(time.perf_counter() - t)
                steps[label] += [v for k, v in result.timings.items() if k.startswith("step")]
    a, c = (np.asarray(im).astype(int) for im in images.values())
    same = int(np.abs(a - c).max())
    med = {k: statistics.median(v) for k, v in times.items()}
    step = {k: statistics.median(v) for k, v in steps.items()}
    base, base_step = med["CFG graph (batch 2)"], step["CFG graph (batch 2)"]
    print(f"preset {args.preset}, {h}x{w}, {args.steps} steps, guidance 1, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; images differ by at most {same}/255")
    print("| step graph at guidance 1 | per image (median) | speed-up | per step (median) | speed-up |\n"
          "|---|--:|--:|--:|--:|")
    for k, v in med.items():
        print(f"| {k} | {v:.3f} s | {base / v:.2f}x | {step[k] * 1e3:.0f} ms | {base_step / step[k]:.2f}x |")


if __name__ == "__main__":
    main()
