"""`qic warm`: fill a compile cache from a matrix of build configs, from the models' configs alone.

A matrix is a build config in which any key may hold a list (`model: [A, B]`, `tp: [1, 4]`,
`dtype: [float32, bfloat16]`); resolutions and text buckets are lists already and expand into graphs.
Warm expands it into graph jobs through the build's own plan (qic.builder.jobs.plan_jobs), dedupes
jobs that share a key, and compiles the misses through the build's compile cache with weights stood in
by shapes. Jobs are sorted by a machine-independent id and dealt round-robin to shards, so every worker
derives the same list and `--shard I/N` for I = 1..N covers each job exactly once.
"""

from __future__ import annotations

import itertools
import json
import time
import traceback
from collections.abc import Mapping
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from pathlib import Path

from qic import family
from qic.backends import NAMES, backend_for, info
from qic.builder.binding import compile_job
from qic.builder.context import Context, validate
from qic.builder.jobs import plan_jobs
from qic.builder.source import display_name, fetch_model_indexes
from qic.cache import layout, store
from qic.cache.signing import load_private_key
from qic.errors import ConfigError, QicError, warn
from qic.fsutil import write_bytes_atomic

# Keys whose list value is an axis of the matrix (resolutions, text buckets, components are lists anyway).
AXES = ("model", "backend", "device", "tp", "dtype", "layers", "ulysses", "cfg_parallel", "step_cache")


@dataclass
class WarmRow:
    job_id: str
    graph: str
    model: str
    status: str           # hit | compiled | failed | would compile
    seconds: float = 0.0
    bytes: int = 0
    error: str = ""


def parse_shard(text: str | None) -> tuple[int, int]:
    """'I/N' (1-based) -> (I, N)."""
    if not text:
        return 1, 1
    try:
        i, n = (int(x) for x in str(text).split("/"))
    except ValueError:
        raise ConfigError(f"--shard {text!r} is not of the form I/N (e.g. 1/4)") from None
    if not 1 <= i <= n:
        raise ConfigError(f"--shard {text!r}: I must be between 1 and N")
    return i, n


def expand_matrix(path: str | Path, overrides: Mapping | None = None) -> list:
    """The build specs a matrix file stands for (the product of its list-valued axes)."""
    from qic.spec import parse_spec, read_yaml_mapping
    path = Path(path)
    raw = read_yaml_mapping(path)
    raw.update({k: v for k, v in (overrides or {}).items() if v is not None})
    axes = [(k, _axis(k, raw[k])) for k in AXES if k in raw]
    specs = []
    for values in itertools.product(*(v for _, v in axes)):
        entry = {**raw, **dict(zip((k for k, _ in axes), values))}
        if "backend" in entry and "device" not in raw:
            entry.setdefault("device", info(entry["backend"]).DEFAULT_DEVICE)
        if (isinstance(raw.get("backend"), list) and isinstance(raw.get("device"), list)
                and entry.get("device") not in info(entry.get("backend", NAMES[0])).DEVICES):
            continue  # a back end paired with another back end's device: not a combination anyone means
        specs.append(parse_spec(entry, source=str(path)))
    return specs


def _axis(key: str, value) -> list:
    """A key's values in the matrix. One step_cache is itself a pair ([1, 0]), so only a list holding
    something other than integers is its axis: [[1, 0], [8, 0]], ["1,0", "8,0"], [null, [1, 0]] (null:
    without the split graphs)."""
    if not isinstance(value, list):
        return [value]
    if key == "step_cache" and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return [value]
    return value


@dataclass
class PlannedJob:
    job: object           # qic.builder.jobs.GraphJob
    ctx: object           # qic.builder.context.Context
    backend: object
    model: str


def plan(specs) -> tuple[list[PlannedJob], list[WarmRow]]:
    """Deduplicated jobs in canonical order, plus one failed row per spec that could not be planned."""
    jobs: dict[str, PlannedJob] = {}
    failed = []
    for spec in specs:
        model = display_name(spec.model)
        try:
            backend = backend_for(spec)
            ctx = Context(spec, None, configs_only=True)
            validate(spec, ctx)
            for job in plan_jobs(spec, ctx.configs, ctx.raw, backend):
                jobs.setdefault(job.job_id, PlannedJob(job, ctx, backend, model))
        except QicError as e:
            where = _where(spec)
            warn(f"{model} ({', '.join(where)}) cannot be planned: {e.message}")
            failed.append(WarmRow(":".join(("plan", model, *where)).replace(" ", ""), "(planning)", model, "failed",
                                  error=e.message))
    return [jobs[k] for k in sorted(jobs)], failed


def _where(spec) -> tuple[str, ...]:
    """What tells one of a matrix's specs from the others, for a failed row's id and its warning."""
    lay = spec.layout
    return (spec.backend, spec.device, f"tp={spec.tp}") + ((f"ulysses={lay.ulysses}",) if lay.ulysses > 1 else ()) \
        + (("cfg_parallel",) if lay.cfg > 1 else ()) \
        + ((f"step_cache={spec.step_cache[0]},{spec.step_cache[1]}",) if spec.step_cache else ())


def shard_of(jobs: list, index: int, count: int) -> list:
    """Round-robin over the canonical order: balanced, and the same on every worker."""
    return [j for n, j in enumerate(jobs) if n % count == index - 1]


def run_jobs(jobs: list[PlannedJob], dry_run: bool = False, sign_key: str | None = None) -> list[WarmRow]:
    """Compile every job, finishing the others when one fails (a failed job publishes nothing)."""
    key = load_private_key(sign_key) if sign_key else None
    rows = []
    for pj in jobs:
        job, ctx = pj.job, pj.ctx
        family.use(ctx.family)   # a matrix may name models of several families: each job compiles with its own
        row = WarmRow(job.job_id, job.name, pj.model, "")
        t0 = time.perf_counter()
        if dry_run:
            row.status = "hit" if _cached(pj) else "would compile"
        else:
            try:
                art = compile_job(job, ctx, pj.backend, None, sign=key)
                row.status = "hit" if art.cached else "compiled"
                row.bytes = sum(f["bytes"] for f in art.meta["files"].values())
            except Exception as e:  # one job's failure must not stop the others
                row.status, row.error = "failed", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                warn(f"{job.name} ({pj.model}) failed: {row.error}\n{traceback.format_exc(limit=3)}")
        row.seconds = round(time.perf_counter() - t0, 2)
        rows.append(row)
    return rows


def _cached(pj: PlannedJob) -> bool:
    gkey = layout.read_memo(pj.ctx.cache, pj.job.spec_key)
    return gkey is not None and store.lookup(pj.ctx.cache, gkey, pj.backend.identity(), quiet=True) is not None


def warm_shard(matrix: str, overrides: dict | None, index: int, count: int, dry_run: bool = False,
               sign_key: str | None = None) -> tuple[int, list[WarmRow]]:
    """(jobs in the whole matrix, rows for shard index/count). Runs in worker processes too."""
    specs = expand_matrix(matrix, overrides)
    if fetch_model_indexes([spec.model for spec in specs]):   # hub repos seen for the first time: by their family
        specs = expand_matrix(matrix, overrides)
    jobs, failed = plan(specs)
    mine = shard_of(jobs, index, count)
    # Planning failures are reported once, by the first shard.
    return len(jobs), (failed if index == 1 else []) + run_jobs(mine, dry_run, sign_key)


def warm(matrix: str, overrides: dict | None = None, shard: str | None = None, jobs: int = 1,
         dry_run: bool = False, sign_key: str | None = None) -> tuple[int, list[WarmRow]]:
    """Shard I/N of the matrix; with jobs=K, K worker processes take sub-shards I-1+N*j of N*K, which
    together are exactly shard I/N (n % N == I-1 iff n % NK is one of I-1+N*j)."""
    index, count = parse_shard(shard)
    if jobs < 1:
        raise ConfigError(f"--jobs {jobs}: must be at least 1")
    if jobs == 1:
        return warm_shard(matrix, overrides, index, count, dry_run, sign_key)
    subs = [(index + count * j, count * jobs) for j in range(jobs)]
    with ProcessPoolExecutor(jobs, mp_context=get_context("spawn")) as pool:
        results = list(pool.map(warm_shard, *zip(*[(matrix, overrides, i, n, dry_run, sign_key) for i, n in subs])))
    rows = [r for _, part in results for r in part]
    if index != 1:
        rows = [r for r in rows if r.graph != "(planning)"]
    return results[0][0], rows


def summary(rows: list[WarmRow]) -> dict:
    return {"jobs": len(rows), "hits": sum(r.status == "hit" for r in rows),
            "misses": sum(r.status in ("compiled", "failed", "would compile") for r in rows),
            "compiled": sum(r.status == "compiled" for r in rows), "failed": sum(r.status == "failed" for r in rows),
            "compile_seconds": round(sum(r.seconds for r in rows if r.status == "compiled"), 1),
            "bytes": sum(r.bytes for r in rows)}


def report_json(total: int, rows: list[WarmRow], shard: str | None) -> dict:
    return {"shard": shard or "1/1", "matrix_jobs": total, "summary": summary(rows), "rows": [asdict(r) for r in rows]}


def write_report(path: str | Path, total: int, rows: list[WarmRow], shard: str | None) -> None:
    """The JSON report, atomically: CI jobs and dashboards that read it never see half a file."""
    write_bytes_atomic(Path(path), (json.dumps(report_json(total, rows, shard), indent=2) + "\n").encode())
