"""`pip install kvroute` with no extras: the router and the simulator run; the commands that
need the `bench` extra (psutil, matplotlib) say so in one line and exit 2 before they start
any process or write anything.

"Not installed" is played in a fresh interpreter by a meta-path finder that refuses the
modules, with process creation turned into an error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import contextlib, io, json, os, subprocess, sys

    BLOCKED = {"psutil", "matplotlib"}

    class NotInstalled:
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, NotInstalled())

    def no_process(*args, **kwargs):
        raise AssertionError(f"a process was started: {args[1:2]!r}")

    subprocess.Popen.__init__ = no_process
    os.fork = os.posix_spawn = no_process

    def call(fn, *args):
        err, out = io.StringIO(), io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            try:
                code = fn(*args)
            except SystemExit as exc:
                code = exc.code
        return {"code": code, "stderr": err.getvalue(), "stdout": out.getvalue()}

    from router.cli import main
    from router.serve import load_config, make_app

    out_dir = sys.argv[1]
    results = {}
    app = make_app(load_config(["--worker", "w0=http://127.0.0.1:9"]))
    results["app"] = type(app).__name__
    for name in ("serve", "sim-worker", "sim-cluster", "sim-pool", "demo"):
        results[name] = call(main, [name, "--help"])
    results["bench"] = call(main, ["bench", "--scenario", "seed", "--out", out_dir + "/bench"])
    results["bench-proxy"] = call(main, ["bench-proxy", "--out", out_dir + "/proxy"])
    from loadtests.e2e import faults, soak

    results["faults"] = call(faults.main, ["--out", out_dir + "/faults"])
    results["soak"] = call(soak.main, ["--out", out_dir + "/soak"])
    results["loaded"] = sorted(BLOCKED & set(sys.modules))
    BLOCKED = {"matplotlib"}  # psutil installed, matplotlib not
    results["bench-no-matplotlib"] = call(main, ["bench", "--scenario", "seed", "--out", out_dir + "/bench"])
    print(json.dumps(results))
    """
)


def test_router_and_simulator_need_no_extra_and_bench_commands_name_it(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert results["app"]
    for name in ("serve", "sim-worker", "sim-cluster", "sim-pool", "demo"):
        assert results[name]["code"] == 0, (name, results[name])
        assert "--help" in results[name]["stdout"], name
    assert "--worker" in results["serve"]["stdout"]
    for name in ("bench", "bench-proxy", "faults", "soak", "bench-no-matplotlib"):
        r = results[name]
        assert r["code"] == 2, (name, r)
        lines = r["stderr"].strip().splitlines()
        assert len(lines) == 1, (name, r["stderr"])
        assert "pip install 'kvroute[bench]'" in lines[0], (name, lines[0])
    assert "psutil" in results["bench"]["stderr"] and "matplotlib" in results["bench"]["stderr"]
    assert "psutil" not in results["bench-no-matplotlib"]["stderr"]
    assert "matplotlib" in results["bench-no-matplotlib"]["stderr"]
    assert results["loaded"] == []
    # Nothing written: the check comes before the output directory.
    assert list(tmp_path.iterdir()) == []
