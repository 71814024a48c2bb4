"""The house rules of qic's layout, checked on the source itself: no folder named like build output, lint
over every file, no import cycle (imports inside functions included), no module outside a back end's
own package that branches on a back end's name, and no test hook read from the environment."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from qic import backends

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "qic"
# Folder names tools treat as output: black's default exclude, GitHub's Python .gitignore template.
OUTPUT_NAMES = {"build", "dist", "out", "target", "artifacts", "_build"}
BACKEND_NAMES = backends.NAMES


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted(PACKAGE.rglob("*.py")):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every qic module `name` imports, at any depth of the file (functions included). `from P import X`
    counts as an import of P.X when that is a module, else of P."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for a in node.names:
                found.add(f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target)
    return {m for m in found if m in modules and m != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan), or nodes importing themselves."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_source_folder_is_named_like_build_output():
    for root in (PACKAGE, ROOT / "benchmarks", ROOT / "training", ROOT / "tests"):
        bad = [p for p in root.rglob("*") if p.is_dir() and p.name in OUTPUT_NAMES and any(p.rglob("*.py"))]
        assert not bad, f"source folders named like build output: {bad}"


def test_ruff_checks_every_package_file_and_passes():
    listed = subprocess.run([sys.executable, "-m", "ruff", "check", "--show-files", "."], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout
    checked = {Path(line.strip()).resolve() for line in listed.splitlines() if line.strip().endswith(".py")}
    missing = [p for p in _modules().values() if p.resolve() not in checked]
    assert not missing, f"ruff does not check: {missing}"
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_no_import_cycle_among_modules():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert graph["qic.builder.pipeline"], "the import walk found nothing: it is broken, not the code clean"
    assert not _cycles(graph), f"import cycles: {_cycles(graph)}"


def test_no_import_cycle_among_packages():
    """Packages (qic.builder, qic.cache, ...) import each other one way only, too. A model family's folder
    (qic/models/<family>/) counts as a package of its own: a family sits above the builder (its graph makers use
    the builder's GraphDef) and is found by name (qic.family), while the shared blocks beside it (qic.models.common,
    qic.models.looped) sit below the builder, as a family installed outside qic would."""
    modules = _modules()
    families = {p.name for p in (PACKAGE / "models").iterdir() if (p / "__init__.py").is_file()}

    def package(name: str) -> str:
        parts = name.split(".")
        return ".".join(parts[:3] if parts[1:2] == ["models"] and parts[2:3] and parts[2] in families else parts[:2])

    top = {name: package(name) for name in modules}
    graph: dict[str, set[str]] = {p: set() for p in top.values()}
    for name, path in modules.items():
        graph[top[name]].update(top[m] for m in _imports(name, path, modules) if top[m] != top[name])
    assert not _cycles(graph), f"package cycles: {_cycles(graph)}"


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]


def _branches_on_backend_name(path: Path) -> list[str]:
    """Comparisons and match cases with a back end's name as a literal: `x == "neuron"`, `x in ("inductor",
    ...)`, `case "neuron":`."""
    def named(node) -> bool:
        if isinstance(node, ast.Constant) and node.value in BACKEND_NAMES:
            return True
        return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(named(e) for e in node.elts)

    found = []
    where = path.relative_to(ROOT) if ROOT in path.parents else path
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Compare) and any(named(n) for n in [node.left, *node.comparators]):
            found.append(f"{where}:{node.lineno}")
        elif isinstance(node, ast.match_case) and isinstance(node.pattern, ast.MatchValue) and named(
                node.pattern.value):
            found.append(f"{where}:{node.pattern.lineno}")
    return found


def test_no_module_outside_a_backend_branches_on_a_backend_name():
    own = {PACKAGE / "backends" / name for name in BACKEND_NAMES}
    found = [hit for path in _modules().values() if not any(d in path.parents for d in own)
             for hit in _branches_on_backend_name(path)]
    assert not found, f"branches on a back end's name outside qic/backends/<name>/: {found}"


@pytest.mark.parametrize("code", ['if spec.backend == "neuron":\n    pass\n',
                                  'x = device in ("cpu", "inductor")\n',
                                  'match b:\n    case "inductor":\n        pass\n'])
def test_the_backend_branch_finder_finds_a_branch(tmp_path, code):
    f = tmp_path / "probe.py"
    f.write_text(code)
    assert _branches_on_backend_name(f)


def test_make_test_runs_the_lint_first():
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile.split("\ntest:")[1].split("\n\n")[0]
    assert "ruff check ." in recipe and recipe.index("ruff check") < recipe.index("pytest"), recipe


# ---- issue 19's finding 11: no test hooks in production code ---------------------------------------------

def test_qic_reads_no_test_hooks_from_the_environment():
    found = subprocess.run(["grep", "-rn", "QIC_TEST", str(ROOT / "qic")], capture_output=True, text=True).stdout
    assert found == "", found
