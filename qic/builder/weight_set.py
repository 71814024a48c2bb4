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
from qic.builder.pipeline import BuildReport, Row, stage_progress
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
        comp = family.component(name)
        # Before any conversion (a real checkpoint's is tens of GB): one rank's module at this checkpoint's config
        # against the bundle's first weight file, shape by shape (raises naming head counts where TP cannot cut).
        _check_shapes(expected_tensors(comp, ctx.configs[name], tp_of(name, spec.tp), looped=looped(spec, name)),
                      bundle, files[name][0], name, model)
        t = time.perf_counter()
        res = shard_component(ctx.ckpt, comp, ctx.configs[name], digest, tp_of(name, spec.tp), spec.dtype_of(name),
                              ctx.cache, stage_progress(progress, "shard", name), looped=looped(spec, name))
        _check_fits(res.files, bundle, files[name], name, model)
        shards[name] = res
        report.rows.append(Row("shard", name, res.cached, res.bytes, time.perf_counter() - t))
    key = hashlib.sha256(json.dumps({"for": theirs["id"], "checkpoint": digest, "qic": __version__,
                                     "format": FORMAT_VERSION, "shards": {k: v.key for k, v in shards.items()}},
                                    sort_keys=True).encode())
    t = time.perf_counter()
    written = _write(ctx, theirs, digest, shards, files, key.hexdigest())
    report.up_to_date = not written
    size = sum(p.stat().st_size for p in ctx.output.rglob("*") if p.is_file())
    report.rows.append(Row("weights", str(ctx.output), not written, size, time.perf_counter() - t))
    report.seconds = time.perf_counter() - t0
    return report


def _check_shapes(expected: dict, bundle: Path, theirs: str, component: str, model: str) -> None:
    """The names both hold have the same shapes (names alone are checked after conversion: _check_fits)."""
    for name, info in read_header(bundle / theirs).tensors.items():
        if name in expected and tuple(expected[name]) != tuple(info.shape):
            raise ConfigError(f"--model {model}: {component} tensor {name} is {list(expected[name])} there, {bundle}'s "
                              f"graphs take {list(info.shape)}", "a checkpoint of the bundle's architecture")


def _check_fits(ours: tuple[Path, ...], bundle: Path, theirs: list[str], component: str, model: str) -> None:
    """Every rank's tensors are the bundle's: the same names, shapes and dtypes (what its graphs take)."""
    for rank, path in enumerate(ours):
        mine = read_header(path).tensors
        want = read_header(bundle / theirs[rank if len(theirs) > 1 else 0]).tensors
        for name, info in want.items():
            got = mine.get(name)
            if got is None or got.shape != info.shape or got.dtype != info.dtype:
                has = "missing" if got is None else f"{list(got.shape)} {got.dtype}"
                raise ConfigError(f"--model {model}: {component} tensor {name} is {has} there, {bundle}'s graphs take "
                                  f"{list(info.shape)} {info.dtype}", "a checkpoint of the bundle's architecture")
        extra = sorted(set(mine) - set(want))
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
