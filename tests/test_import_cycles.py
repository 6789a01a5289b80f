"""No import cycles between compiled_engine's packages.

Each module is read with `ast` (nothing is imported) and every import of another package of
compiled_engine becomes an edge between the two packages (`core`, `engine`, `graphs`, ...; a
top-level module such as `compiled_engine.errors` is a node of its own). Imports inside functions
count too: a lazy import still ties the two packages together. Only `if TYPE_CHECKING:` blocks are
left out, since they never run.
"""

from __future__ import annotations

import ast
import graphlib
import importlib.util
import itertools
from pathlib import Path

ROOT = "compiled_engine"
# graphs/ and kernels/ live at the top of the repository but install as compiled_engine's.
SOURCE_PACKAGES = (ROOT, f"{ROOT}.graphs", f"{ROOT}.kernels")


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.submodule_search_locations, f"{name} is not an installed package"
    return Path(next(iter(spec.submodule_search_locations)))


def _modules() -> dict[str, Path]:
    """Every module of compiled_engine, by dotted name."""
    modules: dict[str, Path] = {}
    for package in SOURCE_PACKAGES:
        directory = _package_dir(package)
        for path in sorted(directory.rglob("*.py")):
            parts = list(path.relative_to(directory).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join([package, *parts])
            modules.setdefault(name, path)  # compiled_engine/ holds no graphs/ or kernels/ copy
    return modules


def _package_of(module: str) -> str:
    """compiled_engine.<first part>: the package (or top-level module) a module belongs to."""
    return ".".join(module.split(".")[:2])


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class _ImportCollector(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool, modules: dict[str, Path]) -> None:
        self.module = module
        self.is_package = is_package
        self.modules = modules
        self.targets: set[str] = set()

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):
            for child in node.orelse:  # the `else:` of `if TYPE_CHECKING:` does run
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        self.targets.update(alias.name for alias in node.names)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:  # relative: from the module's package, one level up per extra dot
            package = self.module.split(".")[: None if self.is_package else -1]
            package = package[: len(package) - (node.level - 1)]
            base = ".".join([*package, node.module] if node.module else package)
        for alias in node.names:
            # `from pkg import mod` imports the module pkg.mod; `from pkg import name`, pkg.
            self.targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in self.modules else base)


def _package_graph() -> dict[str, dict[str, set[str]]]:
    """package -> the packages it imports -> the modules that import them."""
    modules = _modules()
    graph: dict[str, dict[str, set[str]]] = {}
    for module, path in modules.items():
        source = _package_of(module)
        imports = graph.setdefault(source, {})
        collector = _ImportCollector(module, path.name == "__init__.py", modules)
        collector.visit(ast.parse(path.read_text(), filename=str(path)))
        for target in collector.targets:
            if target.split(".")[0] != ROOT or _package_of(target) == source:
                continue
            imports.setdefault(_package_of(target), set()).add(module)
    return graph


def test_the_walk_sees_every_package() -> None:
    graph = _package_graph()
    for package in ("core", "engine", "worker", "distributed", "records", "graphs", "kernels", "entrypoints"):
        assert f"{ROOT}.{package}" in graph
    # A known edge, so an empty graph (a walk that found nothing) cannot pass.
    assert f"{ROOT}.kernels" in graph[f"{ROOT}.graphs"]


def test_no_import_cycle_between_packages() -> None:
    graph = _package_graph()
    sorter = graphlib.TopologicalSorter({package: set(deps) for package, deps in graph.items()})
    try:
        sorter.prepare()
    except graphlib.CycleError as error:
        # [a, b, ..., a], each a predecessor (here: imported by) the next: read it backwards.
        cycle = error.args[1][::-1]
        steps = [
            f"{importer} -> {imported} (in {', '.join(sorted(graph[importer][imported]))})"
            for importer, imported in itertools.pairwise(cycle)
        ]
        raise AssertionError("package import cycle:\n  " + "\n  ".join(steps)) from None
