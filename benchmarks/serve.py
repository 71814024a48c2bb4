"""Serving benchmark: `qic serve` latency and throughput over loopback, against in-process `generate`.

    python -m benchmarks.serve [--bundle DIR | --preset tiny] [--steps 8] [--requests 16] [--clients 4] [--batch 2]
    python -m benchmarks.serve --smoke   # the tiny preset, 2 steps, 2 requests, 1 round, under a temporary directory

Measures, in one run:
- start: process start to /health answering (load and the warm-up pass included; nothing compiles);
- latency of request 1 vs request 10 (sequential, one client; --latency-requests), against the per-image
  time of `qic run --prompts-file` on the same bundle (the reference: generate + PNG without HTTP; the
  difference of 1 and 1 + --reference-images prompts);
- throughput: images/s for `--requests` requests from one client vs `--clients` concurrent clients;
- with and without batching: the same concurrent requests against the same build with `batch_sizes`
  [1] and [1, --batch] (a second bundle in the same cache, so only its batched graphs compile; or
  --batch-bundle), that server warmed by two requests first; its access log says how many images ran
  in batches.
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

from benchmarks import parse_args, smoke_dir
from qic.serve.client import request

PROMPT = "a red bicycle leaning against a blue wall"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.serve")
    ap.add_argument("--bundle", type=Path, help="A built bundle (default: build the preset under --dir).")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--batch", type=int, default=2, help="Also serve the preset built with batch_sizes [1, N] "
                                                         "(1: skip).")
    ap.add_argument("--batch-bundle", type=Path, help="With --bundle: the same build with batch_sizes above 1.")
    ap.add_argument("--rounds", type=int, default=3, help="Alternating rounds of the batching comparison.")
    ap.add_argument("--latency-requests", type=int, default=10, help="Sequential requests timed one by one.")
    ap.add_argument("--reference-images", type=int, default=10, help="Images of the `qic run` reference.")
    ap.add_argument("--dir", type=Path, default=Path("artifacts/bench-serve"))
    ap.add_argument("--cache-dir", type=Path, help="qic's compile cache for the builds (default: DIR/cache)")
    args = parse_args(ap, argv, {"preset": "tiny", "steps": 2, "requests": 2, "clients": 2, "batch": 2, "rounds": 1,
                                 "latency_requests": 2, "reference_images": 1, "dir": None})
    if args.latency_requests < 2 or args.reference_images < 1:
        ap.error("--latency-requests must be at least 2 and --reference-images at least 1")
    args.dir = args.dir or smoke_dir("serve")
    cache = args.cache_dir or args.dir / "cache"

    bundle = args.bundle or build(args.preset, args.dir, cache_dir=cache)
    body = {"prompt": PROMPT, "steps": args.steps}

    batched = None
    with Server(bundle, args.requests, args.dir / "serve-b1.log") as plain:
        latencies = [plain.timed(body, i) for i in range(args.latency_requests)]
        serial = plain.throughput(body, range(100, 100 + args.requests), 1)
        concurrent = plain.throughput(body, range(200, 200 + args.requests), args.clients)
        if args.batch_bundle or (args.batch > 1 and not args.bundle):
            batch_bundle = args.batch_bundle or build(args.preset, args.dir, args.batch, cache_dir=cache)
            # Both servers resident (the one above stays up: the same bundle, already warm), rounds alternating
            # between them with the same seeds, so that the load of this shared machine weighs on both alike;
            # medians over the rounds.
            with Server(batch_bundle, args.requests, args.dir / "serve-batch.log") as srv:
                for i in range(2):
                    srv.timed(body, 900 + i)
                rounds = [(plain.throughput(body, seeds, args.clients), srv.throughput(body, seeds, args.clients))
                          for r in range(args.rounds)
                          for seeds in [range(200 + 1000 * r, 200 + 1000 * r + args.requests)]]
            batched_share = srv.batched_images()
            unbatched, batched = (statistics.median(x) for x in zip(*rounds))
            ratio = statistics.median(b / a for a, b in rounds)
    start_s = plain.start_s

    # The reference: `qic run` resident mode on the same bundle, 1 and 1 + N prompts; the difference is
    # N images' worth of generate + PNG with no HTTP, in a process of its own like the server.
    runs = {}
    last = 1 + args.reference_images
    for count in (1, last):
        lines = args.dir / f"prompts-{count}.jsonl"
        lines.parent.mkdir(parents=True, exist_ok=True)
        lines.write_text("".join(json.dumps({**body, "seed": 300 + i}) + "\n" for i in range(count)))
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "qic.cli", "run", str(bundle), "--prompts-file", str(lines),
                        "--output", str(args.dir / "ref.png")], check=True, capture_output=True)
        runs[count] = time.perf_counter() - t
    ref_s = (runs[last] - runs[1]) / args.reference_images

    import torch

    from qic.manifest import read_manifest
    h, w = read_manifest(bundle)["resolutions"][0]
    print(f"bundle {bundle}, {h}x{w}, {args.steps} steps, CFG, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print("| measure | qic serve | qic run --prompts-file |\n|---|--:|--:|")
    for row in (("start: process to /health ready (load + warm-up)", f"{start_s:.2f} s", ""),
                ("process start to first PNG, 1 prompt", "", f"{runs[1]:.2f} s"),
                ("request 1 latency", f"{latencies[0] * 1e3:.0f} ms", ""),
                (f"request {len(latencies)} latency", f"{latencies[-1] * 1e3:.0f} ms", ""),
                (f"per image, requests 2-{len(latencies)} median / resident mode",
                 f"{statistics.median(latencies[1:]) * 1e3:.0f} ms", f"{ref_s * 1e3:.0f} ms"),
                (f"throughput, 1 client, {args.requests} requests", f"{serial:.2f} img/s", f"{1 / ref_s:.2f} img/s"),
                (f"throughput, {args.clients} clients, {args.requests} requests", f"{concurrent:.2f} img/s", "")):
        print("| " + " | ".join(row) + " |")
    if batched is not None:
        sizes = read_manifest(batch_bundle)["batch_sizes"]
        total = args.rounds * args.requests
        print(f"| throughput, {args.clients} clients, {args.requests} requests x {args.rounds} rounds, median: "
              f"batch_sizes [1] | {unbatched:.2f} img/s | |")
        print(f"| same requests, batch_sizes {sizes} ({batched_share} of {total} images batched) | {batched:.2f} img/s "
              f"(median ratio {ratio:.2f}x) | |")


class Server:
    """`qic serve BUNDLE` on a free loopback port, for a `with` block; stderr (the access log) to a file."""

    def __init__(self, bundle: Path, queue: int, log: Path, extra: list[str] = ()):
        self.bundle, self.queue, self.log_path, self.extra = bundle, queue, log, list(extra)

    def __enter__(self):
        t = time.perf_counter()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "qic.cli", "serve", str(self.bundle), "--port", "0",
                                      "--queue", str(self.queue), *self.extra], stdout=subprocess.PIPE, stderr=self.log,
                                     text=True)
        self.port = int(self.proc.stdout.readline().rsplit(":", 1)[1])
        while True:   # /health is 503 while the server warms up (after the address line), 200 once ready
            try:
                if request(self.port, "GET", "/health")[0] == 200:
                    break
            except OSError:
                pass
            if self.proc.poll() is not None:
                raise SystemExit(f"qic serve exited with {self.proc.returncode} before it was ready: "
                                 f"{self.log_path.read_text()[-2000:]}")
            time.sleep(0.05)
        self.start_s = time.perf_counter() - t
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.wait(60)
        self.proc.stdout.close()
        self.log.close()

    def timed(self, body: dict, seed: int) -> float:
        t = time.perf_counter()
        status, _, _ = request(self.port, "POST", "/v1/images/generations", {**body, "seed": seed}, timeout=600)
        assert status == 200, status
        return time.perf_counter() - t

    def throughput(self, body: dict, seeds, clients: int) -> float:
        """Images/s for one request per seed from `clients` threads."""
        t = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            list(pool.map(lambda s: self.timed(body, s), seeds))
        return len(seeds) / (time.perf_counter() - t)

    def batched_images(self) -> int:
        """Images of the throughput run that ran in a batch above 1 (from the access log)."""
        records = [json.loads(line) for line in self.log_path.read_text().splitlines() if line.startswith("{")]
        return sum(1 for r in records if r.get("seed", 0) >= 200 and r.get("seed", 0) % 1000 < 900
                   and r.get("batch", 1) > 1)

def build(preset_name: str, out_dir: Path, batch: int = 1, cache_dir: Path | None = None, lora_slots: int = 0) -> Path:
    """The preset's bundle (one resolution, bucket 128), with batched graphs of size `batch` if above 1 and LoRA
    slots of rank `lora_slots` if any."""
    from qic.checkpoint.embedded import write_checkpoint
    from qic.checkpoint.presets import preset
    h, w = preset(preset_name)["default_resolution"]
    ckpt = write_checkpoint(out_dir / f"ckpt-{preset_name}", preset_name)
    bundle = out_dir / (f"bundle-{preset_name}" + ("" if batch == 1 else f"-batch{batch}")
                        + (f"-slots{lora_slots}" if lora_slots else ""))
    if not (bundle / "manifest.json").exists():
        subprocess.run([sys.executable, "-m", "qic.cli", "build", "--model", str(ckpt), "--output", str(bundle),
                        "--cache-dir", str(cache_dir or out_dir / "cache"), "--resolution", f"{h}x{w}",
                        "--text-buckets", "128,", "--batch-sizes", f"1,{batch}",
                        *(["--lora-slots", str(lora_slots)] if lora_slots else [])], check=True, capture_output=True)
    return bundle

if __name__ == "__main__":
    main()
