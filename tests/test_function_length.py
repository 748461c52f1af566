"""Every function on the request path reads at once: 50 lines at most, from its `def` line
to the last line of its body (decorators aside; a nested function counts in its own right
and in the function around it). Read from the source with `ast`, nothing is imported."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 50

CHECKED = (
    "router/proxy/*.py", "router/epp/*.py", "router/app.py", "router/routing.py", "router/cost.py",
    "router/policies/*.py", "router/chain.py", "router/requests.py", "router/tracing.py", "router/load/*.py",
    "router/tenants/*.py", "normalizer/*.py", "cache_client/*.py",
    # Not the request path, but assembled from functions of the same size.
    "router/admin.py", "router/services.py",
)  # fmt: skip
"""The modules checked (globs under the repository root)."""

LONGER_FOR_NOW: set[str] = set()
"""Functions allowed over `MAX_LINES` for now (path::qualified name): none."""


def functions(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function and method in `tree`, nested ones too, by qualified name."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield prefix + node.name, node
            yield from functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from functions(node, f"{prefix}{node.name}.")
        else:
            yield from functions(node, prefix)


def lines(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    assert function.end_lineno is not None
    return function.end_lineno - function.lineno + 1  # `lineno` is the `def` line's, after decorators


def function_lengths() -> dict[str, int]:
    """path::qualified name -> lines, for every function of the checked modules."""
    lengths = {}
    for pattern in CHECKED:
        paths = sorted(ROOT.glob(pattern))
        assert paths, f"{pattern} matches no module: the list of checked modules is out of date"
        for path in paths:
            name = path.relative_to(ROOT).as_posix()
            for qualified, function in functions(ast.parse(path.read_text(encoding="utf-8"), filename=name)):
                lengths[f"{name}::{qualified}"] = lines(function)
    return lengths


def test_request_path_functions_fit_in_fifty_lines() -> None:
    too_long = sorted(
        f"{name}: {count} lines" for name, count in function_lengths().items()
        if count > MAX_LINES and name not in LONGER_FOR_NOW
    )  # fmt: skip
    assert not too_long, f"functions over {MAX_LINES} lines (split them into named steps):\n" + "\n".join(too_long)


def test_the_functions_allowed_longer_still_are() -> None:
    lengths = function_lengths()
    stale = sorted(name for name in LONGER_FOR_NOW if lengths.get(name, 0) <= MAX_LINES)
    assert not stale, f"no longer over {MAX_LINES} lines (or gone): remove from LONGER_FOR_NOW:\n" + "\n".join(stale)


def test_lengths_count_from_the_def_line_and_nested_functions_on_their_own() -> None:
    source = "class A:\n    @property\n    def f(self):\n        def g():\n            return 1\n\n        return g\n"
    assert {name: lines(f) for name, f in functions(ast.parse(source))} == {"A.f": 5, "A.f.g": 2}
