"""What the load-test commands need beyond `pip install kvroute`: the `bench` extra.

`kvroute serve` and the simulator need neither psutil (process CPU and memory readings)
nor matplotlib (plots), so they are the `bench` extra, not core dependencies. A command
that uses them checks first, before it starts any process or writes anything: a
`kvroute bench` run used to die on the missing matplotlib after four minutes of
measurements, with only its per-request log written.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence

BENCH_MODULES = ("psutil", "matplotlib")
INSTALL_BENCH = "pip install 'kvroute[bench]'"


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


def require_bench_extra(prog: str, modules: Sequence[str] = BENCH_MODULES) -> None:
    """Exit with status 2 and one line naming the extra if a module of it is missing."""
    missing = missing_modules(modules)
    if missing:
        print(f"{prog}: needs the `bench` extra ({', '.join(missing)} missing): {INSTALL_BENCH}", file=sys.stderr)
        raise SystemExit(2)
