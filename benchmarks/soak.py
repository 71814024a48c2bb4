"""Soak: `qic serve` under a long mixed load, then SIGTERM.

    python -m benchmarks.soak [--bundle DIR | --preset tiny] [--seconds 600] [--clients 8] [--steps 2] [--queue 8]
    python -m benchmarks.soak --smoke   # 12 s, 4 clients, under a temporary directory

The bundle is built with LoRA slots (`--lora-slots`, default 8; 0: none) and served with two adapters (`--lora
a1=... --lora a2=...`, random rank-4 adapters on every Linear) under a `--lora-budget` that keeps one in memory, and
valid requests draw an adapter choice too (none, a1 at 0.5, a2 at 1.0, both), so adapters are read again all along.
The server serves the bundle's own weights and two named weight sets (`--weights alt1=... --weights alt2=...`:
the same preset written with other seeds and built with the same settings, so the build compiles nothing) under
a `--weights-budget` that keeps one named set mapped (`--sets-mapped`), so requests that alternate between them unmap
and map sets all along. `--clients` threads send, until `--seconds` have passed, a mix of valid requests (n 1 or 2,
seeds from a small set, a model drawn from the three; a fifth of them streamed, with 0-2 partial images), malformed
ones (bad JSON, wrong types, unknown keys, out-of-range values, a wrong method, partial images without a stream),
requests whose client hangs up before the answer, and every `--burst-every` seconds a burst of twice the queue at
once.
Then SIGTERM. Prints requests by status, p50/p99 latency of valid requests, the server's RSS after its first
image and at the end, and checks (exit status 1 if not): no 5xx at all, every valid image (streamed or not)
byte-equal to `qic run`'s (with `--weights` of its set, and `--lora` of its adapters: then the pixels, since the PNG
records the adapters by the names each was given) for the same settings, every stream's events in the API's
order, every malformed request a 4xx, exit 0 after SIGTERM.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import http.client
import io
import json
import random
import re
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
from safetensors.torch import load_file

from benchmarks import parse_args, smoke_dir
from benchmarks.serve import Server, build
from qic.serve.client import request
from qic.serve.weight_sets import weight_bytes

PROMPT = "a red bicycle leaning against a blue wall"
MODELS = (None, "alt1", "alt2")   # the bundle's own weights, and the two named sets
# A request's adapters (served names and scales): none, each alone, both at once.
LORAS = ((), (("a1", 0.5),), (("a2", 1.0),), (("a1", 1.0), ("a2", 0.5)))
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
    ({"prompt": "a cat", "partial_images": 2}, "POST"),
    ({"prompt": "a cat", "stream": True, "n": 2}, "POST"),
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
    ap.add_argument("--lora-slots", type=int, default=8, help="The bundle's LoRA slots (0: no adapters in the mix).")
    ap.add_argument("--sets-mapped", type=int, default=1,
                    help="Named weight sets --weights-budget holds at once (1: sets unmapped and mapped all along; 2: "
                         "both stay mapped).")
    args = parse_args(ap, argv, {"seconds": 12, "clients": 4, "seeds": 3, "burst_every": 5.0, "dir": None})
    args.dir = args.dir or smoke_dir("soak")
    cache_dir = args.cache_dir or args.dir / "cache"
    bundle = args.bundle or build(args.preset, args.dir, cache_dir=cache_dir, lora_slots=args.lora_slots)
    sets = {name: build_like(bundle, args.preset, seed, args.dir / f"bundle-{name}", cache_dir)
            for name, seed in (("alt1", 1), ("alt2", 2))}
    adapters, lora_budget = write_adapters(bundle, args.dir) if args.lora_slots else ({}, 0)
    args.loras = LORAS if adapters else ((),)
    # n=2 from the last seed needs +1; None: the bundle's own weights
    reference = {(model, lora): reference_pngs(bundle, args.dir, args.steps, args.seeds + 1, weights,
                                               [f"{adapters[a]}:{s}" for a, s in lora])
                 for model, weights in ((None, None), *sets.items()) for lora in args.loras}
    budget = (args.sets_mapped + 0.5) * weight_bytes(sets["alt1"]) / 2**30   # GiB: --sets-mapped sets at a time
    extra = [a for name, path in sets.items() for a in ("--weights", f"{name}={path}")]
    extra += [a for name, path in adapters.items() for a in ("--lora", f"{name}={path}")]
    extra += ["--lora-budget", repr(lora_budget)] if adapters else []
    with Server(bundle, args.queue, args.dir / "soak-serve.log", [*extra, "--weights-budget", repr(budget)]) as srv:
        proc = psutil.Process(srv.proc.pid)
        status, _, body = request(srv.port, "POST", PATH, valid_body(args.steps, 0, 1), timeout=120)
        assert status == 200, (status, body)
        rss_start = proc.memory_info().rss
        samples: list[int] = []   # the server's RSS every tenth of the run: flat, or growing all along?
        sampler = threading.Thread(target=sample_rss, args=(proc, args.seconds / 10, samples), daemon=True)
        sampler.start()
        soak = Soak(srv.port, args, reference)
        soak.run()
        rss_end = proc.memory_info().rss
        metrics = request(srv.port, "GET", "/metrics")[2]
        metrics = metrics if isinstance(metrics, str) else metrics.decode()
    exit_status = srv.proc.returncode

    lat = sorted(soak.latencies)
    p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else float("nan")
    print(f"soak: {args.seconds:g} s, {args.clients} clients, bundle {bundle} and weight sets alt1, alt2 "
          f"({args.sets_mapped} mapped at a time), {args.steps} steps, --queue {args.queue}"
          + (f", adapters a1, a2 (--lora-slots {args.lora_slots}, one held at a time)" if adapters else ""))
    print("| outcome | requests |\n|---|--:|")
    for key, count in sorted(soak.outcomes.items()):
        print(f"| {key} | {count} |")
    print(f"| valid images checked byte-equal to qic run's | {soak.checked} |")
    print(f"| of them streamed, with partial images received | {soak.streamed} ({soak.partials}) |")
    mapped = len(re.findall(r"^mapped weight set", (args.dir / "soak-serve.log").read_text(), re.M))   # line starts
    print(f"| named weight sets mapped (start and on demand) | {mapped} |")
    uses = dict(re.findall(r'qic_lora_adapter_uses_total\{cache="(\w+)"\} ([\d.e+]+)', metrics))
    if adapters:
        print(f"| adapter uses: matrices in memory / read again (one kept: --lora-budget) | "
              f"{float(uses.get('hit', 0)):.0f} / {float(uses.get('miss', 0)):.0f} |")
    print("| measure | value |\n|---|--:|")
    print(f"| valid requests (200) latency p50 / p99 | {statistics.median(lat) * 1e3:.0f} ms / {p99 * 1e3:.0f} ms |"
          if lat else "| valid requests (200) latency p50 / p99 | none |")
    print(f"| server RSS after the first image / at the end | {rss_start / 2**20:.0f} MiB / {rss_end / 2**20:.0f} MiB "
          f"({rss_end / rss_start - 1:+.1%}) |")
    print(f"| server RSS each tenth of the run (MiB) | {' '.join(str(r >> 20) for r in samples[:10])} |")
    print(f"| exit status after SIGTERM | {exit_status} |")
    problems = soak.problems + ([f"the server exited {exit_status} after SIGTERM"] if exit_status != 0 else [])
    if not soak.checked:
        problems.append("no valid image was served")
    for p in problems[:20]:
        print(f"FAIL: {p}")
    if problems:
        sys.exit(1)
    print("soak ok: no 5xx, malformed all 4xx, every valid image equal to qic run's, streams in order, exit 0")


def sample_rss(proc, every: float, into: list) -> None:
    """Append the process's RSS every `every` seconds while it lives."""
    while True:
        time.sleep(every)
        try:
            into.append(proc.memory_info().rss)
        except psutil.Error:
            return


def valid_body(steps: int, seed: int, n: int, model: str | None = None, lora=()) -> dict:
    return {"prompt": PROMPT, "steps": steps, "seed": seed, "n": n, **({"model": model} if model else {}),
            **({"lora": [{"name": a, "scale": s} for a, s in lora]} if lora else {})}


def write_adapters(bundle: Path, work: Path) -> tuple[dict[str, Path], float]:
    """Two random rank-4 adapters on every slotted module ({name: file}), and a --lora-budget (GiB) that holds one."""
    from benchmarks.lora_slots import adapter
    from qic.runtime.bundle import Bundle
    loaded = Bundle(bundle)
    files = {name: adapter(loaded, 4, work / f"soak-{name}.safetensors", seed) for name, seed in (("a1", 1), ("a2", 2))}
    size = max(sum(t.numel() * 4 for t in load_file(str(f)).values()) for f in files.values())
    return files, 1.5 * size / 2**30


def digest(png: bytes, lora) -> str:
    """What a served image is checked by: its PNG bytes, or with adapters its pixels (the PNG names them as each side
    was given them: a served name, qic run's file)."""
    if not lora:
        return hashlib.sha256(png).hexdigest()
    from PIL import Image
    return hashlib.sha256(Image.open(io.BytesIO(png)).convert("RGB").tobytes()).hexdigest()


def build_like(bundle: Path, preset_name: str, seed: int, out: Path, cache_dir: Path) -> Path:
    """Another weight set for `bundle`'s graphs: the preset's checkpoint written with another seed, built with the
    bundle's own config (its graphs all come from the compile cache)."""
    from qic.checkpoint.embedded import write_checkpoint
    from qic.manifest import read_manifest
    if not (out / "manifest.json").exists():
        ckpt = write_checkpoint(out.with_name(out.name + "-ckpt"), preset_name, seed)
        m = read_manifest(bundle)
        flags = ["--resolution", ",".join(f"{h}x{w}" for h, w in m["resolutions"]), "--text-buckets",
                 ",".join(str(b) for b in m["text_buckets"]) + ",", "--batch-sizes",
                 ",".join(str(b) for b in m.get("batch_sizes") or [1])]
        flags += ["--lora-slots", str(m["lora_slots"])] if m.get("lora_slots") else []
        subprocess.run([sys.executable, "-m", "qic.cli", "build", "--model", str(ckpt), "--output", str(out),
                        "--cache-dir", str(cache_dir), *flags], check=True, capture_output=True)
    return out


def reference_pngs(bundle: Path, work: Path, steps: int, seeds: int, weights: Path | None = None,
                   lora: list[str] = ()) -> dict[int, str]:
    """digest() of `qic run --prompts-file`'s PNG for each seed (with `weights`' set and the `lora` FILE:SCALE
    adapters), the same settings as the valid requests."""
    work.mkdir(parents=True, exist_ok=True)
    tag = ("own" if weights is None else weights.name) + "".join(
        f"-{Path(a.rpartition(':')[0]).stem}-{a.rpartition(':')[2]}" for a in lora)
    lines = work / "soak-prompts.jsonl"
    lines.write_text("".join(json.dumps({"prompt": PROMPT, "steps": steps, "seed": s}) + "\n" for s in range(seeds)))
    subprocess.run([sys.executable, "-m", "qic.cli", "run", str(bundle), "--prompts-file", str(lines),
                    "--output", str(work / f"soak-ref-{tag}.png"), *(["--weights", str(weights)] if weights else []),
                    *[x for a in lora for x in ("--lora", a)]], check=True, capture_output=True)
    return {s: digest((work / f"soak-ref-{tag}-{s:03d}.png").read_bytes(), lora) for s in range(seeds)}


class Soak:
    """The client threads and what they saw. Counters are guarded by one lock (threads share them)."""

    def __init__(self, port: int, args, reference: dict[int, str]):
        self.port, self.args, self.reference = port, args, reference
        self.lock = threading.Lock()
        self.outcomes: Counter = Counter()
        self.latencies: list[float] = []
        self.checked = 0
        self.streamed = self.partials = 0
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
            if pick < 0.12:
                self.stream(rng)
            elif pick < 0.6:
                self.valid(rng)
            elif pick < 0.9:
                self.malformed(rng)
            else:
                self.hang_up(rng)

    def valid(self, rng: random.Random, n: int | None = None) -> None:
        n = n or rng.choice((1, 1, 2))
        seed = rng.randrange(self.args.seeds)
        model, lora = rng.choice(MODELS), rng.choice(self.args.loras)
        t = time.perf_counter()
        try:
            status, _, body = request(self.port, "POST", PATH, valid_body(self.args.steps, seed, n, model, lora),
                                      timeout=120)
        except OSError as e:
            return self.note("valid", "error", f"valid request: {type(e).__name__}: {e}")
        seconds = time.perf_counter() - t
        problem = None
        if status == 200:
            got = [digest(base64.b64decode(d["b64_json"]), lora) for d in body["data"]]
            want = [self.reference[model, lora][seed + i] for i in range(n)]
            if got != want:
                problem = f"seed {seed} n={n} model {model} lora {lora}: the image differs from qic run's"
            with self.lock:
                self.latencies.append(seconds)
                self.checked += n
        elif status != 429:
            problem = f"valid request got {status}: {body}"
        self.note("valid", status, problem)

    def stream(self, rng: random.Random) -> None:
        """A valid request with stream: true and 0-2 partial images: partial events (at most as many as asked, in
        index order), then the completed image, equal to qic run's."""
        seed, model, partials = rng.randrange(self.args.seeds), rng.choice(MODELS), rng.choice((0, 1, 2))
        lora = rng.choice(self.args.loras)
        body = {**valid_body(self.args.steps, seed, 1, model, lora), "stream": True, "partial_images": partials}
        t = time.perf_counter()
        try:
            status, _, text = request(self.port, "POST", PATH, body, timeout=120)
        except OSError as e:
            return self.note("stream", "error", f"streamed request: {type(e).__name__}: {e}")
        seconds = time.perf_counter() - t
        problem = None
        if status == 200:
            events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]
            kinds = [e["type"] for e in events]
            got = [e.get("partial_image_index") for e in events[:-1]]
            if kinds[-1:] != ["image_generation.completed"] or got != list(range(len(got))) or len(got) > partials:
                problem = f"stream seed {seed} model {model}: events {kinds}"
            elif digest(base64.b64decode(events[-1]["b64_json"]), lora) != self.reference[model, lora][seed]:
                problem = f"stream seed {seed} model {model}: the completed image differs from qic run's"
            with self.lock:
                self.latencies.append(seconds)
                self.checked += 1
                self.streamed += 1
                self.partials += len(got)
        elif status != 429:
            problem = f"streamed request got {status}: {text}"
        self.note("stream", status, problem)

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
