"""Module guards: no import cycle between anec's modules, and no module over 500 lines.

An import cycle (function-level imports included) hides behind a lazy import until someone
moves it to the top of a file; it also means two modules cannot be understood (or tested) one
without the other. The graph is read with the standard library's ``ast``: nothing is
imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("converter", "graph_passes", "parity", "recipes")
MAX_LINES = 500
# Modules over the limit today, each being split by the work that owns it. An entry that is
# back under the limit fails the test too, so this list can only shrink.
KNOWN_OVERSIZE: set[str] = set()
# Cycles that exist today and are being removed by the work that owns them (none now). An
# entry whose cycle is gone fails the test too, so this list can only shrink.
KNOWN_CYCLES: set[frozenset[str]] = set()


def module_files(repo: Path = REPO) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the packages (``__init__`` = package)."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((repo / package).rglob("*.py")):
            parts = path.relative_to(repo).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            modules[name] = path
    return modules


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules that module ``name`` imports anywhere in its file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: climb from this module's package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from pkg import sub` imports the module pkg.sub when there is one, else pkg.
            targets = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]  # an attribute of a module, or a submodule
            # Importing an ancestor package is implied by being in it, never a cycle edge.
            if target and target != name and not name.startswith(target + "."):
                found.add(target)
    return found


def import_graph(repo: Path = REPO) -> dict[str, set[str]]:
    """Module -> the project modules it imports."""
    modules = module_files(repo)
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(frozenset(component))
    return found


def test_no_import_cycle_between_modules() -> None:
    found = set(cycles(import_graph()))
    new = [sorted(c) for c in found - KNOWN_CYCLES]
    assert not new, f"import cycles: {new}"
    gone = [sorted(c) for c in KNOWN_CYCLES - found]
    assert not gone, f"no longer a cycle, remove from KNOWN_CYCLES: {gone}"


def test_graph_passes_imports_nothing_from_converter_or_parity() -> None:
    """graph_passes is the lowest layer: the error types it raises live in it
    (`graph_passes.errors`), and converter re-exports them as the same classes."""
    from converter import errors
    from graph_passes import errors as shared

    upward = {
        name: sorted(t for t in targets if t.split(".")[0] in ("converter", "parity"))
        for name, targets in import_graph().items()
        if name.split(".")[0] == "graph_passes"
    }
    assert not {n: t for n, t in upward.items() if t}, "graph_passes imports upward"
    assert (errors.AnecError, errors.InputError, errors.GateFailure) == (
        shared.AnecError,
        shared.InputError,
        shared.GateFailure,
    )


def test_parity_imports_nothing_from_converter() -> None:
    """parity measures what graph_passes builds and the pipeline hands it; it never reaches
    back into the pipeline (lazy imports included)."""
    upward = {
        name: sorted(t for t in targets if t.split(".")[0] == "converter")
        for name, targets in import_graph().items()
        if name.split(".")[0] == "parity"
    }
    assert not {n: t for n, t in upward.items() if t}, "parity imports from converter"


def test_the_walk_finds_lazy_relative_and_from_package_imports(tmp_path: Path) -> None:
    """The checker itself: a cycle through a function-level, a relative and a
    ``from package import module`` import is found; a parent-package import is not a cycle."""
    pkg = tmp_path / "converter"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from converter.sub import b\n")
    (pkg / "sub" / "b.py").write_text("from . import c\nimport converter\n")
    (pkg / "sub" / "c.py").write_text("from converter import d, a\n")
    (pkg / "d.py").write_text("import os\n")  # imported by c, imports nothing back
    for other in PACKAGES[1:]:
        (tmp_path / other).mkdir()
    graph = import_graph(tmp_path)
    assert graph["converter.sub.b"] == {"converter.sub.c"}
    assert graph["converter.sub.c"] == {"converter.a", "converter.d"}
    assert cycles(graph) == [frozenset({"converter.a", "converter.sub.b", "converter.sub.c"})]


def test_no_source_module_over_the_line_limit() -> None:
    sizes = {
        path.relative_to(REPO).as_posix(): len(path.read_text(encoding="utf-8").splitlines())
        for path in module_files().values()
    }
    over = {name for name, n in sizes.items() if n > MAX_LINES}
    new = {name: sizes[name] for name in sorted(over - KNOWN_OVERSIZE)}
    assert not new, f"modules over {MAX_LINES} lines: {new}"
    gone = sorted(KNOWN_OVERSIZE - over)
    assert not gone, f"back under {MAX_LINES} lines, remove from KNOWN_OVERSIZE: {gone}"
