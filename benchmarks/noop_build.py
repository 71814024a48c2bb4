"""Is a no-op `qic build` as fast as a start? Its time against `qic run`'s cold start on the same bundle, in one run.

    python -m benchmarks.noop_build [--runs 5] [--dir DIR] [--cache-dir DIR]   # the default bundle (`qic build`)
    python -m benchmarks.noop_build --smoke   # the embedded tiny preset at 48x80, one text bucket, one run each

Builds once (untimed: the first build may compile), then alternates, `--runs` times each (the machine's load
drifts between runs): the same build again, which must report every stage cached and the bundle unchanged, and
`qic run` on that bundle from a fresh process to the PNG. A bare `python -c "import torch"` is timed alongside:
both commands pay it, so it is the floor neither can go under. Prints the medians of the wall time and of the
CPU time (user + sys of the process and its children: less sensitive to other work on a loaded machine) and
the ratio no-op build / cold start (the target is <= 1.5).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import parse_args, smoke_dir

PROMPT = "a red circle on a white background"


def timed(cmd: list[str], env: dict) -> tuple[float, float, str]:
    """(wall seconds, CPU seconds of the command and its children, stdout) of one command run to completion."""
    before = os.times()
    t = time.perf_counter()
    proc = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t
    after = os.times()
    cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    return wall, cpu, proc.stdout


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.noop_build", description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--preset", help="an embedded preset at its default resolution and one text bucket "
                                     "(default: `qic build` with no arguments, the default bundle)")
    ap.add_argument("--steps", type=int, help="`qic run --steps` (default: the bundle's)")
    ap.add_argument("--dir", type=Path, default=Path("artifacts/bench-noop"))
    ap.add_argument("--cache-dir", type=Path, help="qic's compile cache for the build (default: DIR/cache)")
    args = parse_args(ap, argv, {"runs": 1, "preset": "tiny", "steps": 2, "dir": None})
    args.dir = args.dir or smoke_dir("noop_build")
    cache = args.cache_dir or args.dir / "cache"
    spec_args = []
    if args.preset:
        from qic.checkpoint.embedded import write_checkpoint
        from qic.checkpoint.presets import preset
        h, w = preset(args.preset)["default_resolution"]
        ckpt = write_checkpoint(args.dir / f"ckpt-{args.preset}", args.preset)
        spec_args = ["--model", str(ckpt), "--resolution", f"{h}x{w}", "--text-buckets", "128"]
    bundle = args.dir / f"bundle-{args.preset or 'default'}"
    qic = [sys.executable, "-m", "qic.cli"]
    build = [*qic, "build", *spec_args, "--output", str(bundle), "--cache-dir", str(cache)]
    run = [*qic, "run", str(bundle), "--prompt", PROMPT, "--output", str(args.dir / "cold.png")]
    run += ["--steps", str(args.steps)] if args.steps else []
    env = dict(os.environ, COLUMNS="200")   # rich's tables unwrapped, for the summary line below
    first, _, _ = timed(build, env)

    figures: dict[str, list[tuple[float, float]]] = {"no-op build": [], "qic run cold start": [], "import torch": []}
    for _ in range(args.runs):
        wall, cpu, out = timed(build, env)
        summary = re.search(r"(\d+)/(\d+) from cache .*bundle (unchanged|written)", out, re.S)
        if not summary or summary[1] != summary[2] or summary[3] != "unchanged":
            raise SystemExit(f"the repeated build was not a no-op ({summary[0] if summary else 'no summary'}):\n{out}")
        figures["no-op build"].append((wall, cpu))
        figures["qic run cold start"].append(timed(run, env)[:2])
        figures["import torch"].append(timed([sys.executable, "-c", "import torch"], env)[:2])

    med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in figures.items()}
    (bw, bc), (rw, rc) = med["no-op build"], med["qic run cold start"]
    print(f"bundle {bundle.name} ({' '.join(spec_args) or 'qic build, no arguments'}); first build {first:.1f} s; "
          f"medians of {args.runs} alternating runs; {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f} at the end")
    print("| measure | wall (median) | CPU (median) |\n|---|--:|--:|")
    for name, (w, c) in med.items():
        print(f"| {name} | {w:.2f} s | {c:.2f} s |")
    print(f"| no-op build / cold start | {bw / rw:.2f}x | {bc / rc:.2f}x |")


if __name__ == "__main__":
    main()
