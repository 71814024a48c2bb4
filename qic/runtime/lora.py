"""Per-request LoRA on a slotted bundle (`qic build --lora-slots R`; qic.models.lora_slots says what a slot computes).

`Adapters` holds the adapters a process may use by name (`qic serve --lora NAME=FILE`; `qic run --lora FILE[:SCALE]`
names them by path), each checked against the bundle's slots when named: every module it targets must have one, and
its rank must fit R. A request's `lora` is a list of (name, scale); `bind` fills a step graph's slot inputs for a
batch of requests, each image its own adapters side by side along the rank dim (the first adapter's columns first),
and returns the graph over them. An adapter's matrices are read once and kept in an LRU within `budget` bytes; the slot
tensors of the last adapter combination are kept too, so a request that only changes
strengths rebuilds nothing but the [n, R] scale vectors. Matrices are kept whole in fp32; each TP rank cuts its part
as it fills its slots.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path

import torch

from qic.checkpoint.lora import Lora, load_lora, lora_entry
from qic.errors import ConfigError

_SHAPE = type("_Shape", (), {"__init__": lambda self, shape: setattr(self, "shape", tuple(shape))})


def parse_choices(values, source: str = "lora") -> list[tuple[str, float]]:
    """A request's lora entries, 'NAME[:SCALE]' strings (qic run, a prompts-file line) or {"name", "scale"} objects
    (qic serve's body), as (name, scale) pairs (which it takes too)."""
    # (a pair: already parsed, as a request is validated twice: admitted, then run)
    pairs = ({"name": v[0], "scale": v[1]} if isinstance(v, tuple) and len(v) == 2 else v for v in values or [])
    return [lora_entry(v, "name", source, "lora entry") for v in pairs]


class Adapters:
    """The adapters a slotted bundle's requests may name (see the module's docstring)."""

    def __init__(self, bundle, named: dict[str, str | Path] | None = None, budget: float | None = None,
                 files: bool = False):
        """named: NAME -> file; files: a request may name a file instead (qic run); budget: bytes of adapter
        matrices kept in memory (None: no bound)."""
        if not bundle.lora_slots:
            raise ConfigError(f"{bundle.path}: LoRA adapters per request need a bundle built with --lora-slots R",
                              "rebuild with --lora-slots (e.g. 64), or merge the LoRA at build time (qic build --lora)")
        self.bundle, self.rank, self.files, self.budget = bundle, bundle.lora_slots, files, budget
        self.tp, self.tp_rank = bundle.manifest["tp"], bundle.coords["tp"]
        self.modules = self._modules()
        self.checked: dict[str, Lora] = {}
        self.loaded: OrderedDict[str, dict] = OrderedDict()
        self.sizes: dict[str, int] = {}
        self.hits = self.misses = 0
        self._last: tuple | None = None      # (adapter names per image, {slot tensor name: its down / up})
        self._lock = threading.Lock()
        for name, path in (named or {}).items():
            self.add(name, path)

    def _modules(self) -> dict[str, object]:
        """'<module>.weight' -> its whole (out, in) shape, for every module with a slot (the first slotted graph's)."""
        graph = next((g for g in self.bundle.graphs.values() if g.lora_slots), None)
        if graph is None:
            raise ConfigError(f"{self.bundle.path}: the bundle records lora_slots but no graph takes slot inputs")
        parts: dict[str, dict] = {}
        for e in graph.lora_slots.values():
            parts.setdefault(e["module"], {})[e["part"]] = e
        layers = {}
        for module, p in parts.items():
            down, up = p["down"], p["up"]
            n_in = down["shape"][-1] * (self.tp if down["split"] == 1 else 1)
            n_out = up["shape"][-2] * (self.tp if up["split"] == 0 else 1)
            count = down["shape"][0] if down["stacked"] else 1
            for i in range(count):
                layers[module.format(i=i) + ".weight"] = _SHAPE((n_out, n_in))
        return layers

    def add(self, name: str, path: str | Path) -> Lora:
        """Check an adapter file against the slots, and name it."""
        lora = load_lora(path, 1.0, self.modules, what=f"{self.bundle.path}'s LoRA slots")
        if lora.rank > self.rank:
            raise ConfigError(f"{path}: LoRA rank {lora.rank} exceeds the bundle's slots (--lora-slots {self.rank})",
                              f"rebuild with --lora-slots {lora.rank} or more, or merge it at build time (--lora)")
        self.checked[name] = lora
        return lora

    def resolve(self, choices: list[tuple[str, float]]) -> list[tuple[Lora, str, float]]:
        """A request's (name, scale) pairs checked: known adapters (files, where allowed) whose ranks add up to R."""
        out = []
        for name, scale in choices:
            lora = self.checked.get(name)
            if lora is None:
                if not self.files:
                    known = ", ".join(sorted(self.checked)) or "none"
                    raise ConfigError(f"lora: no adapter named {name!r} (served: {known})",
                                      "name one given by qic serve --lora NAME=FILE")
                lora = self.add(name, name)
            out.append((lora, name, scale))
        total = sum(lo.rank for lo, _, _ in out)
        if total > self.rank:
            raise ConfigError(f"lora: the adapters' ranks add up to {total}, more than the bundle's slots "
                              f"(--lora-slots {self.rank})", "use fewer adapters at once, or rebuild with more slots")
        return out

    def bind(self, graph, requests: list[list[tuple[str, float]]]):
        """The step graph over slot inputs filled with each image's adapters (a request's list, in batch order)."""
        per_image = [self.resolve(r) for r in requests]
        key = tuple(tuple(name for _, name, _ in image) for image in per_image)
        matrices = {n: e for n, e in graph.lora_slots.items() if e["part"] != "scale"}
        with self._lock:
            mats = {name: self._load(name, lora) for image in per_image for lora, name, _ in image}
            if self._last is None or self._last[0] != key:   # the last combination's down / up, by tensor name:
                self._last = (key, {})                       # every graph of a step (step caching's parts) shares them
            kept = self._last[1]
            kept.update(self._compose({n: e for n, e in matrices.items() if n not in kept}, per_image, mats))
        scales = {n: e for n, e in graph.lora_slots.items() if e["part"] == "scale"}
        return graph.with_weights({**{n: kept[n] for n in matrices}, **self._compose(scales, per_image, mats)})

    def _compose(self, entries: dict, per_image, mats: dict) -> dict[str, torch.Tensor]:
        out = {}
        for tname, e in entries.items():
            t = torch.zeros(e["shape"], dtype=getattr(torch, e["dtype"]))
            for layer in range(e["shape"][0] if e["stacked"] else 1):
                module = e["module"].format(i=layer) + ".weight"
                rows = t[layer] if e["stacked"] else t
                for j, image in enumerate(per_image):
                    col = 0
                    for lora, name, scale in image:
                        got = mats[name].get(module)
                        if got is not None:
                            down, up, factor = got
                            r = down.shape[0]
                            if e["part"] == "down":
                                rows[j, col:col + r] = self._part(down, e["split"])
                            elif e["part"] == "up":
                                rows[j, :, col:col + r] = self._part(up, e["split"])
                            else:
                                rows[j, col:col + r] = factor * scale
                        col += lora.rank
            out[tname] = t
        return out

    def _part(self, matrix: torch.Tensor, split) -> torch.Tensor:
        return matrix if split is None or self.tp == 1 else matrix.chunk(self.tp, dim=split)[self.tp_rank]

    def held(self) -> int:
        """Bytes of adapter matrices in memory."""
        return sum(self.sizes[n] for n in self.loaded)

    def _load(self, name: str, lora: Lora) -> dict:
        """An adapter's (down, up, factor) per module, read on its first use and kept within the budget (LRU); a use
        that finds them in memory counts as a hit."""
        if name in self.loaded:
            self.loaded.move_to_end(name)
            self.hits += 1
            return self.loaded[name]
        self.misses += 1
        mats = lora.factors()
        self.loaded[name] = mats
        self.sizes[name] = sum(d.nbytes + u.nbytes for d, u, _ in mats.values())
        while self.budget is not None and len(self.loaded) > 1 and self.held() > self.budget:
            self.loaded.popitem(last=False)
        return mats
