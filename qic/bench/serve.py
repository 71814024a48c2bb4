"""Serving benchmark: `qic serve` latency and throughput over loopback, against in-process `generate`.

    python -m qic.bench.serve [--bundle DIR | --preset tiny] [--steps 8] [--requests 16] [--clients 4]

Measures, in one run:
- start: process start to /health answering (load and the warm-up pass included; nothing compiles);
- latency of request 1 vs request 10 (sequential, one client), against the per-image time of
  `qic run --prompts-file` on the same bundle (the reference: generate + PNG without HTTP);
- throughput: images/s for `--requests` requests from one client vs `--clients` concurrent clients.
  Batching is not measured: no bundle has graphs for a batch above 1 yet, so the server runs one image
  at a time and concurrency only overlaps HTTP work with the graphs.
Prints a markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PROMPT = "a red bicycle leaning against a blue wall"


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m qic.bench.serve")
    ap.add_argument("--bundle", type=Path, help="A built bundle (default: build the preset under --dir).")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--dir", type=Path, default=Path("artifacts/bench-serve"))
    args = ap.parse_args()

    from qic.serve.client import request
    bundle = args.bundle or build(args.preset, args.dir)
    body = {"prompt": PROMPT, "steps": args.steps}

    t = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "qic.cli", "serve", str(bundle), "--port", "0",
                             "--queue", str(args.requests)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)
    try:
        port = int(proc.stdout.readline().rsplit(":", 1)[1])
        while True:
            try:
                if request(port, "GET", "/health")[0] == 200:
                    break
            except OSError:
                time.sleep(0.05)
        start_s = time.perf_counter() - t

        def timed(seed: int) -> float:
            t = time.perf_counter()
            status, _, _ = request(port, "POST", "/v1/images/generations", {**body, "seed": seed}, timeout=600)
            assert status == 200, status
            return time.perf_counter() - t

        latencies = [timed(i) for i in range(10)]
        t = time.perf_counter()
        for i in range(args.requests):
            timed(100 + i)
        serial = args.requests / (time.perf_counter() - t)
        t = time.perf_counter()
        with ThreadPoolExecutor(args.clients) as pool:
            list(pool.map(timed, range(200, 200 + args.requests)))
        concurrent = args.requests / (time.perf_counter() - t)
    finally:
        proc.terminate()
        proc.wait(60)

    # The reference: `qic run` resident mode on the same bundle, 1 and 11 prompts; the difference is
    # ten images' worth of generate + PNG with no HTTP, in a process of its own like the server.
    runs = {}
    for count in (1, 11):
        lines = args.dir / f"prompts-{count}.jsonl"
        lines.parent.mkdir(parents=True, exist_ok=True)
        lines.write_text("".join(json.dumps({**body, "seed": 300 + i}) + "\n" for i in range(count)))
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "qic.cli", "run", str(bundle), "--prompts-file", str(lines),
                        "--output", str(args.dir / "ref.png")], check=True, capture_output=True)
        runs[count] = time.perf_counter() - t
    ref_s = (runs[11] - runs[1]) / 10

    import torch

    from qic.manifest import read_manifest
    h, w = read_manifest(bundle)["resolutions"][0]
    print(f"bundle {bundle}, {h}x{w}, {args.steps} steps, CFG, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print("| measure | qic serve | qic run --prompts-file |\n|---|--:|--:|")
    for row in (("start: process to /health ready (load + warm-up)", f"{start_s:.2f} s", ""),
                ("process start to first PNG, 1 prompt", "", f"{runs[1]:.2f} s"),
                ("request 1 latency", f"{latencies[0] * 1e3:.0f} ms", ""),
                ("request 10 latency", f"{latencies[9] * 1e3:.0f} ms", ""),
                ("per image, requests 2-10 median / resident mode", f"{statistics.median(latencies[1:]) * 1e3:.0f} ms",
                 f"{ref_s * 1e3:.0f} ms"),
                (f"throughput, 1 client, {args.requests} requests", f"{serial:.2f} img/s", f"{1 / ref_s:.2f} img/s"),
                (f"throughput, {args.clients} clients, {args.requests} requests", f"{concurrent:.2f} img/s", ""),
                ("throughput with batching", "not measured: batch-1 graphs only", "")):
        print("| " + " | ".join(row) + " |")

def build(preset_name: str, out_dir: Path) -> Path:
    from qic.checkpoint.embedded import write_checkpoint
    from qic.checkpoint.presets import preset
    h, w = preset(preset_name)["default_resolution"]
    ckpt = write_checkpoint(out_dir / f"ckpt-{preset_name}", preset_name)
    bundle = out_dir / f"bundle-{preset_name}"
    if not (bundle / "manifest.json").exists():
        subprocess.run([sys.executable, "-m", "qic.cli", "build", "--model", str(ckpt), "--output", str(bundle),
                        "--cache-dir", str(out_dir / "cache"), "--resolution", f"{h}x{w}", "--text-buckets", "128,"],
                       check=True, capture_output=True)
    return bundle


if __name__ == "__main__":
    main()
