"""Open a bundle: verify it, then bind memory-mapped weights to its compiled graphs."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from qic import __version__
from qic.backends import load_graph, loader, lockstep
from qic.dtypes import TORCH_DTYPES
from qic.errors import BundleError
from qic.graph_names import graph_name
from qic.manifest import check_compatible, read_bundle, read_manifest, verify_files
from qic.parallel.mesh import RANK_INPUTS, Layout, join
from qic.runtime.protocol import refuse_unlisted
from qic.tokenizer import load_tokenizer
from qic.verified import VerificationCache
from qic.weights import mmap_safetensors

DTYPES = {**TORCH_DTYPES, "int64": torch.int64}   # graph inputs: floats and token ids


@dataclass
class Graph:
    name: str
    run: object                       # callable(list[Tensor]) -> list[Tensor]
    inputs: list[dict]                # name, shape, dtype as exported
    shape: dict = field(default_factory=dict)
    fixed: dict = field(default_factory=dict)   # input name -> the tensor every call gets (RANK_INPUTS)
    rebind: object = None             # weights -> the back end's run of the same loaded code over them, or None
    weights: dict = field(default_factory=dict)  # weight input name -> the tensor bound, in the graph's order
    lora_slots: dict = field(default_factory=dict)   # the manifest's LoRA slot entries (qic/runtime/lora.py)

    def __call__(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        given = iter(tensors)
        return self.run([(self.fixed[spec["name"]] if spec["name"] in self.fixed else next(given))
                         .to(DTYPES[spec["dtype"]]).contiguous() for spec in self.inputs])

    def with_weights(self, replaced: dict[str, torch.Tensor]) -> Graph:
        """This graph's loaded code over its weights with some replaced by name (a request's LoRA slots)."""
        if self.rebind is None:
            raise BundleError(f"graph {self.name}: this back end's graphs cannot take other weights per call")
        weights = {**self.weights, **replaced}
        return dataclasses.replace(self, run=self.rebind(list(weights.values())), weights=weights)


class Bundle:
    """A verified, loaded bundle: tokenizer, settings, and graphs by (component, resolution, bucket); what the
    runtime uses of it is qic.runtime.protocol.Runnable."""

    # Seconds this process has spent loading bundles, all loads together: a resident server reports
    # the growth of this per prompt, so a reload anywhere shows up in its timings.
    seconds_loading = 0.0

    def __init__(self, path: str | Path, device: str | None = None, rank: int = 0, world: int = 1,
                 verify_all: bool = False, weights_from: str | Path | None = None, code_from: Bundle | None = None):
        """weights_from: another bundle whose weights (e.g. another checkpoint of the same architecture, or a
        LoRA-merged build) this bundle's graphs run with; refused unless every weight tensor the graphs take
        has the same name, shape and dtype there. code_from: a loaded Bundle of this same bundle (its id) whose
        graphs' code this one runs over its own weights where the back end can rebind them (qic serve's weight
        sets), instead of loading it again."""
        t0 = time.perf_counter()
        self.path = Path(path)
        self.manifest = m = read_bundle(self.path)
        check_compatible(m, __version__, torch.__version__)
        self.device = device or m["device"]
        loader(m["backend"]["backend"]).check(self.path, m, self.device)
        # Every file is checked before any of it is loaded: compiled code is hashed every time, weight
        # shards once per identity (qic/verified.py) unless verify_all asks for a full re-hash.
        self.trusted_weight_files = verify_files(self.path, m, cache=VerificationCache(), full=verify_all)
        self.layout = Layout.of_manifest(m)
        if self.layout.world != world:
            raise BundleError(f"{self.path}: bundle was built for {self.layout.describe()}, but {world} rank(s) "
                              "run it", f"run it with {self.layout.world} ranks (--tp {m['tp']} launches them)")
        self.rank, self.world = rank, world
        self.coords = self.layout.coords(rank)
        join(self.layout)     # the mesh's groups, before any graph that names them is loaded
        tp_rank = self.coords["tp"]
        fixed = {name: torch.tensor([self.coords[axis]]) for name, axis in RANK_INPUTS.items()}
        other = _weights_bundle(weights_from, m, verify_all) if weights_from is not None else None
        self.weights_id = other[1]["id"] if other else None    # the bundle whose weights run, if not this one
        # What a family's host program reads beside the graphs (qic.runtime.programs: the manifest's family
        # names it); a family that has no tokenizer, resolutions or scheduler records none.
        same = code_from if code_from is not None and code_from.id == m["id"] else None   # loaded: its code, tokenizer
        self.tokenizer = None
        if same is not None:
            # The same bundle's tokenizer object, not a new one: besides the load, `tokenizers` keeps each BPE
            # model's word cache in a thread-local table that outlives the model (0.23: ~2-6 KB per tokenizer
            # loaded and used), so a server mapping weight sets all day must not load one per map.
            self.tokenizer = same.tokenizer
        elif m.get("tokenizer"):
            self.tokenizer = load_tokenizer(self.path / m["tokenizer"])
        self.resolutions = [tuple(r) for r in m.get("resolutions", [])]
        self.buckets = list(m.get("text_buckets", []))
        self.latents = m.get("latents")
        self.scheduler = m.get("scheduler")
        self.defaults = m.get("defaults", {})         # run defaults of the build config (steps, guidance)
        self.prompt = m.get("prompt")
        self.step_cache = m.get("step_cache")         # {first, last}: the split step graphs are in (or None)
        self.lockstep = lockstep(m["backend"]["backend"], self.device)
        shards: dict[str, dict[str, torch.Tensor]] = {}
        self.lora_slots = m.get("lora_slots", 0)      # per-request adapters' total rank (qic/runtime/lora.py)
        self._zeros: dict[tuple, torch.Tensor] = {}
        self.graphs: dict[tuple, Graph] = {}
        for g in m["graphs"]:
            constants = {}
            # Tensor-parallel components have one weight file per rank; replicated ones have one in all.
            rel = g["weights"][tp_rank] if len(g["weights"]) > 1 else g["weights"][0]
            if rel not in shards:
                shards[rel] = mmap_safetensors(self.path / rel)
                if other is not None:
                    shards[rel] = _swap_weights(shards[rel], other, g["component"], tp_rank)
            constants.update({g["weight_prefix"] + k: v for k, v in shards[rel].items()})
            if g["constants_file"]:
                constants.update(mmap_safetensors(self.path / g["constants_file"]))
            constants.update(self._empty_slots(g.get("lora_slots") or {}))
            missing = [n for n in g["weight_inputs"] if n not in constants]
            if missing:
                raise BundleError(f"{self.path}: graph {g['name']} needs tensors its weights lack: {missing[:3]}")
            weights = [constants[n] for n in g["weight_inputs"]]
            key = _key(g["component"], g["name"])
            loaded = same.graphs.get(key) if same is not None else None
            if loaded is not None and loaded.rebind is not None:
                run = loaded.rebind(weights)
            else:
                run = load_graph(m, self.path / g["file"], weights, self.device, rank=rank, world=world)
            self.graphs[key] = Graph(g["name"], run, g["inputs"],
                                     fixed={i["name"]: fixed[i["name"]] for i in g["inputs"] if i["name"] in fixed},
                                     rebind=getattr(run, "rebind", None),
                                     weights=dict(zip(g["weight_inputs"], weights)),
                                     lora_slots=g.get("lora_slots") or {})
        self.load_seconds = time.perf_counter() - t0
        Bundle.seconds_loading += self.load_seconds

    def _empty_slots(self, slots: dict) -> dict[str, torch.Tensor]:
        """A graph's LoRA slot inputs at zero, the identity: a request without adapters runs the base model. Graphs
        of one batch size share them."""
        out = {}
        for name, e in slots.items():
            key = (name, tuple(e["shape"]), e["dtype"])
            if key not in self._zeros:
                self._zeros[key] = torch.zeros(e["shape"], dtype=DTYPES[e["dtype"]])
            out[name] = self._zeros[key]
        return out

    @property
    def id(self) -> str:
        return self.manifest["id"]

    def graph(self, component: str, resolution=None, bucket=None, cfg: bool = True, batch: int = 1,
              part: str | None = None, rows: int | None = None) -> Graph:
        name = graph_name(component, resolution, bucket, cfg, batch, part, rows)
        try:
            return self.graphs[_key(component, name)]
        except KeyError:
            raise BundleError(f"{self.path}: no graph {name} in this bundle") from None

    def has_graph(self, component: str, resolution=None, bucket=None, cfg: bool = True, batch: int = 1,
                  part: str | None = None, rows: int | None = None) -> bool:
        return _key(component, graph_name(component, resolution, bucket, cfg, batch, part, rows)) in self.graphs

    def check_resolution(self, height: int, width: int) -> None:
        refuse_unlisted(height, width, self.resolutions, "bundle")


def _weights_bundle(path, manifest: dict, verify_all: bool) -> tuple[Path, dict]:
    """The other bundle, verified like this one (its weights by remembered hashes too: 58 GB each start
    otherwise), with the same TP degree."""
    path = Path(path)
    other = read_manifest(path)
    check_compatible(other, __version__, torch.__version__)
    verify_files(path, other, cache=VerificationCache(), full=verify_all)
    if other["tp"] != manifest["tp"]:
        raise BundleError(f"--weights {path}: built for tp={other['tp']}, this bundle for tp={manifest['tp']}")
    return path, other


def _swap_weights(mine: dict, other: tuple[Path, dict], component: str, rank: int) -> dict:
    path, m = other
    files = next((g["weights"] for g in m["graphs"] if g["component"] == component), None)
    if files is None:
        raise BundleError(f"--weights {path}: that bundle has no {component} weights",
                          "build it with the same --components")
    theirs = mmap_safetensors(path / (files[rank] if len(files) > 1 else files[0]))
    for name, t in mine.items():
        o = theirs.get(name)
        if o is None or o.shape != t.shape or o.dtype != t.dtype:
            got = "missing" if o is None else f"{list(o.shape)} {o.dtype}"
            raise BundleError(f"--weights {path}: graph signatures differ: {component} tensor {name} is {got} there, "
                              f"the graphs take {list(t.shape)} {t.dtype}",
                              "use a bundle of the same architecture, dtype and layers (looped/unrolled)")
    extra = sorted(set(theirs) - set(mine))
    if extra:
        raise BundleError(f"--weights {path}: graph signatures differ: {component} tensor {extra[0]} is not an "
                          "input of these graphs")
    return theirs


def _key(component: str, name: str) -> tuple:
    return (component, name)
