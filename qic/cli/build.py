"""`qic build` presentation: progress bars while it works, a closing table of what was built."""

from __future__ import annotations

import contextlib

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from qic.cli.plan import model_name, print_plan
from qic.cli.tables import size, wide_console


def run_build(config, overrides, jobs: int | None = None) -> None:
    from qic.builder.pipeline import build
    from qic.builder.source import load_spec_by_family

    if jobs is not None:
        from qic.builder.workers import checked_jobs
        checked_jobs(jobs, f"--jobs {jobs}")
    spec = load_spec_by_family(config, overrides)
    console = wide_console(stderr=True)
    with _progress_bars(console) as progress:
        report = build(spec, progress, on_plan=lambda plan: _print_plan(plan, spec, jobs), compile_jobs=jobs)
    _print_report(report, console, "bundle")


def run_weight_set(bundle: str, config, overrides: dict, jobs: int | None) -> None:
    """`qic build --weights-for BUNDLE --model DIR --output SET`: the checkpoint's weights cut for BUNDLE's graphs
    (qic.builder.weight_set). Everything else about the build is BUNDLE's, so no other setting is taken."""
    from qic.builder.weight_set import build_weight_set
    from qic.errors import ConfigError
    given = [k for k, v in overrides.items() if v is not None and k not in ("model", "output", "cache_dir")]
    given += ["config"] * bool(config) + ["jobs"] * (jobs is not None)
    if given:
        # the repeatable flags' keys are plural: --resolution gives `resolutions`
        flag = {"resolutions": "resolution", "loras": "lora", "cache_public_keys": "cache_public_key",
                "condition_sizes": "condition_size"}.get(given[0], given[0])
        what = "a build config" if given[0] == "config" else f"--{flag.replace('_', '-')}"
        raise ConfigError(f"--weights-for {bundle}: {what} is not taken: the graphs, and so every setting, are "
                          "the bundle's", f"drop {what}")
    for flag in ("model", "output"):
        if not overrides.get(flag):
            raise ConfigError(f"--weights-for {bundle}: --{flag} is needed (the checkpoint to convert, and where "
                              "the weight set goes)")
    console = wide_console(stderr=True)
    with _progress_bars(console) as progress:
        report = build_weight_set(bundle, overrides["model"], overrides["output"],
                                  overrides.get("cache_dir") or "artifacts/cache", progress=progress)
    _print_report(report, console, "weight set")


@contextlib.contextmanager
def _progress_bars(console):
    """progress(stage, item, nbytes), as the build stages call it: a bar per (stage, item), the earlier ones marked
    done when a new one starts, shown on `console` while the block runs."""
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as bar:
        tasks = {}

        def progress(stage, item, nbytes):
            key = (stage, item)
            if key not in tasks:
                for t in tasks.values():
                    bar.update(t, completed=1, total=1)
                tasks[key] = bar.add_task(f"{stage:8} {item}", total=None)
            elif nbytes:
                bar.advance(tasks[key], nbytes)
        yield progress


def _print_report(report, console, what: str) -> None:
    table = Table(title=f"qic build -> {report.output}", show_lines=False)
    for col in ("stage", "item", "result", "size", "time"):
        table.add_column(col, justify="right" if col in ("size", "time") else "left")
    for r in report.rows:
        table.add_row(r.stage, r.item, "cached" if r.cached else "built", size(r.bytes), f"{r.seconds:.1f}s")
    out = Console()
    out.print(table)
    total = len(report.rows)
    workers = f" ({report.compile_workers} compile workers)" if report.compile_workers else ""
    out.print(f"{report.hits}/{total} from cache ({100 * report.hits // max(total, 1)}% hits), "
              f"{report.seconds:.1f}s{workers}; {what} {'unchanged' if report.up_to_date else 'written'}: "
              f"{report.output}")
    for line in report.warnings:
        console.print(f"[yellow]warning:[/yellow] {line}", highlight=False, soft_wrap=True)


def _print_plan(plan, spec, jobs: int | None) -> None:
    """The memory plan on stdout, before any work (stderr stays for progress and errors; rich's live
    progress display prints stdout above itself)."""
    from qic.builder.workers import plan_workers
    print_plan(plan, model_name(spec.model), wide_console(), plan_workers(spec, jobs))

