"""Soak: `qic serve` under a long mixed load, then SIGTERM.

    python -m benchmarks.soak [--bundle DIR | --preset tiny] [--seconds 600] [--clients 8] [--steps 2] [--queue 8]
    python -m benchmarks.soak --smoke   # 12 s, 4 clients, under a temporary directory

`--clients` threads send, until `--seconds` have passed, a mix of valid requests (n 1 or 2, seeds from a
small set), malformed ones (bad JSON, wrong types, unknown keys, out-of-range values, a wrong method),
requests whose client hangs up before the answer, and every `--burst-every` seconds a burst of twice the
queue at once. Then SIGTERM. Prints requests by status, p50/p99 latency of valid requests, the server's
RSS after its first image and at the end, and checks (exit status 1 if not): no 5xx at all, every valid
image byte-equal to `qic run`'s for the same settings, every malformed request a 4xx, exit 0 after SIGTERM.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import http.client
import json
import random
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

from benchmarks import parse_args, smoke_dir
from benchmarks.serve import Server, build
from qic.serve.client import request

PROMPT = "a red bicycle leaning against a blue wall"
PATH = "/v1/images/generations"
MALFORMED = [   # (raw body or JSON object, method): each must be refused with a 4xx
    (b"{prompt: 'a cat'", "POST"),
    (b'["a cat"]', "POST"),
    (b"", "POST"),
    (b"\xff\xfe not utf-8", "POST"),
    ({"prompt": 42}, "POST"),
    ({"prompt": ""}, "POST"),
    ({"prompt": "a cat", "n": "2"}, "POST"),
    ({"prompt": "a cat", "n": 0}, "POST"),
    ({"prompt": "a cat", "n": 99}, "POST"),
    ({"prompt": "a cat", "steps": 2.5}, "POST"),
    ({"prompt": "a cat", "steps": 0}, "POST"),
    ({"prompt": "a cat", "guidance": "high"}, "POST"),
    ({"prompt": "a cat", "seed": -1}, "POST"),
    ({"prompt": "a cat", "size": "big"}, "POST"),
    ({"prompt": "a cat", "quality": "hd"}, "POST"),
    ({"prompt": "a cat", "model": "dall-e-3"}, "POST"),
    ({"prompt": "a red bicycle " * 200}, "POST"),
    (None, "GET"),
]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.soak")
    ap.add_argument("--bundle", type=Path, help="A built bundle (default: build the preset under --dir).")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--queue", type=int, default=8, help="The server's --queue.")
    ap.add_argument("--seeds", type=int, default=6, help="Valid requests draw seeds 0..N-1 (each checked).")
    ap.add_argument("--burst-every", type=float, default=60.0, help="Seconds between bursts of 2 x --queue.")
    ap.add_argument("--dir", type=Path, default=Path("artifacts/bench-soak"))
    ap.add_argument("--cache-dir", type=Path, help="qic's compile cache for the build (default: DIR/cache)")
    args = parse_args(ap, argv, {"seconds": 12, "clients": 4, "seeds": 3, "burst_every": 5.0, "dir": None})
    args.dir = args.dir or smoke_dir("soak")
    bundle = args.bundle or build(args.preset, args.dir, cache_dir=args.cache_dir or args.dir / "cache")
    reference = reference_pngs(bundle, args.dir, args.steps, args.seeds + 1)   # n=2 from the last seed needs +1

    with Server(bundle, args.queue, args.dir / "soak-serve.log") as srv:
        proc = psutil.Process(srv.proc.pid)
        status, _, body = request(srv.port, "POST", PATH, valid_body(args.steps, 0, 1), timeout=120)
        assert status == 200, (status, body)
        rss_start = proc.memory_info().rss
        soak = Soak(srv.port, args, reference)
        soak.run()
        rss_end = proc.memory_info().rss
    exit_status = srv.proc.returncode

    lat = sorted(soak.latencies)
    p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else float("nan")
    print(f"soak: {args.seconds:g} s, {args.clients} clients, bundle {bundle}, {args.steps} steps, "
          f"--queue {args.queue}")
    print("| outcome | requests |\n|---|--:|")
    for key, count in sorted(soak.outcomes.items()):
        print(f"| {key} | {count} |")
    print(f"| valid images checked byte-equal to qic run's | {soak.checked} |")
    print("| measure | value |\n|---|--:|")
    print(f"| valid requests (200) latency p50 / p99 | {statistics.median(lat) * 1e3:.0f} ms / {p99 * 1e3:.0f} ms |"
          if lat else "| valid requests (200) latency p50 / p99 | none |")
    print(f"| server RSS after the first image / at the end | {rss_start / 2**20:.0f} MiB / {rss_end / 2**20:.0f} MiB "
          f"({rss_end / rss_start - 1:+.1%}) |")
    print(f"| exit status after SIGTERM | {exit_status} |")
    problems = soak.problems + ([f"the server exited {exit_status} after SIGTERM"] if exit_status != 0 else [])
    if not soak.checked:
        problems.append("no valid image was served")
    for p in problems[:20]:
        print(f"FAIL: {p}")
    if problems:
        sys.exit(1)
    print("soak ok: no 5xx, malformed all 4xx, every valid image equal to qic run's, exit 0")


def valid_body(steps: int, seed: int, n: int) -> dict:
    return {"prompt": PROMPT, "steps": steps, "seed": seed, "n": n}


def reference_pngs(bundle: Path, work: Path, steps: int, seeds: int) -> dict[int, str]:
    """sha256 of `qic run --prompts-file`'s PNG for each seed, the same settings as the valid requests."""
    work.mkdir(parents=True, exist_ok=True)
    lines = work / "soak-prompts.jsonl"
    lines.write_text("".join(json.dumps({"prompt": PROMPT, "steps": steps, "seed": s}) + "\n" for s in range(seeds)))
    subprocess.run([sys.executable, "-m", "qic.cli", "run", str(bundle), "--prompts-file", str(lines),
                    "--output", str(work / "soak-ref.png")], check=True, capture_output=True)
    return {s: hashlib.sha256((work / f"soak-ref-{s:03d}.png").read_bytes()).hexdigest() for s in range(seeds)}


class Soak:
    """The client threads and what they saw. Counters are guarded by one lock (threads share them)."""

    def __init__(self, port: int, args, reference: dict[int, str]):
        self.port, self.args, self.reference = port, args, reference
        self.lock = threading.Lock()
        self.outcomes: Counter = Counter()
        self.latencies: list[float] = []
        self.checked = 0
        self.problems: list[str] = []

    def run(self) -> None:
        deadline = time.monotonic() + self.args.seconds
        with ThreadPoolExecutor(self.args.clients) as pool:
            for f in [pool.submit(self.client, i, deadline) for i in range(self.args.clients)]:
                f.result()

    def note(self, kind: str, status, problem: str | None = None) -> None:
        with self.lock:
            self.outcomes[f"{kind} {status}"] += 1
            if problem:
                self.problems.append(problem)

    def client(self, index: int, deadline: float) -> None:
        rng = random.Random(index)
        next_burst = time.monotonic() + self.args.burst_every
        while time.monotonic() < deadline:
            if index == 0 and time.monotonic() >= next_burst:
                next_burst += self.args.burst_every
                self.burst(rng)
                continue
            pick = rng.random()
            if pick < 0.6:
                self.valid(rng)
            elif pick < 0.9:
                self.malformed(rng)
            else:
                self.hang_up(rng)

    def valid(self, rng: random.Random, n: int | None = None) -> None:
        n = n or rng.choice((1, 1, 2))
        seed = rng.randrange(self.args.seeds)
        t = time.perf_counter()
        try:
            status, _, body = request(self.port, "POST", PATH, valid_body(self.args.steps, seed, n), timeout=120)
        except OSError as e:
            return self.note("valid", "error", f"valid request: {type(e).__name__}: {e}")
        seconds = time.perf_counter() - t
        problem = None
        if status == 200:
            got = [hashlib.sha256(base64.b64decode(d["b64_json"])).hexdigest() for d in body["data"]]
            want = [self.reference[seed + i] for i in range(n)]
            if got != want:
                problem = f"seed {seed} n={n}: the image differs from qic run's"
            with self.lock:
                self.latencies.append(seconds)
                self.checked += n
        elif status != 429:
            problem = f"valid request got {status}: {body}"
        self.note("valid", status, problem)

    def malformed(self, rng: random.Random) -> None:
        body, method = rng.choice(MALFORMED)
        raw = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        what = f"malformed {method} {(raw or b'')[:40]!r}"
        try:
            status, _, reply = request(self.port, method, PATH, raw=raw, timeout=60)
        except OSError as e:
            return self.note("malformed", "error", f"{what}: {type(e).__name__}: {e}")
        ok = 400 <= status < 500 and status != 429
        self.note("malformed", status, None if ok else f"{what} got {status}: {reply}")

    def hang_up(self, rng: random.Random) -> None:
        """A valid request whose client closes the connection before the answer (queued or running)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            conn.request("POST", PATH, body=json.dumps(valid_body(self.args.steps, rng.randrange(100, 200), 1)),
                         headers={"Content-Type": "application/json"})
            time.sleep(rng.uniform(0, 0.3))
        finally:
            conn.close()
        self.note("hung up", "-")

    def burst(self, rng: random.Random) -> None:
        """Twice the queue at once: the excess must get 429, never an error."""
        with ThreadPoolExecutor(2 * self.args.queue) as pool:
            list(pool.map(lambda _: self.valid(rng, n=1), range(2 * self.args.queue)))


if __name__ == "__main__":
    main()
