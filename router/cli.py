"""The `kvroute` command: `serve` (the router) plus the simulator, demo and benchmarks.

Each subcommand lives in its own module and exposes `cli(argv) -> int`; importing them
lazily keeps `kvroute serve` from loading the simulator or plotting libraries.
"""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("router.serve", "run the router"),
    "epp": ("router.epp.server", "run as a Gateway API Inference Extension endpoint picker"),
    "envoy-config": ("router.epp.envoy_config", "print an Envoy bootstrap that routes through kvroute epp"),
    "demo": ("loadtests.e2e.demo", "simulated cluster + router + workload: random vs cache_aware TTFT"),
    "sim-worker": ("loadtests.sim.worker", "one simulated vLLM worker"),
    "sim-pool": ("loadtests.sim.pool", "the simulated shared LMCache CPU pool"),
    "sim-cluster": ("loadtests.sim.cluster", "a pool and N simulated workers in one process"),
    "bench": ("loadtests.benchmark.bench", "multi-turn benchmark of policies and peer routers"),
    "bench-proxy": ("loadtests.benchmark.bench_proxy", "router overhead and relay throughput benchmark"),
}


def _usage() -> str:
    lines = ["usage: kvroute COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<13} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from router import __version__

        print(__version__)
        return 0
    command, rest = argv[0], argv[1:]
    if command not in SUBCOMMANDS:
        print(f"kvroute: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[command][0])
    return int(module.cli(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
