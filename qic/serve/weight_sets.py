"""Several weight sets behind one set of graphs (`qic serve BUNDLE --weights NAME=OTHER_BUNDLE_OR_DIR ...`).

qic's graphs take their weights as inputs, so another bundle of the same architecture (Qwen-Image-2512 beside
Qwen-Image, a LoRA-merged build, a Lightning set) runs through the same compiled graphs: each named set is the
bundle loaded as `qic run --weights OTHER_BUNDLE` loads it (verified, each tensor's name, shape and dtype checked
against the graphs' inputs: a set that does not fit is one line at start). A request's `model` field picks one;
`/v1/models` lists them. The bundle's own set stays mapped; the named ones are mapped on first use and, past
`--weights-budget`, the least recently used is unmapped (its memory returns to the OS as its mappings close).
A checkpoint folder is first cut into a weight set for the bundle's graphs (`qic build --weights-for`, in a process
of its own: the server imports no compiler code) under the cache directory; a later start finds it in place.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from qic.errors import BundleError, ConfigError
from qic.manifest import MANIFEST, read_manifest
from qic.serve.settings import named_values

log = logging.getLogger("qic.serve")


def parse_weights(values, own: str = "") -> tuple[str | None, dict[str, str]]:
    """`--weights` values: (the one unnamed BUNDLE, whose weights replace the served bundle's own as `qic run
    --weights` does, or None; {name: bundle or checkpoint folder} of the NAME=... ones, each another model served
    beside it). `own`: the served bundle's model name, which no set may take."""
    unnamed, named = named_values(values, "--weights", "bundle", own)
    if len(unnamed) > 1:
        raise ConfigError(f"--weights: one bundle replaces the served weights, {len(unnamed)} given ({unnamed[0]}, "
                          f"{unnamed[1]})", "name the others: --weights NAME=BUNDLE serves each as a model of its own")
    return (unnamed[0] if unnamed else None), named


def as_weight_sets(named: dict[str, str], bundle: str, cache_dir: str) -> dict[str, str]:
    """`named` with each checkpoint folder (a model_index.json, no manifest) replaced by the weight set cut from it
    for `bundle`'s graphs under `cache_dir`/weight-sets, made now where it is not in place already."""
    out = {}
    for name, path in named.items():
        where = Path(path)
        if (where / MANIFEST).is_file():
            out[name] = path
            continue
        if not (where / "model_index.json").is_file():
            raise ConfigError(f"--weights {name}={path}: neither a qic bundle ({MANIFEST}) nor a checkpoint folder "
                              "(model_index.json)")
        key = hashlib.sha256(f"{_set_id(Path(bundle))}\0{os.path.realpath(where)}".encode())
        made = Path(cache_dir) / "weight-sets" / f"{name}-{key.hexdigest()[:16]}"
        before = _set_id(made)
        proc = subprocess.run([sys.executable, "-m", "qic.cli", "build", "--weights-for", str(bundle), "--model",
                               str(path), "--output", str(made), "--cache-dir", str(cache_dir)],
                              capture_output=True, text=True)
        if proc.returncode:
            lines = proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"]
            said = next((line for line in lines if line.startswith("error:")), lines[-1])
            fix = next((line.strip() for line in lines if line.strip().startswith("fix:")), "")
            raise ConfigError(f"--weights {name}={path}: {said.removeprefix('error: ')}", fix.removeprefix("fix: "))
        # stderr, as the server's log lines (its logging is set up later, in the ranks)
        print(f"weight set {name}: checkpoint {path} " + ("already cut" if _set_id(made) == before else "cut")
              + f" for {bundle}'s graphs: {made}", file=sys.stderr, flush=True)
        out[name] = str(made)
    return out


def _set_id(path: Path) -> str | None:
    """The id of the bundle or weight set at `path`; None where there is none (yet)."""
    try:
        return read_manifest(path)["id"]
    except BundleError:
        return None


def weight_bytes(path: Path) -> int:
    """A bundle's weight bytes per tensor-parallel rank: all its weight files over its TP degree (the same figure on
    every rank, so that every rank's budget unmaps the same sets; a rank maps about this much of a set)."""
    manifest = read_manifest(path)
    files = {f for g in manifest["graphs"] for f in g["weights"]}
    return sum((path / f).stat().st_size for f in files) // max(1, manifest.get("tp", 1))


class WeightSets:
    """The served weight sets by model name: the primary bundle's (always loaded) and the named ones, loaded on
    demand by `load(path)` (a Bundle running this bundle's graphs with that bundle's weights) and kept within
    `budget` bytes of named sets, least recently used unmapped first (never the one just asked for)."""

    def __init__(self, primary, name: str, named: dict[str, str], load: Callable[[Path], object],
                 budget: float | None = None):
        self.primary, self.name = primary, name
        if name in named:
            raise ConfigError(f"--weights {name}=...: {name!r} is the served bundle's own model name",
                              "give the set another name")
        self.paths = {n: Path(p) for n, p in named.items()}
        self.load, self.budget = load, budget
        self.loaded: OrderedDict[str, object] = OrderedDict()
        self.sizes: dict[str, int] = {}
        self.maps = {n: 0 for n in self.paths}   # times each was mapped (unmapped and asked for again: again)

    @property
    def names(self) -> list[str]:
        return [self.name, *self.paths]

    def get(self, name: str | None):
        """The bundle of model `name` (None: the primary's), mapped now if it is not."""
        if name is None or name == self.name:
            return self.primary
        if name in self.loaded:
            self.loaded.move_to_end(name)
            return self.loaded[name]
        path = self.paths[name]
        bundle = self.load(path)
        self.sizes[name] = weight_bytes(path)
        self.loaded[name] = bundle
        self.maps[name] += 1
        log.info(f"mapped weight set {name} ({self.sizes[name] / 2**20:.1f} MiB) from {path}")
        self._fit(keep=name)
        return bundle

    def check_all(self) -> None:
        """Load every named set once, in order (a refusal is one line at start, and ranks load in the same order),
        keeping what the budget allows."""
        for name in self.paths:
            self.get(name)

    def _fit(self, keep: str) -> None:
        while self.budget is not None and sum(self.sizes[n] for n in self.loaded) > self.budget:
            oldest = next((n for n in self.loaded if n != keep), None)
            if oldest is None:
                return   # the one just asked for is larger than the budget alone: it stays while it runs
            del self.loaded[oldest]
            log.info(f"unmapped weight set {oldest} (--weights-budget {self.budget / 2**30:g} GiB)")

