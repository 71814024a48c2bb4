"""`qic build`: the stage order, and nothing else. Validate everything first (qic.builder.context), then
shard (stage 1, qic.builder.shard), compile (stage 2, qic.builder.compile, for every graph qic.builder.jobs
plans), the back end's finish step (e.g. NEFFs), then the bundle (stage 3, qic.builder.bundle)."""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from qic import __version__, family
from qic.backends import backend_for
from qic.builder.binding import compile_job
from qic.builder.bundle import write_bundle
from qic.builder.context import Context, looped, tp_of, validate
from qic.builder.jobs import plan_jobs
from qic.builder.memplan import plan_memory
from qic.builder.shard import shard_component
from qic.builder.workers import CompileWorkers, plan_workers
from qic.cache import layout
from qic.cache.remote import open_remote
from qic.fsutil import sweep_stale
from qic.manifest import FORMAT_VERSION
from qic.spec import BuildSpec


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
    compile_workers: int = 0   # worker processes that compiled graphs (qic.builder.workers); 0: none did

    @property
    def hits(self) -> int:
        return sum(r.cached for r in self.rows)


def build(spec: BuildSpec, progress=None, on_plan=None, compile_jobs: int | None = None) -> BuildReport:
    """on_plan(MemoryPlan), if given, is called once the spec is validated, before any work (qic.builder.memplan);
    `compile_jobs`: --jobs, graphs compiled side by side (qic.builder.workers.plan_workers decides)."""
    t0 = time.perf_counter()
    backend = backend_for(spec)
    ctx = Context(spec, progress)
    validate(spec, ctx)
    jobs = plan_jobs(spec, ctx.configs, ctx.raw, backend)
    if on_plan is not None:
        # The build fills the cache anyway: made now, so that the plan's figures are memoised from the first
        # build on (memplan writes into no cache directory that does not exist yet)
        ctx.cache.mkdir(parents=True, exist_ok=True)
        on_plan(plan_memory(spec, ctx.configs, ctx.raw, ctx.cache, jobs))
    report = BuildReport(ctx.output)
    sweep_stale(layout.shards_dir(ctx.cache))
    sweep_stale(layout.graphs_dir(ctx.cache))
    digest = ctx.ckpt.digest(full=spec.full_hash)

    # Stage 1: per-rank weight shards.
    shards = {}
    for name in spec.components:
        comp = family.component(name)
        t = time.perf_counter()
        res = shard_component(ctx.ckpt, comp, ctx.configs[name], digest, tp_of(name, spec.tp), spec.dtype_of(name),
                              ctx.cache, stage_progress(progress, "shard", name), looped=looped(spec, name),
                              loras=ctx.loras if comp.lora_target else ())
        shards[name] = res
        report.rows.append(Row("shard", name, res.cached, res.bytes, time.perf_counter() - t))

    # Stage 2: one graph per bucket / resolution, through the compile cache.
    remote = open_remote(spec.cache_from, spec.cache_public_keys, spec.cache_trusted)
    workers = plan_workers(spec, compile_jobs)
    if compile_jobs is not None and compile_jobs > 1 and workers == 1:
        report.warnings.append(f"--jobs {compile_jobs}: this build compiles one graph at a time in the build process "
                               "(TP and parallel layouts, the export and neuron back ends: qic/builder/workers.py)")
    artifacts, report.compile_workers = _compile_all(jobs, ctx, backend, shards, remote, progress, workers)
    for art in artifacts:
        report.rows.append(Row("compile", art.meta["graph"], art.cached,
                               sum(f["bytes"] for f in art.meta["files"].values()), art.seconds))

    # The back end's build-wide step over every graph (the neuron back end's NEFFs).
    finished = backend.finish(artifacts, ctx.cache, progress)
    artifacts = finished.artifacts
    report.rows += [Row(*row) for row in finished.rows]
    report.warnings += finished.warnings

    # Stage 3: the bundle.
    build_key = _build_key(spec, digest, ctx.ckpt.tokenizer_digest(), shards, artifacts)
    t = time.perf_counter()
    written = write_bundle(ctx, spec, backend, digest, shards, artifacts, build_key)
    report.up_to_date = not written
    report.rows.append(Row("bundle", str(ctx.output), not written, tree_bytes(ctx.output), time.perf_counter() - t))
    report.seconds = time.perf_counter() - t0
    return report


def _compile_all(jobs, ctx, backend, shards, remote, progress, workers: int) -> tuple[list, int]:
    """Every job's artifact, in the jobs' order: one after another, or `workers` at a time in compile workers;
    and how many worker processes compiled (0: none, every graph cached or compiled here)."""
    said = threading.Lock()   # the progress display is told from one thread at a time

    def one(job, pool=None):
        if progress:
            with said:
                progress("compile", job.name, None)
        return compile_job(job, ctx, backend, weights_path=shards[job.component].files[0], remote=remote,
                           workers=pool)

    if workers <= 1 or len(jobs) <= 1:
        return [one(job) for job in jobs], 0
    with ThreadPoolExecutor(workers) as threads, CompileWorkers(workers) as pool:
        futures = [threads.submit(one, job, pool) for job in jobs]
        try:
            # The first failure is raised as it happens, not after the jobs before it; leaving the block then stops
            # the workers (CompileWorkers.__exit__), so the threads still waiting on them end at once.
            concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_EXCEPTION)
            return [f.result() for f in futures], pool.started
        finally:
            for f in futures:
                f.cancel()


def _build_key(spec, digest, tokenizer, shards, artifacts) -> str:
    where = ("output", "cache_dir", "cache_from", "cache_public_keys", "cache_trusted")  # not what is built
    body = {"spec": {k: v for k, v in spec.to_json().items() if k not in where},
            "checkpoint": digest, "tokenizer": tokenizer, "shards": {k: v.key for k, v in shards.items()},
            "graphs": [a.graph_key for a in artifacts], "qic": __version__, "torch": torch.__version__,
            "neffs": [a.meta.get("neff", {}).get("sha256") for a in artifacts], "format": FORMAT_VERSION}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def stage_progress(progress, stage, item):
    if progress is None:
        return None
    return lambda nbytes: progress(stage, item, nbytes)
