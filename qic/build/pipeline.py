"""`qic build`: validate everything first, then shard (stage 1), compile (stage 2), bundle (stage 3)."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from qic import __version__
from qic.backends import get_backend
from qic.build import compile as stage2
from qic.build import plans
from qic.build.bundle import write_bundle
from qic.build.components import COMPONENTS, expected_tensors
from qic.build.graphs import TORCH_DTYPES, denoiser_graph, text_encoder_graph, vae_decoder_graph
from qic.build.shard import shard_component
from qic.build.source import resolve_model
from qic.errors import ConfigError
from qic.fsutil import sweep_stale
from qic.host.latents import check_resolution
from qic.host.prompt import TEMPLATE
from qic.host.schedule import check_scheduler_config
from qic.spec import BuildSpec
from qic.tokenizer import load_tokenizer
from qic.weights import mmap_safetensors

# Which checkpoint configs each component's graphs depend on (the denoiser step packs latents by the VAE's scale).
_CONFIG_DEPS = {"text_encoder": ("text_encoder",), "denoiser": ("transformer", "vae"), "vae_decoder": ("vae",)}


@dataclass
class Row:
    stage: str
    item: str
    cached: bool
    bytes: int
    seconds: float


@dataclass
class BuildReport:
    output: Path
    rows: list[Row] = field(default_factory=list)
    up_to_date: bool = False
    seconds: float = 0.0

    @property
    def hits(self) -> int:
        return sum(r.cached for r in self.rows)


class Context:
    """What validation derived, shared by the stages."""

    def __init__(self, spec: BuildSpec, progress):
        self.spec, self.progress = spec, progress
        self.cache = Path(spec.cache_dir)
        self.output = Path(spec.output)
        self.ckpt = resolve_model(spec.model, self.cache)
        self.raw = {f: self.ckpt.config(f) for f in ("text_encoder", "transformer", "vae")}
        self.scheduler = self.ckpt.config("scheduler")
        self.configs = {name: c.parse_config(self.raw[c.folder]) for name, c in COMPONENTS.items()}
        self.tokenizer = load_tokenizer(self.ckpt.tokenizer_dir)


def validate(spec: BuildSpec, ctx: Context) -> None:
    """Every error a build can know of before it writes anything."""
    check_scheduler_config(ctx.scheduler)
    vae = ctx.configs["vae_decoder"]
    for h, w in spec.resolutions:
        check_resolution(h, w, vae.scale_factor)
    template_len = len(ctx.tokenizer.encode(TEMPLATE.format("")).ids)
    for b in spec.text_buckets:
        if b and b <= template_len:
            raise ConfigError(f"text bucket {b} is too small for the prompt template ({template_len} tokens "
                              f"with an empty prompt); use buckets > {template_len}")
    for name in spec.components:
        expected_tensors(COMPONENTS[name], ctx.configs[name], tp_of(name, spec.tp))  # raises naming head counts


def _looped(spec: BuildSpec, component: str) -> bool:
    return spec.layers_of(component) == "looped" and COMPONENTS[component].stackable


def tp_of(component: str, tp: int) -> int:
    """Replicated components (no plan entries, e.g. the VAE decoder) are sharded and compiled once."""
    return tp if plans.PLANS[component] else 1


def build(spec: BuildSpec, progress=None, on_plan=None) -> BuildReport:
    """on_plan(MemoryPlan), if given, is called once the spec is validated, before any work (qic.build.memplan)."""
    t0 = time.perf_counter()
    backend = get_backend(spec.backend, spec.device)
    ctx = Context(spec, progress)
    validate(spec, ctx)
    if on_plan is not None:
        from qic.build.memplan import plan_memory
        on_plan(plan_memory(spec, ctx.configs, ctx.raw, ctx.cache))
    report = BuildReport(ctx.output)
    sweep_stale(ctx.cache / "shards")
    sweep_stale(ctx.cache / "graphs")
    digest = ctx.ckpt.digest(full=spec.full_hash)

    # Stage 1: per-rank weight shards.
    shards = {}
    for name in spec.components:
        comp = COMPONENTS[name]
        t = time.perf_counter()
        res = shard_component(ctx.ckpt, comp, ctx.configs[name], digest, tp_of(name, spec.tp), spec.dtype_of(name),
                              ctx.cache, _tick(progress, "shard", name), looped=_looped(spec, name))
        shards[name] = res
        report.rows.append(Row("shard", name, res.cached, res.bytes, time.perf_counter() - t))

    # Stage 2: one graph per bucket / resolution, through the compile cache.
    code = stage2.code_digest()
    identity = backend.identity()
    artifacts = []
    for gspec in plan_graphs(spec, ctx):
        comp_name, maker, shape = gspec
        configs = {f: ctx.raw[f] for f in _CONFIG_DEPS[comp_name]}
        dtype = COMPONENTS[comp_name].fixed_dtype or spec.dtype_of(comp_name)
        skey = stage2.spec_key(_graph_name(comp_name, shape), {**shape, "looped": _looped(spec, comp_name)}, dtype,
                               tp_of(comp_name, spec.tp), configs, identity, code)
        weights_path = shards[comp_name].files[0]
        weight_names = set(_header_names(weights_path))
        if progress:
            progress("compile", _graph_name(comp_name, shape), None)
        art = stage2.compile_graph(lambda m=maker, p=weights_path, c=comp_name: m(_bound_module(ctx, c, p)),
                                   backend, weight_names, ctx.cache, skey)
        artifacts.append(art)
        report.rows.append(Row("compile", art.meta["graph"], art.cached,
                               sum(f["bytes"] for f in art.meta["files"].values()), art.seconds))

    # Stage 3: the bundle.
    build_key = _build_key(spec, digest, shards, artifacts)
    t = time.perf_counter()
    written = write_bundle(ctx, spec, backend, digest, shards, artifacts, build_key)
    report.up_to_date = not written
    report.rows.append(Row("bundle", str(ctx.output), not written, _tree_bytes(ctx.output), time.perf_counter() - t))
    report.seconds = time.perf_counter() - t0
    return report


def graph_shapes(spec: BuildSpec) -> list[tuple[str, dict]]:
    """(component, shape) for every graph the spec asks for, in build order."""
    out = [("text_encoder", {"bucket": b}) for b in spec.text_buckets if "text_encoder" in spec.components]
    if "denoiser" in spec.components:
        out += [("denoiser", {"resolution": [h, w], "bucket": b})
                for h, w in spec.resolutions for b in spec.text_buckets]
    if "vae_decoder" in spec.components:
        out += [("vae_decoder", {"resolution": [h, w]}) for h, w in spec.resolutions]
    return out


def make_graph(component: str, module, configs: dict, shape: dict, dtype: str):
    """The GraphDef of one graph around a component module (weights bound, or fake for estimates)."""
    if component == "text_encoder":
        return text_encoder_graph(module, shape["bucket"])
    if component == "denoiser":
        h, w = shape["resolution"]
        return denoiser_graph(module, configs["denoiser"], configs["vae_decoder"].scale_factor, h, w,
                              shape["bucket"], dtype)
    return vae_decoder_graph(module, *shape["resolution"])


def plan_graphs(spec: BuildSpec, ctx: Context):
    """(component, maker(module) -> GraphDef, shape) for every graph the spec asks for."""
    return [(name, lambda m, n=name, s=shape: make_graph(n, m, ctx.configs, s, spec.dtype_of(n)), shape)
            for name, shape in graph_shapes(spec)]


def _graph_name(component: str, shape: dict) -> str:
    parts = [component]
    if "resolution" in shape:
        parts.append("{}x{}".format(*shape["resolution"]))
    if "bucket" in shape:
        parts.append(f"L{shape['bucket'] or 'exact'}")
    return "@".join(parts)


def _bound_module(ctx: Context, component: str, weights_path: Path) -> torch.nn.Module:
    """The eager module with memory-mapped shard tensors assigned (no copy, nothing touched)."""
    comp = COMPONENTS[component]
    tp = tp_of(component, ctx.spec.tp)
    with torch.device("meta"):
        module = comp.make_module(ctx.configs[component], tp_size=tp, looped=_looped(ctx.spec, component))
    module.load_state_dict(mmap_safetensors(weights_path), strict=True, assign=True)
    dtype = TORCH_DTYPES[comp.fixed_dtype or ctx.spec.dtype_of(component)]
    module = module.to(dtype)
    if tp > 1:
        # The all-reduces enter the graph by the world group's name; at run time each rank's gloo/NCCL
        # world group has that name. Tracing needs a group of the right size: a fake one, no peers.
        from qic.parallel.tp import apply_tp
        _fake_world(tp)
        apply_tp(module)
    return module


def _fake_world(tp: int) -> None:
    import torch.distributed as dist
    if dist.is_initialized():
        if dist.get_world_size() != tp:
            raise ConfigError(f"a process group of {dist.get_world_size()} ranks is active; building tp={tp} "
                              "needs none (build from a plain process)")
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)


def _header_names(path: Path) -> list[str]:
    from qic.checkpoint.safetensors_file import read_header
    return list(read_header(path).tensors)


def _build_key(spec, digest, shards, artifacts) -> str:
    body = {"spec": {k: v for k, v in spec.to_json().items() if k not in ("output", "cache_dir")},
            "checkpoint": digest, "shards": {k: v.key for k, v in shards.items()},
            "graphs": [a.graph_key for a in artifacts], "qic": __version__, "torch": torch.__version__}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def _tick(progress, stage, item):
    if progress is None:
        return None
    return lambda nbytes: progress(stage, item, nbytes)


