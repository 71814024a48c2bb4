"""Several weight sets behind one set of graphs (`qic serve BUNDLE --weights NAME=OTHER_BUNDLE ...`).

qic's graphs take their weights as inputs, so another bundle of the same architecture (Qwen-Image-2512 beside
Qwen-Image, a LoRA-merged build, a Lightning set) runs through the same compiled graphs: each named set is the
bundle loaded as `qic run --weights OTHER_BUNDLE` loads it (verified, each tensor's name, shape and dtype checked
against the graphs' inputs: a set that does not fit is one line at start). A request's `model` field picks one;
`/v1/models` lists them. The bundle's own set stays mapped; the named ones are mapped on first use and, past
`--weights-budget`, the least recently used is unmapped (its memory returns to the OS as its mappings close).
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from qic.errors import ConfigError
from qic.manifest import read_manifest

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]*")
log = logging.getLogger("qic.serve")


def parse_weights(values, own: str = "") -> tuple[str | None, dict[str, str]]:
    """`--weights` values: (the one unnamed BUNDLE, whose weights replace the served bundle's own as `qic run
    --weights` does, or None; {name: bundle} of the NAME=BUNDLE ones, each another model served beside it). `own`:
    the served bundle's model name, which no set may take."""
    unnamed, named = [], {}
    for value in values or ():
        name, sep, path = value.partition("=")
        if not sep or not NAME.fullmatch(name):
            unnamed.append(value)
            continue
        if name in named:
            raise ConfigError(f"--weights {value}: the name {name!r} is given twice")
        if name == own:
            raise ConfigError(f"--weights {value}: {name!r} is the served bundle's own model name",
                              "give the set another name")
        if not path:
            raise ConfigError(f"--weights {value}: no bundle after {name}=")
        named[name] = path
    if len(unnamed) > 1:
        raise ConfigError(f"--weights: one bundle replaces the served weights, {len(unnamed)} given ({unnamed[0]}, "
                          f"{unnamed[1]})", "name the others: --weights NAME=BUNDLE serves each as a model of its own")
    return (unnamed[0] if unnamed else None), named


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

