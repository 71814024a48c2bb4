"""`qic plan`: what a build will need, from the checkpoint's configs alone (no weights read).

Per component and per rank: weight bytes (exact: the TP plan's shard shapes, as stage 1 writes them).
Per graph: the largest activation and the peak memory of running it, estimated by executing the graph's
module on fake tensors (shapes only, no data, no memory) while counting the bytes of live tensors.
Disk: the stage-1 shards and the compiled artifacts. Compile: the number of graphs and an estimated
time from the compile cache's own records.

What "peak" means here: the most memory a process holds while it runs one graph eagerly (PyTorch
ops, no compiler) with the component's weights resident: weight bytes + graph inputs + the high-water
mark of tensors alive at once (a tensor counts from the op that creates it until its last reference
dies; views and in-place results share their base's memory and add nothing). It is measured the same
way as the resident-set growth of a process that materialises the weights and runs the graph
(`benchmarks.peak`; tests/test_memplan.py holds the estimate to 25% of that). A compiled graph fuses
ops and plans its buffers, so its activations are usually smaller; weights dominate at real scale.
The estimate runs the unrolled form with the fewest layers that give every block range of the graph a block:
one, or for a step-caching part first + last + 1, so that the middle has one (the looped form, like L unrolled
layers run eagerly, holds one layer's activations at a time). FLOPs per graph (one rank's, as
torch.utils.flop_counter counts them) are at the real depth: a graph's FLOPs are linear in the layer count
(identical blocks), so two runs, at n and n + 1 layers, give them at L exactly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import statistics
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from qic import backends, family
from qic.builder.context import looped, tp_of
from qic.builder.jobs import code_digest, config_deps, graph_shapes, make_graph, name_of, plan_jobs
from qic.builder.lora_slots import is_slot, with_slots
from qic.cache import layout
from qic.dtypes import TORCH_DTYPES
from qic.errors import QicError
from qic.fsutil import write_json_atomic
from qic.host.latents import check_resolution
from qic.host.prompt import DROP_TOKENS, MAX_PROMPT_TOKENS
from qic.models.common import GatherLinear, RowLinear, VocabEmbedding

# Without records in the cache: what one looped graph took inductor on the 2-core development host, from
# the compile records of its test and real-width caches: 10-26 s per graph (median about 20), whether the
# graph is tiny or 3072 wide, since compile time follows the number of ops, not their sizes. Unrolled
# graphs (looped: false) grow with depth; an earlier default of 60 s was about 3x high for looped ones.
DEFAULT_COMPILE_SECONDS = 20.0
# Without records: an AOTInductor package of one graph (weights are inputs, so it is code only).
DEFAULT_ARTIFACT_BYTES = 4 << 20


@dataclass
class GraphPlan:
    name: str
    component: str
    weight_bytes: int          # the component's weights on one rank
    input_bytes: int
    largest_activation: int
    activation_peak: int       # high-water mark of live intermediate tensors
    flops: int                 # one call's, on one rank, at the real depth
    compile_seconds: float     # 0 when the cache already holds it
    cached: bool
    artifact_bytes: int

    @property
    def peak(self) -> int:
        return self.weight_bytes + self.input_bytes + self.activation_peak


@dataclass
class ComponentPlan:
    name: str
    dtype: str
    ranks: int                 # 1 for a replicated component (one shard serves every rank)
    bytes_per_rank: int
    bytes_tp1: int


@dataclass
class MemoryPlan:
    tp: int
    components: list[ComponentPlan] = field(default_factory=list)
    graphs: list[GraphPlan] = field(default_factory=list)
    compile_source: str = ""
    layout: object = None
    # Per resolution (the longest text bucket, true CFG): one rank's FLOPs and collective bytes per step
    traffic: list = field(default_factory=list)
    # What a family's host program keeps resident between graph calls, per rank: [(what, bytes)] (the family's
    # components module's optional `resident_state(spec, configs)`; Qwen-Image-2.1's prefix K/V cache)
    resident: list = field(default_factory=list)

    @property
    def shard_disk(self) -> int:
        return sum(c.ranks * c.bytes_per_rank for c in self.components)

    @property
    def artifact_disk(self) -> int:
        return sum(g.artifact_bytes for g in self.graphs)

    @property
    def compile_seconds(self) -> float:
        return sum(g.compile_seconds for g in self.graphs)

    def compile_wall(self, workers: int) -> float:
        """About how long the uncached graphs take on `workers` compile workers (qic.builder.workers): each graph,
        the longest first, to the worker free soonest. The build takes them in its jobs' order instead; with
        graphs of similar times the two are close."""
        ends = [0.0] * max(1, workers)
        for seconds in sorted((g.compile_seconds for g in self.graphs if g.compile_seconds), reverse=True):
            ends[ends.index(min(ends))] += seconds
        return max(ends)

    @property
    def run_peak_per_rank(self) -> int:
        """`qic run` keeps every component resident: all weights of a rank, the host program's resident state, plus
        the largest graph's inputs and activations."""
        weights = sum(c.bytes_per_rank for c in self.components) + sum(n for _, n in self.resident)
        return weights + max((g.input_bytes + g.activation_peak for g in self.graphs), default=0)


# ------------------------------------------------------------------------------------------- estimate

class LiveBytes(TorchDispatchMode):
    """Counts the bytes of tensors created by ops while they are alive (fake tensors: no memory used)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = self.largest = 0

    def _free(self, n: int) -> None:
        self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            return out
        inputs = {id(a) for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and id(t) not in inputs:  # in-place ops return their input
                n = t.numel() * t.element_size()
                self.live += n
                self.peak, self.largest = max(self.peak, self.live), max(self.largest, n)
                weakref.finalize(t, self._free, n)
        return out


class _SimReduce:
    """Stand-in for the all_reduce during estimation: a new tensor of the same size, as the collective makes."""

    def __call__(self, x):
        return x.clone()


class _SimGather:
    """Stand-in for the all_gather during estimation: the whole [..., tp * n] output."""

    def __init__(self, tp: int):
        self.tp = tp

    def __call__(self, x):
        return x.repeat(*([1] * (x.dim() - 1)), self.tp)


def _simulated_tp(module: torch.nn.Module, tp: int) -> None:
    if tp == 1:
        return
    for m in module.modules():
        if isinstance(m, (RowLinear, VocabEmbedding)):
            m.reduce = _SimReduce()
        elif isinstance(m, GatherLinear):
            m.gather = _SimGather(tp)


def weight_bytes(component: str, config, tp: int, dtype: str, looped: bool = False) -> int:
    """One rank's weight bytes, from the module's shard shapes on the meta device."""
    comp = family.component(component)
    with torch.device("meta"):
        module = comp.make_module(config, tp_size=tp, looped=looped)
    item = TORCH_DTYPES[comp.run_dtype(dtype)].itemsize
    return sum(t.numel() * (t.element_size() if not t.is_floating_point() else item)
               for t in module.state_dict().values())


def estimate_graph(component: str, configs: dict, tp: int, dtype: str, shape: dict,
                   layout=None) -> tuple[int, int, int, int]:
    """(input bytes, LoRA slots included; largest activation, activation peak, FLOPs) of one graph, on fake tensors,
    the bytes and FLOPs at the real depth. Under a parallel
    layout the denoiser's step runs with its real collectives on a fake process group (Ulysses' shards)."""
    from qic.builder.binding import fake_world_for
    from qic.parallel.mesh import Layout
    layout = layout if layout is not None and family.component(component).runs_layout else Layout()
    config = configs[component]
    with fake_world_for(layout) if not layout.plain else contextlib.nullcontext():
        if not hasattr(config, "num_layers"):
            return _estimate(component, configs, tp, dtype, shape, layout)
        n = fewest_layers(shape)
        inputs, largest, peak, flops = _estimate(component, _at_depth(configs, component, n), tp, dtype, shape, layout)
        more = _estimate(component, _at_depth(configs, component, n + 1), tp, dtype, shape, layout)
    # Per-block inputs (LoRA slots) grow with depth as the FLOPs do; the others do not (the difference is 0).
    return (inputs + (config.num_layers - n) * (more[0] - inputs), largest, peak,
            flops + (config.num_layers - n) * (more[3] - flops))


def fewest_layers(shape: dict) -> int:
    """Layers run one after another and only their fixed-size carry outlives a layer, so the fewest layers
    that leave each of the graph's block ranges one block (a step-caching part's: first, the middle, last)
    have the same activation peak as L, at a fraction of the estimate's time. A part without block ranges (a
    prefill or decode graph, which runs every block) is one block."""
    return shape["first"] + shape["last"] + 1 if "first" in shape else 1


def _at_depth(configs: dict, component: str, layers: int) -> dict:
    return {**configs, component: dataclasses.replace(configs[component], num_layers=layers)}


def _estimate(component: str, configs: dict, tp: int, dtype: str, shape: dict, layout) -> tuple[int, int, int, int]:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    from qic.parallel.sequence import apply_layout
    comp = family.component(component)
    dtype = comp.run_dtype(dtype)
    default = torch.get_default_dtype()
    with FakeTensorMode(allow_non_fake_inputs=True):
        torch.set_default_dtype(TORCH_DTYPES[dtype])  # built in the dtype: .to() cannot swap fake parameters
        try:
            module = comp.make_module(configs[component], tp_size=tp).eval()
        finally:
            torch.set_default_dtype(default)
        if layout.plain:
            _simulated_tp(module, tp)
        with_slots(module, component, shape)   # LoRA slots: inputs beside the weights, counted as inputs
        slot_bytes = sum(p.numel() * p.element_size() for n, p in module.named_parameters() if is_slot(n))
        gdef = make_graph(component, module, configs, shape, dtype, layout)
        if not layout.plain:
            apply_layout(gdef.module, layout)
        args = [t for _, t in gdef.inputs]
        with torch.no_grad(), FlopCounterMode(display=False) as flops, LiveBytes() as live:
            out = gdef.module.eval()(*args)
            del out
    return (sum(t.numel() * t.element_size() for t in args) + slot_bytes, live.largest, live.peak,
            flops.get_total_flops())


# The functional collectives' ops, by the HLO opcode each lowers to (qic/backends/neuron/lower.py).
COLLECTIVE_OPS = {"all_reduce": "all-reduce", "all_gather_into_tensor": "all-gather", "all_to_all_single": "all-to-all"}


class CollectiveBytes(TorchDispatchMode):
    """Per collective kind, the bytes of its results (what each rank holds after it), as the lowered HLO
    counts them (qic.backends.neuron.hlo_proto.collective_bytes)."""

    def __init__(self):
        super().__init__()
        self.bytes = {op: 0 for op in COLLECTIVE_OPS.values()}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        kind = COLLECTIVE_OPS.get(func._schema.name.split("::")[-1]) if func.namespace == "_c10d_functional" else None
        if kind:
            self.bytes[kind] += out.numel() * out.element_size()
        return out


def step_traffic(configs: dict, layout, dtype: str, shape: dict) -> dict:
    """One rank's work in one denoise step under `layout`: FLOPs and the bytes each collective kind moves,
    from the step graph run on fake tensors with its real collectives (a fake process group of the layout's
    world). Blocks are identical, so the figures for L blocks are those of 1 block plus L - 1 times the
    difference between 2 blocks and 1: exact, at two blocks' cost."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    from qic.builder.binding import fake_world_for
    from qic.parallel.sequence import apply_layout
    layers = configs["denoiser"].num_layers

    def measure(n: int) -> dict:
        cfgs = {**configs, "denoiser": dataclasses.replace(configs["denoiser"], num_layers=n)}
        default = torch.get_default_dtype()
        with FakeTensorMode(allow_non_fake_inputs=True):
            torch.set_default_dtype(TORCH_DTYPES[dtype])
            try:
                module = family.component("denoiser").make_module(cfgs["denoiser"], tp_size=layout.tp).eval()
            finally:
                torch.set_default_dtype(default)
            gdef = make_graph("denoiser", module, cfgs, shape, dtype, layout)
            apply_layout(gdef.module, layout)
            counter = CollectiveBytes()
            with torch.no_grad(), FlopCounterMode(display=False) as flops, counter:
                gdef.module(*[t for _, t in gdef.inputs])
        return {"flops": flops.get_total_flops(), **counter.bytes}

    with fake_world_for(layout):
        one, two = measure(1), measure(2)
    return {k: one[k] + (layers - 1) * (two[k] - one[k]) for k in one}


def plan_memory(spec, configs: dict, raw: dict, cache_dir: Path | None = None, jobs: list | None = None) -> MemoryPlan:
    """The plan for a build spec, given parsed component configs (and the raw ones, for spec keys). `jobs`:
    the build's own planned jobs (qic.builder.jobs.plan_jobs), so a build keys its graphs once."""
    # The build's own check (Qwen-Image's, by its VAE's scale), so a bad size fails as it would there. The step
    # traffic below is Qwen-Image's denoiser's by name too: a family without those components plans without them.
    for h, w in spec.resolutions if "vae_decoder" in configs else ():
        check_resolution(h, w, configs["vae_decoder"].scale_factor)
    plan = MemoryPlan(spec.tp)
    records = _compile_records(Path(cache_dir) if cache_dir else None, spec.backend)
    # A back end whose graphs take far less than inductor's says so (qic/backends/<name>/__init__.py).
    default_seconds = getattr(backends.info(spec.backend), "PLAN_COMPILE_SECONDS", DEFAULT_COMPILE_SECONDS)
    plan.compile_source = (f"{sum(map(len, records.values()))} cached graph records" if records
                           else f"no cached records; {default_seconds:.0f} s per graph assumed")
    code = code_digest()

    def weights(name, tp, dtype, looped=False):   # building the looped module on meta imports sympy (seconds)
        return _memoised(cache_dir, memo_name("weights", code, component=name, config=repr(configs[name]), tp=tp,
                                              dtype=dtype, looped=looped),
                         "bytes", lambda: weight_bytes(name, configs[name], tp, dtype, looped))

    for name in spec.components:
        tp = tp_of(name, spec.tp)
        dtype = family.component(name).run_dtype(spec.dtype_of(name))
        plan.components.append(ComponentPlan(name, dtype, tp, weights(name, tp, dtype, looped(spec, name)),
                                             weights(name, 1, dtype)))
    per_rank = {c.name: c.bytes_per_rank for c in plan.components}
    keys = {j.name: j.spec_key for j in jobs} if jobs is not None else _spec_keys(spec, configs, raw)
    for name, shape in graph_shapes(spec):
        tp = tp_of(name, spec.tp)
        sized = estimated_shape(shape)
        gname = name_of(name, shape)
        comp = family.component(name)
        # Keyed by what the estimate reads, not by the graph's spec key: the same graph built by another back
        # end (export, inductor, neuron), with a LoRA merged or for another CPU target has the same figures.
        key = memo_name("estimate", code, component=name, shape=sized, tp=tp, dtype=comp.run_dtype(spec.dtype_of(name)),
                        layout=spec.layout.as_dict() if comp.runs_layout else None, configs=config_deps(name, raw))
        inputs, largest, peak, flops = tuple(_memoised(
            cache_dir, key, "estimate",
            lambda: list(estimate_graph(name, configs, tp, spec.dtype_of(name), sized, spec.layout))))
        cached = _is_cached(cache_dir, keys.get(gname))
        secs = [r["compile_seconds"] for r in records.get(name, [])]
        sizes = [r["bytes"] for r in records.get(name, [])]
        plan.graphs.append(GraphPlan(
            gname, name, per_rank[name], inputs, largest, peak, flops,
            0.0 if cached else (statistics.median(secs) if secs else default_seconds), cached,
            int(statistics.median(sizes)) if sizes else DEFAULT_ARTIFACT_BYTES))
    resident = getattr(family.components_module(), "resident_state", None)
    if resident is not None:
        plan.resident = list(resident(spec, configs))
    if "denoiser" in spec.components and True in spec.cfg:
        bucket = max(spec.text_buckets) or DROP_TOKENS + MAX_PROMPT_TOKENS
        plan.layout = spec.layout
        dtype = spec.dtype_of("denoiser")
        planned = [{k: v for k, v in s.items() if k != "lora_slots"} for n, s in graph_shapes(spec) if n == "denoiser"]
        for h, w in spec.resolutions:
            # only for a whole-step graph the family plans (Qwen-Image-2.1 has prefill and decode graphs instead)
            if {"resolution": [h, w], "bucket": max(spec.text_buckets)} not in planned:
                continue
            shape = {"resolution": [h, w], "bucket": bucket}
            # step_traffic reads every config (the step's and the VAE's scale), whole
            key = memo_name("traffic", code, shape=shape, dtype=dtype, layout=spec.layout.as_dict(),
                            configs={n: repr(c) for n, c in sorted(configs.items())})
            plan.traffic.append(((h, w), bucket, _memoised(
                cache_dir, key, "traffic", lambda shape=shape: step_traffic(configs, spec.layout, dtype, shape))))
    return plan


def estimated_shape(shape: dict) -> dict:
    """The shape a graph is estimated at: exact-length text (bucket 0) at the longest prompt it accepts."""
    return {**shape, "bucket": DROP_TOKENS + MAX_PROMPT_TOKENS} if shape.get("bucket") == 0 else shape


def memo_name(kind: str, code: str, **inputs) -> str:
    """The plan/ memo name of a figure computed from `inputs` (JSON; a parsed config by its dataclass repr,
    which names every field) by qic's graph-shaping code of digest `code` (_memoised adds the planner's)."""
    blob = json.dumps({"inputs": inputs, "code": code}, sort_keys=True)
    return f"{kind}-" + hashlib.sha256(blob.encode()).hexdigest()[:32]


def planner_digest() -> str:
    """What every memoised figure also depends on besides its key: this planner's code (LiveBytes, the
    one-layer shortcut) and torch's (fake tensors, FlopCounterMode), so an upgrade or an edit recomputes."""
    return hashlib.sha256(Path(__file__).read_bytes() + torch.__version__.encode()).hexdigest()[:32]


def _memoised(cache_dir: Path | None, name: str | None, field: str, compute):
    """compute()'s JSON value, kept in the cache as plan/<name>.json (`field`, with the planner digest it was
    computed under; another digest, or an unreadable file, is a miss). Without a name or a cache it is
    computed every time; nothing is written to a cache directory that does not exist yet."""
    path = layout.plan_file(cache_dir, name) if cache_dir is not None and name else None
    planner = planner_digest()
    if path is not None:
        try:
            record = json.loads(path.read_text())
            if record.get("planner") == planner:
                value = record[field]
                with contextlib.suppress(OSError):   # its last use, for `qic cache prune` (a read-only cache: none)
                    os.utime(path)
                return value
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass
    value = compute()
    if path is not None and Path(cache_dir).is_dir():
        with contextlib.suppress(OSError):   # a read-only cache: the figure is computed again next time
            path.parent.mkdir(exist_ok=True)
            write_json_atomic(path, {field: value, "planner": planner})
    return value


def _compile_records(cache_dir: Path | None, backend: str) -> dict[str, list[dict]]:
    """component -> [{compile_seconds, bytes}] from the compile cache's meta.json files of `backend`'s graphs (one
    cache holds every back end's, and an export graph's seconds say nothing of an inductor compile)."""
    out: dict[str, list[dict]] = {}
    if cache_dir is None:
        return out
    for meta_path in sorted(layout.graphs_dir(cache_dir).glob("*/meta.json")):
        try:
            meta = json.loads(meta_path.read_text())
            if meta["backend"]["backend"] != backend:
                continue
            out.setdefault(meta["component"], []).append(
                {"compile_seconds": float(meta["compile_seconds"]),
                 "bytes": sum(int(f["bytes"]) for f in meta["files"].values())})
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a damaged or foreign entry is no record
    return out


def _spec_keys(spec, configs: dict, raw: dict) -> dict[str, str]:
    """graph name -> the spec key the build memoises it under: the build's own plan (empty when the back end
    is unavailable here, e.g. neuron without torch-xla: the plan then shows nothing as cached)."""
    from qic.backends import backend_for
    try:
        backend = backend_for(spec)
    except QicError:
        return {}
    return {job.name: job.spec_key for job in plan_jobs(spec, configs, raw, backend)}


def _is_cached(cache_dir: Path | None, skey: str | None) -> bool:
    if cache_dir is None or skey is None:
        return False
    gkey = layout.read_memo(cache_dir, skey)
    return gkey is not None and (layout.graph_dir(cache_dir, gkey) / "meta.json").is_file()
