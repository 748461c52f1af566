"""Optional extras: a command that needs one checks for its modules before it starts
anything, and names the extra to install when one is missing."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence


def missing_modules(modules: Sequence[str]) -> list[str]:
    """Those of `modules` that cannot be imported here (found without importing them)."""
    missing = []
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    return missing


def require_extra(prog: str, extra: str, modules: Sequence[str]) -> None:
    """Exit with status 2 and one line naming `extra` if a module of it is missing."""
    missing = missing_modules(modules)
    if missing:
        print(f"{prog}: needs the `{extra}` extra ({', '.join(missing)} missing): pip install 'kvroute[{extra}]'",
              file=sys.stderr)  # fmt: skip
        raise SystemExit(2)
