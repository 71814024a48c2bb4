"""Graph planning: every graph a spec asks for, with its spec key, computed without exporting anything. The one
place `qic build`, `qic plan` and `qic warm` get their graphs and keys from.

The spec key covers qic's code that shapes a graph, the component configs it depends on (provenance
entries left out), the graph's shapes, dtype, TP degree and the back end's identity; it memoises spec key
-> graph key (qic.cache.layout), so a no-op build exports nothing.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from qic import __version__, family
from qic.builder.context import looped, tp_of
from qic.builder.graphs import make_graph
from qic.errors import ConfigError
from qic.graph_names import graph_name

# Config entries that say which tool wrote a file, not what the graph computes: a checkpoint variant saved by
# another diffusers/transformers (Qwen-Image-2512 vs Qwen-Image) keeps the spec key, so it exports nothing.
PROVENANCE_KEYS = ("_diffusers_version", "_name_or_path", "transformers_version", "_commit_hash")
# Where the code that shapes a graph starts: the graph makers, the models, TP's rewrite (applied before export),
# every back end's build half, and the family's component definitions (their shapes, graph makers and TP
# tables: loaded by name, so no import leads there; roots() adds the family being built). What they import, at
# any depth and inside functions too, is found by code_files(), so a module they come to use is keyed without
# anyone listing it.
CODE_ROOTS = ("qic.builder.graphs", "qic.models", "qic.parallel.tp", "qic.parallel.sequence", "qic.backends")
_QIC = Path(__file__).resolve().parent.parent


def roots() -> tuple[str, ...]:
    """CODE_ROOTS and the components module of the family being built (qic.family.use)."""
    return (CODE_ROOTS[0], family.current().components, *CODE_ROOTS[1:])


@dataclass
class GraphJob:
    """One graph to compile: what it is, and its spec key (computable without exporting anything)."""
    component: str
    name: str
    shape: dict
    spec_key: str
    maker: object          # maker(bound module) -> GraphDef
    job_id: str            # the spec key without this machine's identity: the same on every warm worker


def code_digest() -> str:
    """The spec keys' digest of qic's graph-shaping code: every file code_files() finds; edits invalidate."""
    h = hashlib.sha256(__version__.encode())
    for f in code_files(roots()):
        h.update(_label(f).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


@functools.cache
def code_files(roots: tuple[str, ...] | None = None) -> tuple[Path, ...]:
    """The source files of `roots` (default CODE_ROOTS; a package: all its modules) and of every qic module, or
    module of a family outside qic, that they import."""
    roots = CODE_ROOTS if roots is None else roots
    outside = {n.split(".")[0] for n in roots if n.split(".")[0] != "qic"}
    seen: set[Path] = set()
    todo = [f for root in roots for f in _module_files(root, roots, outside)]
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        for name in _imported(f):
            todo += _module_files(name, roots, outside)
    return tuple(sorted(seen))


def _label(f: Path) -> str:
    """A file's name in the digest: its path in qic, or in the top package of a family outside qic."""
    if f.is_relative_to(_QIC):
        return f.relative_to(_QIC).as_posix()
    top = next(p for p in f.parents if not (p / "__init__.py").is_file())
    return "family:" + f.relative_to(top).as_posix()


def _top(package: str) -> Path | None:
    if package == "qic":
        return _QIC
    spec = importlib.util.find_spec(package)
    return Path(next(iter(spec.submodule_search_locations))) if spec and spec.submodule_search_locations else None


def _module_files(name: str, roots: tuple[str, ...] = (), outside: set[str] = frozenset()) -> list[Path]:
    """The file(s) of a qic module or package (its __init__ and, for a package named as a root, all of it), or
    of one under a family's top package outside qic (`outside`); [] for anything else, or a name inside a
    module (`from qic.x import y`, y not a module)."""
    parts = name.split(".")
    if parts[0] != "qic" and parts[0] not in outside:
        return []
    top = _top(parts[0])
    if top is None:
        return []
    base = top.joinpath(*parts[1:])
    if base.with_suffix(".py").is_file():
        return [base.with_suffix(".py")]
    if (base / "__init__.py").is_file():
        return sorted(base.rglob("*.py")) if name in roots else [base / "__init__.py"]
    return []


def _imported(path: Path) -> set[str]:
    """Every module an import statement in the file names (`from a import b`: a, and a.b if b is a module)."""
    out = set()
    package = _label(path).removeprefix("family:").removesuffix(".py").replace("/", ".")
    package = package if not path.is_relative_to(_QIC) else "qic." + package
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_bytes())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the file's package, one level up per extra dot
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    # An enclosing package's __init__ runs on import too: `import qic.a.b` runs qic/a/__init__.py.
    return out | {n.rsplit(".", i)[0] for n in list(out) for i in range(1, n.count(".") + 1)}


def spec_key(gdef_name: str, shape: dict, dtype: str, tp: int, configs: dict, identity: dict, code: str) -> str:
    blob = json.dumps({"graph": gdef_name, "shape": shape, "dtype": dtype, "tp": tp, "configs": configs,
                       "backend": identity, "code": code}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def plan_jobs(spec, configs: dict, raw: dict, backend) -> list[GraphJob]:
    """Every graph the spec asks for, with its spec key. `configs`: parsed per component; `raw`: the
    checkpoint's config.json per folder; `backend`: the build half (its identity keys the graphs)."""
    check_step_cache(spec, configs)
    code = code_digest()
    identity = backend.identity()
    where = {"backend": spec.backend, "device": spec.device}
    jobs = []
    for comp_name, shape in graph_shapes(spec):
        comp = family.component(comp_name)
        deps = config_deps(comp_name, raw)
        dtype = comp.run_dtype(spec.dtype_of(comp_name))
        name = name_of(comp_name, shape)
        tp = tp_of(comp_name, spec.tp)
        # A parallel layout changes every TP graph's collectives (the mesh's group names) and those of the
        # component that runs the layout's ranks.
        layout = {} if spec.layout.plain else {"layout": spec.layout.as_dict()}
        shape_key = {**shape, "looped": looped(spec, comp_name)} | (layout if tp > 1 or comp.runs_layout else {})
        jobs.append(GraphJob(comp_name, name, shape, spec_key(name, shape_key, dtype, tp, deps, identity, code),
                             _maker(comp_name, configs, shape, dtype, spec.layout),
                             spec_key(name, shape_key, dtype, tp, deps, where, "")))
    return jobs


def config_deps(component: str, raw: dict) -> dict:
    """The checkpoint's configs that `component`'s graphs read (its config_deps folders), without the keys
    that only say where and by what a config was written."""
    return {f: {k: v for k, v in raw[f].items() if k not in PROVENANCE_KEYS}
            for f in family.component(component).config_deps}


def _maker(component: str, configs: dict, shape: dict, dtype: str, layout):
    return lambda module: make_graph(component, module, configs, shape, dtype, layout)


def graph_shapes(spec) -> list[tuple[str, dict]]:
    """(component, shape) for every graph the spec asks for, in build order: each component's own shapes
    (qic.family.Component.graph_shapes), components in the family's order."""
    # LoRA slots: the lora target's graphs take adapter inputs of that rank (qic/builder/lora_slots.py binds them)
    slots = {"lora_slots": spec.lora_slots} if spec.lora_slots else {}
    return [(name, {**shape, **slots} if comp.lora_target else shape)
            for name, comp in family.components(spec.family).items() if name in spec.components
            for shape in comp.graph_shapes(spec)]


def check_step_cache(spec, configs: dict) -> None:
    """The split must leave the middle at least one block of the denoiser's."""
    if spec.step_cache and "denoiser" in configs:
        first, last = spec.step_cache
        layers = configs["denoiser"].num_layers
        if first + last >= layers:
            raise ConfigError(f"step_cache first {first} + last {last} leaves no middle block of the denoiser's "
                              f"{layers} blocks", f"use first + last <= {layers - 1}")


def name_of(component: str, shape: dict) -> str:
    return graph_name(component, shape.get("resolution"), shape.get("bucket"), shape.get("cfg", True),
                      shape.get("batch", 1), shape.get("part"), shape.get("rows"))
