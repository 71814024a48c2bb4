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
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from qic import __version__
from qic.backends.base import Backend
from qic.build import store
from qic.build.graphs import GraphDef
from qic.fsutil import file_lock, staging_dir, write_bytes_atomic
from qic.manifest import sha256_file

_CODE_DIRS = ("models", "build/graphs.py", "backends")
_QIC = Path(__file__).resolve().parent.parent
# Fault injection for the warm tests: a graph whose name contains this fails before it compiles.
_TEST_FAIL = os.environ.get("QIC_TEST_FAIL_GRAPH", "")


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
                  cache_dir: Path, skey: str, remote=None, sign=None) -> GraphArtifact:
    """The artifact for a graph: by spec key from the memo, by graph key from the cache, from the remote
    store (`remote`, a qic.build.store remote), or compiled; `sign` (a private key) signs what it compiles.

    `gdef` may be a zero-argument callable, called only on a memo miss: building a GraphDef binds
    (memory-maps) weights, which a no-op build should not do.
    """
    cache_dir = Path(cache_dir)
    memo = cache_dir / "index" / skey
    identity = backend.identity()
    t0 = time.perf_counter()
    if memo.is_file():
        gkey = memo.read_text().strip()
        hit = store.lookup(cache_dir, gkey, identity, quiet=True)
        if hit is None:  # stale or damaged: the locked path below reports and replaces it
            with file_lock(cache_dir / "locks" / f"graph-{gkey}.lock"):
                hit = store.lookup(cache_dir, gkey, identity)
        if hit:
            return GraphArtifact(gkey, cache_dir / "graphs" / gkey, hit, True, time.perf_counter() - t0)
    if callable(gdef):
        gdef = gdef()
    if getattr(backend, "traces_modules", False):
        art = lower_graph(gdef, backend, weight_names, cache_dir, t0, remote, sign)
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
    owned = _owned(gdef, tensors, weight_names)
    gkey = graph_key(program, gdef, owned, identity)
    final = cache_dir / "graphs" / gkey
    with file_lock(cache_dir / "locks" / f"graph-{gkey}.lock"):
        meta = _find(cache_dir, gkey, identity, remote)
        cached = meta is not None
        if meta is None:
            with staging_dir(final) as tmp:
                if _TEST_FAIL and _TEST_FAIL in gdef.name:
                    raise RuntimeError(f"injected compile failure for {gdef.name} (QIC_TEST_FAIL_GRAPH)")
                compiled = backend.compile(program, tmp)
                meta = _seal(tmp, gdef, compiled, names, owned, identity, gkey, t0, sign)
    write_bytes_atomic(memo, gkey.encode())
    return GraphArtifact(gkey, final, meta, cached, time.perf_counter() - t0)


def lower_graph(gdef: GraphDef, backend: Backend, weight_names: set[str], cache_dir: Path, t0: float,
                remote=None, sign=None) -> GraphArtifact:
    """The neuron path: lower the eager module to HLO (no torch.export), check it on XLA:CPU, cache it.

    The graph key is the HLO's own digest (plus shapes, owned constants and the back end's identity):
    the HLO is what the compiler sees, and lowering takes well under a second per graph.
    """
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
    identity = backend.identity()
    lowered = backend.lower(module, gdef.inputs, tensors, tp)
    owned = _owned(gdef, tensors, weight_names)
    owned.update(lowered.constants)   # scalars torch-xla made parameters: they travel with the graph
    names = list(tensors) + list(lowered.constants)
    gkey = graph_key_from(hashlib.sha256(b"qic-hlo-v1" + hashlib.sha256(lowered.proto).digest()), gdef, owned,
                          identity)
    final = cache_dir / "graphs" / gkey
    with file_lock(cache_dir / "locks" / f"graph-{gkey}.lock"):
        meta = _find(cache_dir, gkey, identity, remote)
        cached = meta is not None
        if meta is None:
            with staging_dir(final) as tmp:
                compiled = backend.write(lowered, names, [n for n, _ in gdef.inputs], tmp)
                checks = {"xla_cpu_rel_l2": None, "tp": tp}
                if not backend.xla_check:
                    checks["xla_cpu_check"] = "not run (xla_check: false)"
                elif tp == 1:
                    result = backend.check(lowered, module, gdef.inputs, tensors)
                    if not result.pop("ok"):
                        raise CompileError(f"graph {gdef.name}: lowered HLO on XLA:CPU differs from eager PyTorch "
                                           f"beyond its bound ({result['bound']}; rel-L2 "
                                           f"{result['xla_cpu_rel_l2']:.3g})", "report this as a qic bug")
                    checks.update({k: float(f"{v:.3g}") if isinstance(v, float) else v for k, v in result.items()})
                else:
                    # A TP graph's collectives need tp XLA:CPU devices executing in lockstep with every rank's
                    # shard; the tests run that (tests/test_neuron_xla.py); the build records no figure.
                    checks["xla_cpu_check"] = f"not run at build time for tp={tp} (see tests/test_neuron_xla.py)"
                meta = _seal(tmp, gdef, compiled, names, owned, identity, gkey, t0, sign,
                             checks=checks, hlo={"bytes": len(lowered.proto), "parameters": len(lowered.param_order)})
    return GraphArtifact(gkey, final, meta, cached, time.perf_counter() - t0)


def _find(cache_dir: Path, gkey: str, identity: dict, remote) -> dict | None:
    """Under the entry's lock: the local entry's meta, else the remote store's (fetched), else None."""
    meta = store.lookup(cache_dir, gkey, identity)
    if meta is None and remote is not None:
        meta = remote.fetch(gkey, cache_dir, identity)
    return meta


def _owned(gdef: GraphDef, tensors: dict, weight_names: set[str]) -> dict:
    """The graph's own tensors (RoPE tables, latent statistics): those the weight shards do not hold."""
    return {n: t.detach().cpu().contiguous().clone() for n, t in tensors.items()
            if not (n.startswith(gdef.weight_prefix) and n[len(gdef.weight_prefix):] in weight_names)}


def _seal(tmp: Path, gdef: GraphDef, compiled, names: list[str], owned: dict, identity: dict, gkey: str,
          t0: float, sign, **extra) -> dict:
    """Write the entry's constants and meta.json (signed when `sign` is given); the meta."""
    if owned:
        save_file(owned, str(tmp / "constants.safetensors"))
    files = [compiled.file, *compiled.meta.get("extra_files", [])] + (["constants.safetensors"] if owned else [])
    meta = {
        "graph": gdef.name, "component": gdef.component, "file": compiled.file,
        "constants_file": "constants.safetensors" if owned else None,
        "weight_inputs": names, "owned_constants": sorted(owned),
        "weight_prefix": gdef.weight_prefix,
        "inputs": [{"name": n, "shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")}
                   for n, t in gdef.inputs],
        "outputs": gdef.outputs, "dynamic_text": bool(gdef.dynamic),
        "files": {f: {"sha256": sha256_file(tmp / f), "bytes": (tmp / f).stat().st_size} for f in files},
        "compile_seconds": round(time.perf_counter() - t0, 2), "backend": identity, "key": gkey, **extra,
    }
    store.seal(tmp, meta, sign)
    return meta


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
