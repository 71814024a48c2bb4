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
from qic.build.lora import load_lora
from qic.build.remote import open_remote
from qic.build.shard import shard_component
from qic.build.source import resolve_model
from qic.build.store import warn
from qic.errors import ConfigError
from qic.fsutil import sweep_stale
from qic.graph_names import graph_name
from qic.host.latents import check_resolution
from qic.host.prompt import DROP_TOKENS, TEMPLATE
from qic.host.schedule import check_scheduler_config, merge_scheduler
from qic.spec import BuildSpec
from qic.tokenizer import load_tokenizer
from qic.weights import mmap_safetensors

# Which checkpoint configs each component's graphs depend on (the denoiser step packs latents by the VAE's scale).
_CONFIG_DEPS = {"text_encoder": ("text_encoder",), "denoiser": ("transformer", "vae"), "vae_decoder": ("vae",)}
# Config entries that say which tool wrote a file, not what the graph computes: a checkpoint variant saved by
# another diffusers/transformers (Qwen-Image-2512 vs Qwen-Image) keeps the spec key, so it exports nothing.
_PROVENANCE_KEYS = ("_diffusers_version", "_name_or_path", "transformers_version", "_commit_hash")


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
    warnings: list[str] = field(default_factory=list)   # one line each, printed after the table

    @property
    def hits(self) -> int:
        return sum(r.cached for r in self.rows)


class Context:
    """What validation derived, shared by the stages.

    configs_only: the checkpoint may hold configs (and a tokenizer) without weights, as `qic warm`
    compiles from; weights are then stood in by tensors of the right shapes (see graph_module).
    """

    def __init__(self, spec: BuildSpec, progress, configs_only: bool = False):
        self.spec, self.progress, self.configs_only = spec, progress, configs_only
        self.cache = Path(spec.cache_dir)
        self.output = Path(spec.output)
        self.ckpt = resolve_model(spec.model, self.cache, configs_only=configs_only)
        self.raw = {f: self.ckpt.config(f) for f in ("text_encoder", "transformer", "vae")}
        self.scheduler = merge_scheduler(self.ckpt.config("scheduler"), dict(spec.scheduler))
        self.configs = {name: c.parse_config(self.raw[c.folder]) for name, c in COMPONENTS.items()}
        has_tokenizer = self.ckpt.tokenizer_dir.is_dir()
        self.tokenizer = load_tokenizer(self.ckpt.tokenizer_dir) if has_tokenizer or not configs_only else None
        self.loras = ()    # checked by validate()


def validate(spec: BuildSpec, ctx: Context) -> None:
    """Every error a build can know of before it writes anything."""
    check_scheduler_config(ctx.scheduler)
    vae = ctx.configs["vae_decoder"]
    for h, w in spec.resolutions:
        check_resolution(h, w, vae.scale_factor)
    if ctx.tokenizer is not None:
        template_len = len(ctx.tokenizer.encode(TEMPLATE.format("")).ids)
        what = f"the prompt template ({template_len} tokens with an empty prompt)"
    else:
        # Configs without a tokenizer (e.g. the published Qwen-Image configs): the template's length is
        # unknown, but the encoder output drops its first DROP_TOKENS, so a bucket must exceed that for
        # the denoiser's graphs to exist at all. The build with the tokenizer checks the exact bound.
        template_len, what = DROP_TOKENS, f"the {DROP_TOKENS} template tokens the denoiser drops"
        if any(spec.text_buckets):
            warn(f"{ctx.ckpt.root}: no tokenizer, so text buckets are checked only against the {DROP_TOKENS} "
                 "dropped template tokens, not the template's full length (a build with the tokenizer checks it)")
    for b in spec.text_buckets:
        if b and b <= template_len:
            raise ConfigError(f"text bucket {b} is too small for {what}; use buckets > {template_len}")
    for name in spec.components:
        expected_tensors(COMPONENTS[name], ctx.configs[name], tp_of(name, spec.tp))  # raises naming head counts
    if spec.loras:
        if "denoiser" not in spec.components:
            raise ConfigError("LoRAs are merged into the denoiser, which this build leaves out",
                              "add denoiser to --components, or drop --lora")
        weights = ctx.ckpt.weights(COMPONENTS["denoiser"].folder).tensors
        ctx.loras = tuple(load_lora(path, scale, weights) for path, scale in spec.loras)


def _looped(spec: BuildSpec, component: str) -> bool:
    return spec.layers_of(component) == "looped" and COMPONENTS[component].stackable


def tp_of(component: str, tp: int) -> int:
    """Replicated components (no plan entries, e.g. the VAE decoder) are sharded and compiled once."""
    return tp if plans.PLANS[component] else 1


def build(spec: BuildSpec, progress=None, on_plan=None) -> BuildReport:
    """on_plan(MemoryPlan), if given, is called once the spec is validated, before any work (qic.build.memplan)."""
    t0 = time.perf_counter()
    options = ({"compiler_args": dict(spec.compiler_args), "lnc": spec.lnc, "xla_check": spec.xla_check}
               if spec.backend == "neuron" else {})
    backend = get_backend(spec.backend, spec.device, **options)
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
                              ctx.cache, _tick(progress, "shard", name), looped=_looped(spec, name),
                              loras=ctx.loras if name == "denoiser" else ())
        shards[name] = res
        report.rows.append(Row("shard", name, res.cached, res.bytes, time.perf_counter() - t))

    # Stage 2: one graph per bucket / resolution, through the compile cache.
    artifacts = []
    remote = open_remote(spec.cache_from, spec.cache_public_keys, spec.cache_trusted)
    for job in plan_jobs(spec, ctx, backend):
        if progress:
            progress("compile", job.name, None)
        art = compile_job(job, ctx, backend, weights_path=shards[job.component].files[0], remote=remote)
        artifacts.append(art)
        report.rows.append(Row("compile", art.meta["graph"], art.cached,
                               sum(f["bytes"] for f in art.meta["files"].values()), art.seconds))

    if spec.backend == "neuron":
        artifacts = neff_stage(backend, artifacts, ctx.cache, report, progress)

    # Stage 3: the bundle.
    build_key = _build_key(spec, digest, shards, artifacts)
    t = time.perf_counter()
    written = write_bundle(ctx, spec, backend, digest, shards, artifacts, build_key)
    report.up_to_date = not written
    report.rows.append(Row("bundle", str(ctx.output), not written, _tree_bytes(ctx.output), time.perf_counter() - t))
    report.seconds = time.perf_counter() - t0
    return report


def neff_stage(backend, artifacts, cache: Path, report: BuildReport, progress) -> list:
    """NEFFs for the lowered graphs, compiled in parallel processes where neuronx-cc is installed; without
    it, one warning line and the artifacts unchanged (the bundle is then marked lower-only)."""
    import dataclasses

    from qic.backends import neuron_cc
    from qic.backends.neuron import HLO_FILE
    if backend.compiler is None:
        checked = "lowered and checked on XLA:CPU" if backend.xla_check else "lowered, not checked (xla_check: false)"
        report.warnings.append(f"no NEFFs: {backend.compiler_missing}; the bundle is lower-only (every graph "
                               f"{checked}); the same build on a Trainium host compiles it")
        return artifacts
    # Each NEFF lives under its own cache key (HLO digest, compiler version, canonical flags), so a
    # compiler upgrade or new flags never overwrite a NEFF another build uses.
    jobs, hits = [], []
    for art in artifacts:
        flags = tuple(backend.flags(art.meta["component"]))
        key = neuron_cc.cache_key(art.meta["files"][HLO_FILE]["sha256"], backend.compiler_version, flags)
        jobs.append(neuron_cc.CompileJob(art.directory / HLO_FILE, cache / "neffs" / key, flags))
        hits.append(neuron_cc.cached(jobs[-1].out_dir, key))
    if progress:
        progress("neff", f"{len(jobs) - sum(hits)} graphs", None)
    t = time.perf_counter()
    neffs = neuron_cc.compile_many(jobs, compiler=backend.compiler)
    out = []
    for art, job, neff, hit in zip(artifacts, jobs, neffs, hits):
        meta = {**art.meta, "neff": {"path": str(neff), "sha256": stage2.sha256_file(neff),
                                     "bytes": neff.stat().st_size, "flags": list(job.args),
                                     "compiler": backend.compiler_version}}
        out.append(dataclasses.replace(art, meta=meta))
        report.rows.append(Row("neff", art.meta["graph"], hit, neff.stat().st_size, time.perf_counter() - t))
    return out

@dataclass
class GraphJob:
    """One graph to compile: what it is, and its spec key (computable without exporting anything)."""
    component: str
    name: str
    shape: dict
    spec_key: str
    maker: object          # maker(bound module) -> GraphDef
    job_id: str            # the spec key without this machine's identity: the same on every warm worker


def plan_jobs(spec: BuildSpec, ctx: Context, backend) -> list[GraphJob]:
    """Every graph the spec asks for, with its spec key: the plan `qic build` and `qic warm` share."""
    code = stage2.code_digest()
    identity = backend.identity()
    jobs = []
    for comp_name, maker, shape in plan_graphs(spec, ctx):
        configs = {f: {k: v for k, v in ctx.raw[f].items() if k not in _PROVENANCE_KEYS}
                   for f in _CONFIG_DEPS[comp_name]}
        dtype = COMPONENTS[comp_name].fixed_dtype or spec.dtype_of(comp_name)
        name = _graph_name(comp_name, shape)
        shape_key = {**shape, "looped": _looped(spec, comp_name)}
        tp = tp_of(comp_name, spec.tp)
        skey = stage2.spec_key(name, shape_key, dtype, tp, configs, identity, code)
        job_id = stage2.spec_key(name, shape_key, dtype, tp, configs, {"backend": spec.backend,
                                                                       "device": spec.device}, "")
        jobs.append(GraphJob(comp_name, name, shape, skey, maker, job_id))
    return jobs


def compile_job(job: GraphJob, ctx: Context, backend, weights_path: Path | None = None, remote=None,
                sign=None) -> stage2.GraphArtifact:
    """Compile (or find) one job's graph, its weights bound from a shard file, or stood in by shapes
    when `weights_path` is None (graphs take weights as inputs, so their values never matter)."""
    names = _header_names(weights_path) if weights_path else list(_shard_shapes(ctx, job.component))
    return stage2.compile_graph(lambda: job.maker(_bound_module(ctx, job.component, weights_path)),
                                backend, set(names), ctx.cache, job.spec_key, remote=remote, sign=sign)


def graph_shapes(spec: BuildSpec) -> list[tuple[str, dict]]:
    """(component, shape) for every graph the spec asks for, in build order."""
    # Batch 1 and the CFG graph have no "batch" / "cfg" entry: their names and spec keys predate them.
    batches = [{} if n == 1 else {"batch": n} for n in spec.batch_sizes]
    out = [("text_encoder", {"bucket": b} | n)
           for n in batches for b in spec.text_buckets if "text_encoder" in spec.components]
    if "denoiser" in spec.components:
        out += [("denoiser", {"resolution": [h, w], "bucket": b} | ({} if guided else {"cfg": False}) | n)
                for n in batches for h, w in spec.resolutions for b in spec.text_buckets for guided in spec.cfg]
    if "vae_decoder" in spec.components:
        out += [("vae_decoder", {"resolution": [h, w]} | n) for n in batches for h, w in spec.resolutions]
    return out


def make_graph(component: str, module, configs: dict, shape: dict, dtype: str):
    """The GraphDef of one graph around a component module (weights bound, or fake for estimates)."""
    batch = shape.get("batch", 1)
    if component == "text_encoder":
        return text_encoder_graph(module, shape["bucket"], batch)
    if component == "denoiser":
        h, w = shape["resolution"]
        return denoiser_graph(module, configs["denoiser"], configs["vae_decoder"].scale_factor, h, w,
                              shape["bucket"], dtype, cfg=shape.get("cfg", True), batch=batch)
    return vae_decoder_graph(module, *shape["resolution"], batch)


def plan_graphs(spec: BuildSpec, ctx: Context):
    """(component, maker(module) -> GraphDef, shape) for every graph the spec asks for."""
    return [(name, lambda m, n=name, s=shape: make_graph(n, m, ctx.configs, s, spec.dtype_of(n)), shape)
            for name, shape in graph_shapes(spec)]


def _graph_name(component: str, shape: dict) -> str:
    return graph_name(component, shape.get("resolution"), shape.get("bucket"), shape.get("cfg", True),
                      shape.get("batch", 1))


def _shard_shapes(ctx: Context, component: str) -> dict[str, tuple[int, ...]]:
    """Names and shapes of one rank's weight shard: exactly the module's state dict (loaded strictly)."""
    return expected_tensors(COMPONENTS[component], ctx.configs[component], tp_of(component, ctx.spec.tp),
                            looped=_looped(ctx.spec, component))


def _bound_module(ctx: Context, component: str, weights_path: Path | None) -> torch.nn.Module:
    """The eager module with memory-mapped shard tensors assigned (no copy, nothing touched), or with
    uninitialised stand-ins of the shard's shapes and dtype when there are no weights (torch.empty
    only reserves address space until written, and compiling never reads weight values)."""
    comp = COMPONENTS[component]
    tp = tp_of(component, ctx.spec.tp)
    dtype = TORCH_DTYPES[comp.fixed_dtype or ctx.spec.dtype_of(component)]
    with torch.device("meta"):
        module = comp.make_module(ctx.configs[component], tp_size=tp, looped=_looped(ctx.spec, component))
    if weights_path is not None:
        tensors = mmap_safetensors(weights_path)
    else:  # shards hold every tensor in the component's dtype (stage 1)
        tensors = {n: torch.empty(shape, dtype=dtype) for n, shape in _shard_shapes(ctx, component).items()}
    module.load_state_dict(tensors, strict=True, assign=True)
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
        if dist.get_world_size() != tp and dist.get_backend() == "fake":
            dist.destroy_process_group()  # our own tracing group for another TP degree (a warm matrix)
        elif dist.get_world_size() != tp:
            raise ConfigError(f"a process group of {dist.get_world_size()} ranks is active; building tp={tp} "
                              "needs none (build from a plain process)")
        else:
            return
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)


def _header_names(path: Path) -> list[str]:
    from qic.checkpoint.safetensors_file import read_header
    return list(read_header(path).tensors)


def _build_key(spec, digest, shards, artifacts) -> str:
    where = ("output", "cache_dir", "cache_from", "cache_public_keys", "cache_trusted")  # not what is built
    body = {"spec": {k: v for k, v in spec.to_json().items() if k not in where},
            "checkpoint": digest, "shards": {k: v.key for k, v in shards.items()},
            "graphs": [a.graph_key for a in artifacts], "qic": __version__, "torch": torch.__version__,
            "neffs": [a.meta.get("neff", {}).get("sha256") for a in artifacts]}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def _tick(progress, stage, item):
    if progress is None:
        return None
    return lambda nbytes: progress(stage, item, nbytes)


