"""`qic build --weights-for BUNDLE --model DIR --output SET`: a checkpoint's weights cut for BUNDLE's graphs.

A weight set is a bundle without graphs: a manifest (kind "weights") and per-rank weight files, sharded exactly as
BUNDLE's own were (its components, dtypes, TP degree and looped or unrolled blocks, all read off its manifest), so
`qic run BUNDLE --weights SET` and `qic serve BUNDLE --weights NAME=SET` run BUNDLE's compiled graphs over it. Nothing
is compiled: Qwen-Image-2512 beside Qwen-Image costs a conversion, not a build. Every tensor is checked against
BUNDLE's weight files (name, shape, dtype) before the set is written, so a checkpoint of another architecture is
one line here rather than at load. The shards go through the shard cache as a build's do, and a set whose build key
(BUNDLE's id, the checkpoint's digest, the shards) is already in place is left untouched: `qic serve` converts a
checkpoint folder this way at each start, and only the first start does the work.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import torch

from qic import __version__, family
from qic.builder.bundle import write_output
from qic.builder.components import expected_tensors
from qic.builder.context import Context, looped, tp_of
from qic.builder.pipeline import BuildReport, Row, stage_progress, tree_bytes
from qic.builder.shard import shard_component
from qic.builder.source import load_spec_by_family
from qic.checkpoint.safetensors_file import read_header
from qic.errors import ConfigError
from qic.fsutil import link_or_copy
from qic.manifest import FORMAT_VERSION, WEIGHT_SET, check_compatible, read_bundle


def build_weight_set(bundle: str | Path, model: str, output: str | Path, cache_dir: str | Path,
                     full_hash: bool = False, progress=None) -> BuildReport:
    t0 = time.perf_counter()
    bundle = Path(bundle)
    theirs = read_bundle(bundle)
    check_compatible(theirs, __version__, torch.__version__)
    files = {g["component"]: g["weights"] for g in theirs["graphs"]}
    spec = load_spec_by_family(None, {"model": model, "output": str(output), "cache_dir": str(cache_dir),
                            "tp": theirs["tp"], "full_hash": full_hash, "dtype": theirs["dtypes"],
                            "layers": theirs["layers"]})
    ctx = Context(spec, progress)
    if ctx.family.name != theirs["family"]["name"]:
        raise ConfigError(f"--model {model}: a {ctx.family.name} checkpoint; {bundle}'s graphs are "
                          f"{theirs['family']['name']}'s")
    report = BuildReport(ctx.output)
    digest = ctx.ckpt.digest(full=full_hash)
    shards = {}
    for name in files:   # the components with graphs (their weights); a bundle's tokenizer and host fields stay its
        comp, tp, stacked = family.component(name), tp_of(name, spec.tp), looped(spec, name)
        theirs_at = [read_header(bundle / f).tensors for f in files[name]]   # per rank (one: replicated)
        # Before any conversion (a real checkpoint's is tens of GB): one rank's module at this checkpoint's config,
        # shape by shape (raises naming head counts where TP cannot cut); names and dtypes once converted.
        expected = {k: (shape, None) for k, shape in expected_tensors(comp, ctx.configs[name], tp, stacked).items()}
        _check_fits(expected, theirs_at[0], name, model, bundle, names=False)
        t = time.perf_counter()
        res = shard_component(ctx.ckpt, comp, ctx.configs[name], digest, tp, spec.dtype_of(name), ctx.cache,
                              stage_progress(progress, "shard", name), looped=stacked)
        for rank, path in enumerate(res.files):
            ours = {k: (i.shape, i.dtype) for k, i in read_header(path).tensors.items()}
            _check_fits(ours, theirs_at[rank if len(theirs_at) > 1 else 0], name, model, bundle)
        shards[name] = res
        report.rows.append(Row("shard", name, res.cached, res.bytes, time.perf_counter() - t))
    key = hashlib.sha256(json.dumps({"for": theirs["id"], "checkpoint": digest, "qic": __version__,
                                     "format": FORMAT_VERSION, "shards": {k: v.key for k, v in shards.items()}},
                                    sort_keys=True).encode())
    t = time.perf_counter()
    written = _write(ctx, theirs, digest, shards, files, key.hexdigest())
    report.up_to_date = not written
    report.rows.append(Row("weights", str(ctx.output), not written, tree_bytes(ctx.output), time.perf_counter() - t))
    report.seconds = time.perf_counter() - t0
    return report


def _check_fits(ours: dict, theirs: dict, component: str, model: str, bundle: Path, names: bool = True) -> None:
    """`ours` ({name: (shape, dtype or None: not known yet)}) against one rank's weight file of the bundle (what its
    graphs take): the same shapes and dtypes, and with `names` the same tensors."""
    for name, info in theirs.items():
        got = ours.get(name)
        if got is None and not names:
            continue
        if got is None or tuple(got[0]) != tuple(info.shape) or got[1] not in (None, info.dtype):
            has = "missing" if got is None else f"{list(got[0])}" + (f" {got[1]}" if got[1] else "")
            raise ConfigError(f"--model {model}: {component} tensor {name} is {has} there, {bundle}'s graphs take "
                              f"{list(info.shape)} {info.dtype}", "a checkpoint of the bundle's architecture")
    extra = sorted(set(ours) - set(theirs)) if names else []
    if extra:
        raise ConfigError(f"--model {model}: {component} tensor {extra[0]} is not an input of {bundle}'s graphs",
                          "a checkpoint of the bundle's architecture")


def _write(ctx, theirs: dict, digest: str, shards: dict, files: dict, build_key: str) -> bool:
    """The set, atomically (False: an identical one is in place)."""
    def fill(tmp: Path) -> dict:
        for name, res in shards.items():
            for rel, path in zip(files[name], res.files, strict=True):   # the bundle's own file names
                link_or_copy(path, tmp / rel)
        return {
            "kind": WEIGHT_SET,
            "versions": {"qic": __version__, "torch": torch.__version__},
            "weights_for": theirs["id"],             # the bundle it was cut for (any of the same graphs runs it)
            "model": {"id": ctx.ckpt.model_id, "digest": digest},
            "family": theirs["family"],
            "tp": theirs["tp"],
            "dtypes": theirs["dtypes"],
            "layers": theirs["layers"],
            "components": list(files),
            "graphs": [{"component": name, "weights": rel} for name, rel in files.items()],
        }
    return write_output(ctx.cache, ctx.output, build_key, fill)
