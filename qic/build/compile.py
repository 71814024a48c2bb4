"""Stage 2: export and compile each graph through a content-addressed compile cache.

Weights are graph inputs, not constants. AOTInductor's weight-free packages
(package_constants_in_so=False + load_constants) were measured to be wrong here: inductor folds
weight-derived tensors at compile time (transposed Linear weights, a 1x1 conv's bias) into constants
that the package then lacks (uninitialised: NaN in the step graph) or bakes in (the VAE silently kept
the compile-time checkpoint's conv biases). Passing every weight as an input makes a graph
independent of the weights by construction: one artifact serves every checkpoint of the
architecture, and the runtime hands it memory-mapped tensors without a copy.

Two keys per graph:
- the graph key names an artifact by what determines it: the exported graph's code and signature,
  input shapes, graph-owned constants (RoPE tables, latent statistics), back end, versions and flags.
  Weights are not part of it: one compiled graph serves every checkpoint of the same architecture.
- the spec key is computable without exporting (qic's model code, the component configs, the graph's
  shapes, dtype, TP, back end); it memoises spec key -> graph key, so a no-op build exports nothing.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from qic import __version__
from qic.backends.base import Backend
from qic.build.graphs import GraphDef
from qic.fsutil import file_lock, staging_dir, write_bytes_atomic, write_json_atomic
from qic.manifest import sha256_file

_CODE_DIRS = ("models", "build/graphs.py", "backends")
_QIC = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class GraphArtifact:
    graph_key: str
    directory: Path
    meta: dict            # file, constant names, which are graph-owned, inputs/outputs, sizes
    cached: bool
    seconds: float


def code_digest() -> str:
    """qic's own code that shapes a graph; edits to it invalidate memoised spec keys."""
    h = hashlib.sha256(__version__.encode())
    for entry in _CODE_DIRS:
        p = _QIC / entry
        for f in sorted([p] if p.is_file() else p.rglob("*.py")):
            h.update(f.relative_to(_QIC).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def spec_key(gdef_name: str, shape: dict, dtype: str, tp: int, configs: dict, identity: dict, code: str) -> str:
    blob = json.dumps({"graph": gdef_name, "shape": shape, "dtype": dtype, "tp": tp, "configs": configs,
                       "backend": identity, "code": code}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def compile_graph(gdef: GraphDef | Callable[[], GraphDef], backend: Backend, weight_names: set[str],
                  cache_dir: Path, skey: str) -> GraphArtifact:
    """The artifact for a graph: by spec key from the memo, by graph key from the cache, or compiled.

    `gdef` may be a zero-argument callable, called only on a memo miss: building a GraphDef binds
    (memory-maps) weights, which a no-op build should not do.
    """
    cache_dir = Path(cache_dir)
    memo = cache_dir / "index" / skey
    t0 = time.perf_counter()
    if memo.is_file():
        art = _lookup(cache_dir, memo.read_text().strip())
        if art:
            return GraphArtifact(art[0], art[1], art[2], True, time.perf_counter() - t0)
    if callable(gdef):
        gdef = gdef()
    if getattr(backend, "traces_modules", False):
        art = lower_graph(gdef, backend, weight_names, cache_dir, t0)
        write_bytes_atomic(memo, art.graph_key.encode())
        return art
    module = gdef.module.eval()
    args = tuple(t for _, t in gdef.inputs)
    tensors = dict(module.named_parameters())
    tensors.update(module.named_buffers())
    names = list(tensors)
    dynamic = None
    if gdef.dynamic:
        dynamic = (tuple(gdef.dynamic.get(name) for name, _ in gdef.inputs), [None] * len(names))
    with torch.no_grad():
        program = torch.export.export(WeightsAsInputs(module, names), (args, [tensors[n] for n in names]),
                                      dynamic_shapes=dynamic)
    owned = {n: tensors[n].detach().cpu().contiguous().clone() for n in names
             if not (n.startswith(gdef.weight_prefix) and n[len(gdef.weight_prefix):] in weight_names)}
    gkey = graph_key(program, gdef, owned, backend.identity())
    with file_lock(cache_dir / "locks" / f"graph-{gkey}.lock"):
        art = _lookup(cache_dir, gkey)
        if art is None:
            final = cache_dir / "graphs" / gkey
            with staging_dir(final) as tmp:
                compiled = backend.compile(program, tmp)
                if owned:
                    save_file(owned, str(tmp / "constants.safetensors"))
                files = [compiled.file] + (["constants.safetensors"] if owned else [])
                meta = {
                    "graph": gdef.name, "component": gdef.component, "file": compiled.file,
                    "constants_file": "constants.safetensors" if owned else None,
                    "weight_inputs": names, "owned_constants": sorted(owned),
                    "weight_prefix": gdef.weight_prefix,
                    "inputs": [{"name": n, "shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")}
                               for n, t in gdef.inputs],
                    "outputs": gdef.outputs, "dynamic_text": bool(gdef.dynamic),
                    "files": {f: {"sha256": sha256_file(tmp / f), "bytes": (tmp / f).stat().st_size} for f in files},
                    "compile_seconds": round(time.perf_counter() - t0, 2), "backend": backend.identity(),
                }
                write_json_atomic(tmp / "meta.json", meta)
            art = _lookup(cache_dir, gkey)
            cached = False
        else:
            cached = True
    write_bytes_atomic(memo, gkey.encode())
    return GraphArtifact(gkey, art[1], art[2], cached, time.perf_counter() - t0)


def lower_graph(gdef: GraphDef, backend: Backend, weight_names: set[str], cache_dir: Path, t0: float) -> GraphArtifact:
    """The neuron path: lower the eager module to HLO (no torch.export), check it on XLA:CPU, cache it.

    The graph key is the HLO's own digest (plus shapes, owned constants and the back end's identity):
    the HLO is what the compiler sees, and lowering takes well under a second per graph.
    """
    from qic.backends.neuron import XLA_CPU_REL_L2
    from qic.errors import CompileError, ConfigError
    from qic.parallel.tp import tp_size_of
    if gdef.dynamic:
        raise ConfigError(f"graph {gdef.name}: the neuron back end needs fixed text buckets (a NEFF has static "
                          "shapes; exact-length graphs have a dynamic text dimension)",
                          "use text buckets such as 128,256 instead of 0")
    module = gdef.module.eval()
    tensors = dict(module.named_parameters())
    tensors.update(module.named_buffers())
    tp = tp_size_of(module)
    lowered = backend.lower(module, gdef.inputs, tensors, tp)
    owned = {n: tensors[n].detach().cpu().contiguous().clone() for n in tensors
             if not (n.startswith(gdef.weight_prefix) and n[len(gdef.weight_prefix):] in weight_names)}
    owned.update(lowered.constants)   # scalars torch-xla made parameters: they travel with the graph
    names = list(tensors) + list(lowered.constants)
    h = hashlib.sha256(b"qic-hlo-v1")
    h.update(hashlib.sha256(lowered.proto).digest())
    gkey = graph_key_from(h, gdef, owned, backend.identity())
    with file_lock(cache_dir / "locks" / f"graph-{gkey}.lock"):
        art = _lookup(cache_dir, gkey)
        cached = art is not None
        if not cached:
            final = cache_dir / "graphs" / gkey
            with staging_dir(final) as tmp:
                compiled = backend.write(lowered, names, [n for n, _ in gdef.inputs], tmp)
                checks = {"xla_cpu_rel_l2": None, "tp": tp}
                if tp == 1:
                    rel = backend.check(lowered, module, gdef.inputs, tensors)
                    if not rel <= XLA_CPU_REL_L2:
                        raise CompileError(f"graph {gdef.name}: lowered HLO on XLA:CPU differs from eager PyTorch "
                                           f"(rel-L2 {rel:.3g} > {XLA_CPU_REL_L2})", "report this as a qic bug")
                    checks["xla_cpu_rel_l2"] = float(f"{rel:.3g}")
                else:
                    # A TP graph's all-reduces need tp XLA:CPU devices executing in lockstep; the tests run
                    # that (tests/test_neuron_xla.py), the build records the single-device figure only.
                    checks["xla_cpu_check"] = f"not run at build time for tp={tp} (see tests/test_neuron_xla.py)"
                if owned:
                    save_file(owned, str(tmp / "constants.safetensors"))
                files = [compiled.file, *compiled.meta.get("extra_files", [])]
                files += ["constants.safetensors"] if owned else []
                meta = {
                    "graph": gdef.name, "component": gdef.component, "file": compiled.file,
                    "constants_file": "constants.safetensors" if owned else None,
                    "weight_inputs": names, "owned_constants": sorted(owned),
                    "weight_prefix": gdef.weight_prefix,
                    "inputs": [{"name": n, "shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")}
                               for n, t in gdef.inputs],
                    "outputs": gdef.outputs, "dynamic_text": False, "checks": checks,
                    "hlo": {"bytes": len(lowered.proto), "parameters": len(lowered.param_order)},
                    "files": {f: {"sha256": sha256_file(tmp / f), "bytes": (tmp / f).stat().st_size} for f in files},
                    "compile_seconds": round(time.perf_counter() - t0, 2), "backend": backend.identity(),
                }
                write_json_atomic(tmp / "meta.json", meta)
            art = _lookup(cache_dir, gkey)
    return GraphArtifact(gkey, art[1], art[2], cached, time.perf_counter() - t0)


def graph_key_from(h, gdef: GraphDef, owned: dict, identity: dict) -> str:
    """Finish a graph key: input shapes, outputs, back end, and graph-owned constants' bytes."""
    h.update(json.dumps([[n, list(t.shape), str(t.dtype)] for n, t in gdef.inputs]).encode())
    h.update(json.dumps({"dynamic": bool(gdef.dynamic), "outputs": gdef.outputs, "backend": identity},
                        sort_keys=True).encode())
    for name in sorted(owned):
        t = owned[name]
        h.update(name.encode() + str(t.dtype).encode() + str(tuple(t.shape)).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:32]


class WeightsAsInputs(torch.nn.Module):
    """forward(args, weights): the module run with `weights` (in `names` order) as its tensors."""

    def __init__(self, module: torch.nn.Module, names: list[str]):
        super().__init__()
        self.module, self.names = module, names

    def forward(self, args, weights):
        return torch.func.functional_call(self.module, dict(zip(self.names, weights)), args)


def graph_key(program, gdef: GraphDef, owned: dict, identity: dict) -> str:
    h = hashlib.sha256(b"qic-graph-v2")
    h.update(graph_text(program).encode())
    h.update(str(program.graph_signature).encode())
    return graph_key_from(h, gdef, owned, identity)


def graph_text(program) -> str:
    """The whole exported graph as text: every nested graph (scan bodies are submodules, absent from
    the top-level code) with each value's dtype and shape, so weight shapes (TP=1 vs TP=2) count.
    Source-location comments are dropped: they name paths that differ between checkouts."""
    text = program.graph_module.print_readable(print_output=False, include_stride=True, include_device=True)
    return "\n".join(line for line in text.splitlines() if not line.strip().startswith("#"))


def _lookup(cache_dir: Path, gkey: str):
    """(key, dir, meta) if the cached artifact is complete and its files match their recorded sizes."""
    d = cache_dir / "graphs" / gkey
    try:
        meta = json.loads((d / "meta.json").read_text())
        for f, entry in meta["files"].items():
            if (d / f).stat().st_size != entry["bytes"]:
                return None
    except (OSError, ValueError, KeyError):
        return None
    return gkey, d, meta
