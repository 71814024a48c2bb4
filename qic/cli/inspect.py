"""`qic inspect BUNDLE`: the manifest in a readable form, and every file's hash checked (--verify: re-hashed)."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from qic.backends import loader
from qic.manifest import WEIGHT_SET, check_compatible, read_manifest, verify_files
from qic.parallel.mesh import AXES, Layout
from qic.verified import VerificationCache


def run_inspect(bundle: str, full: bool = False) -> None:
    import torch

    from qic import __version__
    path = Path(bundle)
    manifest = read_manifest(path)
    out = Console()
    if manifest.get("kind") == WEIGHT_SET:
        return _inspect_weight_set(path, manifest, out, full)
    out.print(f"[bold]bundle[/bold] {path}  id {manifest['id'][:16]}")
    out.print(f"model {manifest['model']['id']}  digest {manifest['model']['digest'][:16]}")
    out.print(f"built with qic {manifest['versions']['qic']}, torch {manifest['versions']['torch']}; "
              f"back end {manifest['backend']['backend']} on {manifest['device']}, tp {manifest['tp']}")
    fam = manifest.get("family") or {}
    out.print(f"family {fam.get('name')}, host program {fam.get('host')}")
    # What the family records beside its graphs (text-to-image: resolutions and text buckets)
    resolutions = ", ".join("{}x{}".format(*r) for r in manifest.get("resolutions", []))
    out.print(f"dtypes {manifest['dtypes']}; resolutions {resolutions or '-'}"
              + (f"; text buckets {manifest['text_buckets']}" if "text_buckets" in manifest else ""))
    layout = Layout.of_manifest(manifest)
    if not layout.plain:
        groups = "; ".join(f"{a} groups {layout.groups(a)}" for a in AXES if layout.size(a) > 1)
        out.print(f"layout {layout.describe()}: rank = (cfg * {layout.ulysses} + sp) * {layout.tp} + tp; {groups}")
    if manifest.get("step_cache"):
        sc = manifest["step_cache"]
        out.print(f"step caching: split graphs, first {sc['first']} and last {sc['last']} blocks always computed "
                  "(qic run --cache-threshold / --cache-steps)")
    for lo in manifest.get("loras", []):
        out.print(f"LoRA merged: {lo['file']} (scale {lo['scale']}, sha256 {lo['sha256'][:12]})")
    if manifest.get("scheduler_overrides"):
        out.print(f"scheduler overrides {manifest['scheduler_overrides']}")
    if manifest.get("defaults"):
        out.print(f"run defaults {manifest['defaults']}")
    lines, columns = loader(manifest["backend"]["backend"]).describe(manifest)
    for line in lines:
        out.print(line)
    table = Table(title="graphs")
    for col in ("graph", "inputs", "size", "sha256", *columns):
        table.add_column(col)
    for g in manifest["graphs"]:
        ins = ", ".join(f"{i['name']}{tuple(i['shape'])}" for i in g["inputs"])
        table.add_row(g["name"], ins, f"{g['bytes'] / 1e6:.2f} MB", manifest["files"][g["file"]]["sha256"][:12],
                      *(show(g) for show in columns.values()))
    out.print(table)
    _print_verified(path, manifest, out, full)
    try:
        check_compatible(manifest, __version__, torch.__version__)
        out.print("compatible with this qic and torch")
    except Exception as e:  # inspect still reports; run would refuse
        out.print(f"[yellow]not loadable here: {e}[/yellow]")


def _inspect_weight_set(path: Path, manifest: dict, out: Console, full: bool) -> None:
    """A weight set (qic build --weights-for): what it was cut for and from, its files verified."""
    out.print(f"[bold]weight set[/bold] {path}  id {manifest['id'][:16]}  for bundle {manifest['weights_for'][:16]}")
    out.print(f"model {manifest['model']['id']}  digest {manifest['model']['digest'][:16]}")
    out.print(f"built with qic {manifest['versions']['qic']}, torch {manifest['versions']['torch']}; tp "
              f"{manifest['tp']}; dtypes {manifest['dtypes']}; components {', '.join(manifest['components'])}")
    _print_verified(path, manifest, out, full)
    out.print(f"runs as: qic run BUNDLE --weights {path}")


def _print_verified(path: Path, manifest: dict, out: Console, full: bool) -> None:
    """Every file checked against its hash record (a refusal raises, naming the file)."""
    trusted = verify_files(path, manifest, cache=VerificationCache(), full=full)
    note = (f" ({trusted} unchanged weight file(s) by their recorded hash; --verify re-hashes them)"
            if trusted else " (every file hashed)")
    out.print(f"verified {len(manifest['files'])} files: all hashes match{note}")
