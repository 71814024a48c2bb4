"""`qic plan` presentation (also printed at the start of `qic build`): the memory and disk plan as tables."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from qic.cli.tables import size, wide_console


def run_plan(config, overrides) -> None:
    """CONFIG may be a YAML build config or a checkpoint directory (configs alone are enough)."""
    from qic import family
    from qic.builder.memplan import plan_memory
    from qic.builder.source import load_spec_by_family, resolve_configs
    from qic.builder.workers import plan_workers

    if config and Path(config).is_dir():
        if overrides.get("model"):
            from qic.errors import ConfigError
            raise ConfigError(f"{config} is a model directory and --model names another",
                              "pass one of them")
        config, overrides = None, {**overrides, "model": str(config)}
    spec = load_spec_by_family(config, overrides)
    family.use(spec.family)
    configs, raw = resolve_configs(spec.model, Path(spec.cache_dir))
    print_plan(plan_memory(spec, configs, raw, Path(spec.cache_dir)), model_name(spec.model), wide_console(),
               plan_workers(spec))


def print_plan(plan, model: str, console: Console, workers: int = 1) -> None:
    """The plan's tables and closing line; `workers`: the compile workers the build would use (its estimate)."""
    layout = f", {plan.layout.describe()}" if plan.layout is not None and not plan.layout.plain else ""
    comps = Table(title=f"qic plan: {model}, tp={plan.tp}{layout}")
    for col in ("component", "dtype", "ranks", "weights/rank", "x TP 1", "shards on disk"):
        comps.add_column(col, justify="left" if col in ("component", "dtype") else "right")
    for c in plan.components:
        comps.add_row(c.name, c.dtype, str(c.ranks), size(c.bytes_per_rank), f"{c.bytes_per_rank / c.bytes_tp1:.3f}",
                      size(c.ranks * c.bytes_per_rank))
    graphs = Table(title="graphs (per rank; peak = weights + inputs + live activations, run eagerly)")
    for col in ("graph", "weights", "largest activation", "peak (est.)", "GFLOP", "compile (est.)"):
        graphs.add_column(col, justify="left" if col == "graph" else "right")
    for g in plan.graphs:
        graphs.add_row(g.name, size(g.weight_bytes), size(g.largest_activation), size(g.peak), f"{g.flops / 1e9:.3f}",
                       "cached" if g.cached else f"{g.compile_seconds:.0f}s")
    console.print(comps)
    console.print(graphs)
    if plan.traffic:
        step = Table(title=f"denoise step per rank, {plan.layout.describe()} (true CFG; collective bytes: "
                           "what each rank receives)")
        for col in ("resolution", "text", "TFLOP", "all-reduce", "all-gather", "all-to-all"):
            step.add_column(col, justify="left" if col == "resolution" else "right")
        for (h, w), bucket, t in plan.traffic:
            step.add_row(f"{h}x{w}", str(bucket), f"{t['flops'] / 1e12:.3f}", size(t["all-reduce"]),
                         size(t["all-gather"]), size(t["all-to-all"]))
        console.print(step)
    for what, n in plan.resident:
        console.print(f"resident between graph calls: {what}: {size(n)} per rank")
    held = " + the resident state above" if plan.resident else ""
    console.print(f"run: {size(plan.run_peak_per_rank)} per rank (every component resident{held} + the largest "
                  "graph); "
                  f"disk: {size(plan.shard_disk)} shards + {size(plan.artifact_disk)} compiled graphs in the cache, "
                  f"the bundle hard-links the shards and copies the graphs; {len(plan.graphs)} graphs, "
                  f"compile about {plan.compile_seconds / 60:.1f} min ({plan.compile_source})"
                  + (f", about {plan.compile_wall(workers) / 60:.1f} min on {workers} compile workers"
                     if workers > 1 and plan.compile_wall(workers) < plan.compile_seconds else ""))


def model_name(model: str | None) -> str:
    from qic.builder.source import display_name  # lazily, like every builder import of the CLI
    return display_name(model)
