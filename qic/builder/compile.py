"""Stage 2: trace and compile each graph through a content-addressed compile cache, the same protocol for
every back end (the back end traces and compiles; this module keys, finds, stores and seals).

Weights are graph inputs, not constants. AOTInductor's weight-free packages
(package_constants_in_so=False + load_constants) were measured to be wrong here: inductor folds
weight-derived tensors at compile time (transposed Linear weights, a 1x1 conv's bias) into constants
that the package then lacks (uninitialised: NaN in the step graph) or bakes in (the VAE silently kept
the compile-time checkpoint's conv biases). Passing every weight as an input makes a graph
independent of the weights by construction: one artifact serves every checkpoint of the
architecture, and the runtime hands it memory-mapped tensors without a copy.

Two keys per graph:
- the graph key names an artifact by what determines it: what the back end traced (the exported graph's
  code and signature, or the HLO), input shapes, graph-owned constants (RoPE tables, latent statistics),
  back end, versions and flags. Weights are not part of it: one compiled graph serves every checkpoint
  of the same architecture.
- the spec key (qic.builder.jobs) is computable without tracing; it memoises spec key -> graph key, so a
  no-op build traces nothing.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from qic.backends.base import Backend
from qic.builder.graphs import GraphDef
from qic.builder.lora_slots import is_slot, slot_entries
from qic.builder.workers import TORCH_LOCK
from qic.cache import layout, store
from qic.fsutil import staging_dir
from qic.manifest import sha256_file
from qic.weights import named_tensors


@dataclass(frozen=True)
class GraphArtifact:
    graph_key: str
    directory: Path
    meta: dict            # file, constant names, which are graph-owned, inputs/outputs, sizes
    cached: bool
    seconds: float
    # The entry's users lock (qic.cache.layout.graph_users), held shared while the artifact is referenced.
    users: object = field(default=None, repr=False, compare=False)


def compile_graph(gdef: GraphDef | Callable[[], GraphDef], backend: Backend, weight_names: set[str],
                  cache_dir: Path, skey: str, remote=None, sign=None, workers=None) -> GraphArtifact:
    """The artifact for a graph: by spec key from the memo, by graph key from the cache, from the remote
    store (`remote`, a qic.cache.remote store), or compiled; `sign` (a private key) signs what it compiles;
    `workers` (qic.builder.workers.CompileWorkers) compiles it, in another process where the back end can.

    `gdef` may be a zero-argument callable, called only on a memo miss: building a GraphDef binds
    (memory-maps) weights, which a no-op build should not do. Safe to call from several threads at once (the
    compile workers' build does): what runs torch here holds TORCH_LOCK.
    """
    cache_dir = Path(cache_dir)
    identity = backend.identity()
    t0 = time.perf_counter()
    gkey = layout.read_memo(cache_dir, skey)
    if gkey is not None:
        # Held (shared: builds do not serialise) from the check until the artifact is dropped, since the
        # bundle step reads the entry's files after this returns: `qic cache prune` skips it meanwhile.
        users = layout.graph_users(cache_dir, gkey)
        users.acquire()
        hit = store.lookup(cache_dir, gkey, identity, quiet=True)
        if hit is None:  # stale or damaged: the locked path below reports and replaces it
            with layout.graph_lock(cache_dir, gkey):
                hit = store.lookup(cache_dir, gkey, identity)
        if hit:
            return GraphArtifact(gkey, layout.graph_dir(cache_dir, gkey), hit, True, time.perf_counter() - t0,
                                 users)
        users.release()
    with TORCH_LOCK:
        if callable(gdef):
            gdef = gdef()
        gdef.module.eval()
        tensors = named_tensors(gdef.module)
        traced = backend.trace(gdef, tensors)
        owned = _owned(gdef, tensors, weight_names)
        owned.update(traced.constants)
        gkey = graph_key_from(traced.digest, gdef, owned, identity)
    final = layout.graph_dir(cache_dir, gkey)
    users = layout.graph_users(cache_dir, gkey)   # as on a memo hit, taken before the entry can exist
    users.acquire()
    with layout.graph_lock(cache_dir, gkey):
        meta = _find(cache_dir, gkey, identity, remote)
        cached = meta is not None
        if meta is None:
            with staging_dir(final) as tmp:
                if workers is not None:
                    compiled = workers.compile(backend, traced, tmp)
                else:
                    with TORCH_LOCK:
                        compiled = backend.compile(traced, tmp)
                meta = _seal(tmp, gdef, compiled, traced.weight_names, owned, identity, gkey, t0, sign)
    layout.write_memo(cache_dir, skey, gkey)
    return GraphArtifact(gkey, final, meta, cached, time.perf_counter() - t0, users)


def _find(cache_dir: Path, gkey: str, identity: dict, remote) -> dict | None:
    """Under the entry's lock: the local entry's meta, else the remote store's (fetched), else None."""
    meta = store.lookup(cache_dir, gkey, identity)
    if meta is None and remote is not None:
        meta = remote.fetch(gkey, cache_dir, identity)
    return meta


def _owned(gdef: GraphDef, tensors: dict, weight_names: set[str]) -> dict:
    """The graph's own tensors (RoPE tables, latent statistics): those the weight shards do not hold."""
    return {n: t.detach().cpu().contiguous().clone() for n, t in tensors.items()
            if not (n.startswith(gdef.weight_prefix) and n[len(gdef.weight_prefix):] in weight_names)
            and not is_slot(n)}   # LoRA slots: inputs the runtime fills per request


def _seal(tmp: Path, gdef: GraphDef, compiled, names: list[str], owned: dict, identity: dict, gkey: str,
          t0: float, sign) -> dict:
    """Write the entry's constants and meta.json (signed when `sign` is given); the meta."""
    if owned:
        save_file(owned, str(tmp / "constants.safetensors"))
    files = [compiled.file, *compiled.extra_files] + (["constants.safetensors"] if owned else [])
    meta = {
        "graph": gdef.name, "component": gdef.component, "file": compiled.file,
        "constants_file": "constants.safetensors" if owned else None,
        "weight_inputs": names, "owned_constants": sorted(owned),
        "weight_prefix": gdef.weight_prefix,
        "inputs": [{"name": n, "shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")}
                   for n, t in gdef.inputs],
        "outputs": gdef.outputs, "dynamic_text": bool(gdef.dynamic),
        "lora_slots": slot_entries(gdef.component, gdef.weight_prefix, named_tensors(gdef.module)),
        "files": {f: {"sha256": sha256_file(tmp / f), "bytes": (tmp / f).stat().st_size} for f in files},
        "compile_seconds": round(time.perf_counter() - t0, 2), "backend": identity, "key": gkey, **compiled.meta,
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
