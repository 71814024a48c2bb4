"""Run every test of the suite alone, each in its own pytest process, to find tests that pass only after
another test has run (a file, cache entry or environment variable left behind).

    .venv/bin/python tools/each_test_alone.py [--results artifacts/alone.jsonl] [PYTEST_ARGS...]

Each node id runs as `pytest -q NODE_ID` with nothing else in the session: its session fixtures are built
for it alone. Results go to one JSON line per test (node id, outcome, seconds); a second run skips the node
ids already recorded, so a long sweep can be stopped and resumed. Inductor's compile cache is shared
between the runs (TORCHINDUCTOR_CACHE_DIR, default artifacts/alone-inductor-cache), as on a developer's
machine: it only makes compiling faster, it holds nothing a test reads.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


COLLECT = """
import json, sys, pytest
class Fixtures:
    def pytest_collection_finish(self, session):
        self.items = [(i.nodeid, sorted(getattr(i, "fixturenames", []))) for i in session.items]
plugin = Fixtures()
code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *sys.argv[1:]], plugins=[plugin])
print("NODES " + json.dumps(plugin.items))
"""


def node_ids(pytest_args: list[str], cheap_first: bool) -> list[str]:
    """The suite's node ids in collection order; cheap_first: those needing no built bundle (no fixture
    named *bundle*) first, so that a sweep stopped early has covered the most tests."""
    out = subprocess.run([sys.executable, "-c", COLLECT, *pytest_args], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    items = json.loads(next(x for x in out.splitlines() if x.startswith("NODES "))[len("NODES "):])
    if cheap_first:
        items.sort(key=lambda item: any("bundle" in f for f in item[1]))   # stable: keeps file order within
    return [node for node, _ in items]


def outcome(proc: subprocess.CompletedProcess) -> str:
    last = (proc.stdout.strip().splitlines() or [""])[-1]
    if proc.returncode == 0:
        return "skipped" if "skipped" in last and "passed" not in last else "passed"
    return "failed"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=ROOT / "artifacts" / "alone.jsonl")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per test")
    ap.add_argument("--cheap-first", action="store_true", help="tests that need no built bundle first")
    args, pytest_args = ap.parse_known_args(argv)
    args.results.parent.mkdir(parents=True, exist_ok=True)
    done = {json.loads(line)["node"] for line in args.results.read_text().splitlines()} \
        if args.results.exists() else set()
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.environ.get(
        "TORCHINDUCTOR_CACHE_DIR", str(ROOT / "artifacts" / "alone-inductor-cache"))}
    todo = [n for n in node_ids(pytest_args, args.cheap_first) if n not in done]
    print(f"{len(todo)} tests to run alone ({len(done)} already recorded in {args.results})", flush=True)
    for i, node in enumerate(todo, 1):
        t0 = time.monotonic()
        try:
            proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", node],
                                  cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
            result, tail = outcome(proc), proc.stdout[-3000:] + proc.stderr[-2000:]
        except subprocess.TimeoutExpired:
            result, tail = "timeout", ""
        seconds = round(time.monotonic() - t0, 1)
        record = {"node": node, "outcome": result, "seconds": seconds}
        if result in ("failed", "timeout"):
            record["tail"] = tail
        with args.results.open("a") as f:
            f.write(json.dumps(record) + "\n")
        print(f"[{i}/{len(todo)}] {result:8} {seconds:7.1f}s {node}", flush=True)
    records = [json.loads(line) for line in args.results.read_text().splitlines()]
    bad = [r["node"] for r in records if r["outcome"] in ("failed", "timeout")]
    counts = {k: sum(r["outcome"] == k for r in records) for k in ("passed", "skipped", "failed", "timeout")}
    print(f"alone: {counts}, {sum(r['seconds'] for r in records) / 60:.0f} min in all")
    for node in bad:
        print(f"  NOT alone: {node}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
