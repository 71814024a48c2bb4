"""Measured peak memory of running one graph eagerly, to hold `qic plan`'s estimates to (qic.builder.memplan).

    python -m benchmarks.peak PRESET '[["denoiser", {"resolution": [256, 256], "bucket": 128}], ...]'
    python -m benchmarks.peak --smoke   # the tiny preset's three graphs, through measure(), as a table

Runs in its own process (the parent sets the allocator environment, see `measure`) and prints one JSON
list. Per graph, in turn: builds the component from an embedded preset's configs with random fp32
weights, one thread, and reports
- weights: bytes the weights added to the resident set (materialised and written, so every page counts);
- activations: the resident-set high-water mark while the graph runs, above the resident set just
  before the call, in a second run (the first loads kernels and code pages, which are not the graph's);
- peak = weights + activations, which is what `qic plan` calls a graph's peak.
The resident-set high-water mark is reset through /proc/self/clear_refs (Linux). The kernel's resident
counters are batched (per-CPU, tens of pages), so graphs whose peak is under a few MB measure poorly.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

# Large blocks straight from mmap and freed back at once, and the heap trimmed: the resident set then
# follows live tensors instead of what glibc keeps cached between the runs.
# M_MMAP_MAX at glibc's default: a parent that keeps freed blocks (qic.runtime.heap) passes on 0, which would turn the
# threshold's mmaps off
ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": "4096", "MALLOC_TRIM_THRESHOLD_": "0", "MALLOC_MMAP_MAX_": "65536",
                 "OMP_NUM_THREADS": "1"}


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def _reset_hwm() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def _measure_here(preset_name: str, component: str, shape: dict) -> dict:
    import gc

    import torch

    from qic.builder.jobs import make_graph
    from qic.checkpoint.presets import preset
    from qic.models.qwen_image.components import COMPONENTS

    torch.set_num_threads(1)
    raw = preset(preset_name)
    configs = {n: c.parse_config(raw[c.folder]) for n, c in COMPONENTS.items()}
    with torch.device("meta"):
        module = COMPONENTS[component].make_module(configs[component], tp_size=1)
    # Warm-up of the weight-filling path on a throwaway tensor: loading its code must not count as weights.
    with torch.device("meta"):
        scratch = torch.nn.Linear(256, 256)
    scratch.to_empty(device="cpu").weight.detach().normal_(0, 0.02, generator=torch.Generator().manual_seed(0))
    del scratch
    make_graph(component, module, configs, shape, "float32")
    base = _status("VmRSS")
    module = module.to_empty(device="cpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for t in module.state_dict().values():
            t.normal_(0, 0.02, generator=g) if t.is_floating_point() else t.zero_()
    gdef = make_graph(component, module, configs, shape, "float32")
    weights = _status("VmRSS") - base  # weights, plus the graph's inputs and RoPE tables
    args = [t for _, t in gdef.inputs]
    graph = gdef.module.eval()
    with torch.no_grad():
        graph(*args)  # warm-up: kernels, code pages, thread pools
        before = _status("VmRSS")
        _reset_hwm()
        out = graph(*args)
        activations = _status("VmHWM") - before
    name = gdef.name
    del out, graph, args, gdef, module
    gc.collect()
    return {"preset": preset_name, "graph": name, "weights": weights, "activations": activations,
            "peak": weights + activations}


def measure(preset_name: str, graphs: list[tuple[str, dict]]) -> list[dict]:
    """The measurements of (component, shape) graphs, in a fresh process with ALLOCATOR_ENV (the allocator
    reads it at start)."""
    env = {**os.environ, **ALLOCATOR_ENV}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.peak", preset_name, json.dumps(graphs)],
                          capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"peak measurement failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


SMOKE_GRAPHS = [["text_encoder", {"bucket": 72}], ["denoiser", {"resolution": [48, 80], "bucket": 72}],
                ["vae_decoder", {"resolution": [48, 80]}]]


def main(argv: list[str] | None = None) -> None:
    from benchmarks import parse_args
    ap = argparse.ArgumentParser(prog="python -m benchmarks.peak", description=__doc__.splitlines()[0])
    ap.add_argument("preset", nargs="?", help="an embedded preset (tiny, small, ...)")
    ap.add_argument("graphs", nargs="?", help='JSON list of [component, shape], e.g. [["vae_decoder", '
                                               '{"resolution": [256, 256]}]]')
    args = parse_args(ap, argv, {})
    if not args.smoke:   # the measuring process (started by `measure`): one JSON line
        if not (args.preset and args.graphs):
            ap.error("PRESET and GRAPHS are required (or --smoke)")
        print(json.dumps([_measure_here(args.preset, c, s) for c, s in json.loads(args.graphs)]))
        return
    rows = measure(args.preset or "tiny", json.loads(args.graphs) if args.graphs else SMOKE_GRAPHS)
    print("| preset | graph | weights MB | activations MB | peak MB |\n|---|---|--:|--:|--:|")
    for r in rows:
        print(f"| {r['preset']} | {r['graph']} | {r['weights'] / 1e6:.2f} | {r['activations'] / 1e6:.2f} | "
              f"{r['peak'] / 1e6:.2f} |")


if __name__ == "__main__":
    main()
