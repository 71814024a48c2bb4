"""`qic warm`: a table of what was compiled, found in the cache or failed."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.table import Table

from qic.cli.tables import size


def run_warm(matrix, overrides, shard, jobs, dry_run, sign_key, report) -> None:
    from qic.builder.warm import summary, warm, write_report
    total, rows = warm(matrix, overrides, shard, jobs, dry_run, sign_key)
    table = Table(title=f"qic warm {matrix} (shard {shard or '1/1'}: {len(rows)} of {total} jobs)")
    for col in ("graph", "model", "result", "size", "time"):
        table.add_column(col, justify="right" if col in ("size", "time") else "left")
    for r in rows:
        table.add_row(r.graph, r.model, r.status + (f": {r.error}" if r.error else ""), size(r.bytes),
                      f"{r.seconds:.1f}s")
    out = Console(width=200)
    out.print(table)
    s = summary(rows)
    out.print(f"{s['hits']} hits, {s['misses']} misses ({s['compiled']} compiled, {s['failed']} failed), "
              f"compile {s['compile_seconds']:.1f}s, {size(s['bytes'])}")
    if report:
        write_report(report, total, rows, shard)
    if s["failed"]:
        sys.exit(1)
