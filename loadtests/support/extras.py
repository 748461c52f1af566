"""What the load-test commands need beyond `pip install kvroute`: the `bench` extra.

`kvroute serve` and the simulator need neither psutil (process CPU and memory readings)
nor matplotlib (plots), so they are the `bench` extra, not core dependencies. A command
that uses them checks first, before it starts any process or writes anything: a
`kvroute bench` run used to die on the missing matplotlib after four minutes of
measurements, with only its per-request log written.
"""

from __future__ import annotations

from collections.abc import Sequence

from router.extras import require_extra

BENCH_MODULES = ("psutil", "matplotlib")


def require_bench_extra(prog: str, modules: Sequence[str] = BENCH_MODULES) -> None:
    """Exit with status 2 and one line naming the extra if a module of it is missing."""
    require_extra(prog, "bench", modules)
