"""The modules of normalizer/, cache_client/ and router/ import one way.

No import cycle among them, and the layers point down only: normalizer <- cache_client <-
router (docs/ARCHITECTURE.md §1). The graph is read from the source with `ast`, nothing is
imported. Every import a module's source makes is an edge: those under
`if TYPE_CHECKING:` (a type-only import that closes a circle is still a circle for a
reader) and those deferred into a function too.

An import names the module it loads: `from router.proxy import attempt` is an edge to
`router.proxy.attempt` when that is a module, `from router.proxy import Proxy` one to the
package `router.proxy` (its `__init__`). The parent packages Python runs on the way to a
submodule are not edges of their own: a package's `__init__` re-exporting its submodules
is then no cycle, as long as the submodules import their siblings directly.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("normalizer", "cache_client", "router")
"""The packages, bottom to top: each may import those before it, never those after."""

Graph = dict[str, set[str]]


def module_files(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Every module of `packages` under `root`, by dotted name (a package by its own name)."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def import_statements(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    return (node for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom))


def imported_modules(name: str, path: Path, node: ast.Import | ast.ImportFrom, modules: Mapping[str, Path]) -> set[str]:
    """The modules of `modules` that `node`, in the module `name` (at `path`), loads."""
    if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
    else:
        source = node.module or ""
        if node.level:
            package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
            base = package[: len(package) - (node.level - 1)]
            source = ".".join([*base, *([node.module] if node.module else [])])
        targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names]
    found = set()
    for target in targets:
        while target not in modules and "." in target:  # `import a.b.c` of a module a.b
            target = target.rsplit(".", 1)[0]
        if target in modules and target != name:
            found.add(target)
    return found


def import_graph(root: Path = ROOT, packages: tuple[str, ...] = LAYERS) -> Graph:
    """Module -> the modules of `packages` it imports."""
    modules = module_files(root, packages)
    graph: Graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        graph[name] = set()
        for node in import_statements(tree):
            graph[name] |= imported_modules(name, path, node, modules)
    return graph


def cycles(graph: Graph) -> list[list[str]]:
    """One cycle through each group of modules that import one another (Tarjan's strongly
    connected components), as `[a, b, ..., a]`."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(graph[module]):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group = stack[stack.index(module) :]
            del stack[stack.index(module) :]
            if len(group) > 1:
                found.append(cycle_within(graph, set(group)))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def cycle_within(graph: Graph, group: set[str]) -> list[str]:
    """A cycle through the first module of `group`, whose modules all reach one another."""
    start = min(group)
    paths = {start: [start]}
    queue = [start]
    for module in queue:  # breadth first: the shortest way back to `start`
        for target in sorted(graph[module] & group):
            if target == start:
                return [*paths[module], start]
            if target not in paths:
                paths[target] = [*paths[module], target]
                queue.append(target)
    raise AssertionError(f"{sorted(group)} is not strongly connected")


def test_no_module_imports_itself_through_others() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in found)


def test_the_layers_import_downward_only() -> None:
    def layer(module: str) -> int:
        return LAYERS.index(module.split(".")[0])

    upward = sorted(
        f"{module} -> {target}" for module, targets in import_graph().items() for target in targets
        if layer(target) > layer(module)
    )  # fmt: skip
    assert not upward, "imports of a layer above (normalizer <- cache_client <- router):\n" + "\n".join(upward)


def test_the_graph_follows_relative_type_only_deferred_and_submodule_imports(tmp_path: Path) -> None:
    """The graph's rules on a package made for them: each import below is the only way one
    module reaches the next, and only the last closes the circle."""
    files = {
        "pkg/__init__.py": "from pkg.stages import Stage\n",  # a re-export: no edge back from pkg.stages
        "pkg/stages/__init__.py": "from .first import Stage\n",
        "pkg/stages/first.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..top import Top\nclass Stage: ...\n",
        "pkg/top.py": "def late():\n    from pkg import base\n",
        "pkg/base.py": "import pkg.stages.first\nfrom pkg.stages import Stage\n",
        "other/__init__.py": "",
        "other/leaf.py": "from pkg.base import nothing\nimport json\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path, ("pkg", "other"))
    assert graph == {
        "pkg": {"pkg.stages"},
        "pkg.stages": {"pkg.stages.first"},
        "pkg.stages.first": {"pkg.top"},
        "pkg.top": {"pkg.base"},
        "pkg.base": {"pkg.stages.first", "pkg.stages"},
        "other": set(),
        "other.leaf": {"pkg.base"},
    }
    assert cycles(graph) == [["pkg.base", "pkg.stages.first", "pkg.top", "pkg.base"]]
    graph["pkg.top"] = set()  # without the deferred import
    assert cycles(graph) == []
