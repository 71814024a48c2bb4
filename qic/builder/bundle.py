"""Stage 3: write a versioned bundle from the shard and compile caches, atomically.

    BUNDLE/manifest.json                   versions, model identity, graphs with shapes and sha256, ...
    BUNDLE/tokenizer/                      the checkpoint's tokenizer files
    BUNDLE/weights/<component>/rank{r}.safetensors   hard links into the shard cache where possible
    BUNDLE/graphs/<graph>/graph.pt2 [+ constants.safetensors]   copied from the compile cache

A bundle whose manifest already records this build key, with every file at its recorded size, is
left untouched (a no-op build writes nothing).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from qic import __version__, family
from qic.cache import layout
from qic.checkpoint.reader import TOKENIZER_FILES
from qic.fsutil import link_or_copy, make_temp_dir, replace_dir, sweep_stale
from qic.manifest import MANIFEST, file_entry, finalize


def write_output(cache: Path, out: Path, build_key: str, fill) -> bool:
    """Write a bundle (or a weight set) atomically; False when one of this build key is already in place. Under the
    output's lock (builds to one output take turns: without, two that both found it stale could both swap, and the
    later one fail), fill(tmp) writes the files into a temp directory beside `out` and returns the manifest's
    fields; every file written gets its hash record, the manifest is sealed, and the directory replaces `out`."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with layout.output_lock(cache, out):
        sweep_stale(out.parent, out.name)  # what a killed earlier build of this output left beside it
        if up_to_date(out, build_key):
            return False
        tmp = make_temp_dir(out)
        try:
            fields = fill(tmp)
            files = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
            manifest = finalize({**fields, "build_key": build_key,
                                 "files": {f: file_entry(tmp, f) for f in files}})
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
            replace_dir(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return True


def write_bundle(ctx, spec, backend, digest, shards, artifacts, build_key) -> bool:
    """Write the bundle; False when an identical one is already in place."""
    return write_output(ctx.cache, Path(spec.output), build_key,
                        lambda tmp: _bundle_fields(ctx, spec, backend, digest, shards, artifacts, tmp))


def _bundle_fields(ctx, spec, backend, digest, shards, artifacts, tmp: Path) -> dict:
    """The bundle's files written into `tmp`; its manifest's fields."""
    for name in TOKENIZER_FILES:
        src = ctx.ckpt.tokenizer_dir / name
        if src.is_file():
            _copy(src, tmp / "tokenizer" / name)
    weights = {}
    for comp, res in shards.items():
        rel = []
        for p in res.files:
            r = f"weights/{comp}/{p.name}"
            link_or_copy(p, tmp / r)
            rel.append(r)
        weights[comp] = rel
    graphs = []
    for art in artifacts:
        meta = art.meta
        gdir = f"graphs/{meta['graph']}"
        for f in meta["files"]:
            _copy(art.directory / f, tmp / gdir / f)
        extra, copies = backend.graph_fields(meta, gdir)
        for src, name in copies:
            _copy(src, tmp / gdir / name)
        graphs.append({**extra,
            "name": meta["graph"], "component": meta["component"], "key": art.graph_key,
            "file": f"{gdir}/{meta['file']}",
            "constants_file": f"{gdir}/{meta['constants_file']}" if meta["constants_file"] else None,
            "weights": weights[meta["component"]], "weight_prefix": meta["weight_prefix"],
            "weight_inputs": meta["weight_inputs"], "owned_constants": meta["owned_constants"],
            "inputs": meta["inputs"], "outputs": meta["outputs"], "dynamic_text": meta["dynamic_text"],
            # LoRA slots: weight inputs no shard holds, filled per request (qic/runtime/lora.py)
            "lora_slots": meta.get("lora_slots") or {},
            "bytes": sum(e["bytes"] for e in meta["files"].values()),
            # The machine it was compiled for (from the cache, maybe not this one): the runtime checks it.
            "target": meta["backend"].get("target"),
        })
    fields = getattr(family.components_module(), "manifest_fields", None)
    return {
        "versions": {"qic": __version__, "torch": torch.__version__},
        "backend": backend.identity(),
        "device": spec.device,
        "tp": spec.tp,
        # Ranks per image (qic/parallel/mesh.py): world = tp x ulysses x cfg; tp shard files serve every world.
        "layout": spec.layout.as_dict(),
        "model": {"id": ctx.ckpt.model_id, "digest": digest},
        # Which family built it and the host program that runs it (qic.runtime.programs imports it by name)
        "family": {"name": ctx.family.name, "host": ctx.family.host_of(spec)},
        "dtypes": dict(spec.dtype),
        "components": list(spec.components),
        "tokenizer": "tokenizer" if ctx.tokenizer is not None else None,
        "defaults": dict(spec.defaults),                  # run defaults of the build config
        "loras": [{"file": Path(lo.path).name, "sha256": lo.digest, "scale": lo.scale} for lo in ctx.loras],
        "lora_slots": spec.lora_slots,     # per-request adapters' total rank (0: none)
        "layers": dict(spec.layers),       # looped / unrolled: how a weight set for these graphs is cut
        # The family's own fields (Qwen-Image: resolutions, buckets, prompt, scheduler, latents, ...)
        **(fields(spec, ctx) if fields is not None else {}),
        "graphs": graphs,
        **backend.bundle_fields(graphs),
    }


def _copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)


def up_to_date(out: Path, build_key: str) -> bool:
    try:
        manifest = json.loads((out / MANIFEST).read_text())
        if manifest.get("build_key") != build_key:
            return False
        return all((out / f).stat().st_size == e["bytes"] for f, e in manifest["files"].items())
    except (OSError, ValueError, KeyError):
        return False
