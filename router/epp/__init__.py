"""kvroute as a Gateway API Inference Extension endpoint picker (`kvroute epp`).

A gateway (Envoy, Istio, kgateway, ...) asks the picker, over Envoy's external processing
gRPC stream, which endpoint of its `InferencePool` takes each request; the picker answers
on the proxy's decision path (router/epp/picker.py) and the gateway carries the bytes.
`kvroute envoy-config` prints an Envoy bootstrap to try it with (router/epp/envoy_config.py).

This module stays importable without the `epp` extra (HPACK, the ext_proc and health
stubs): the command checks for it first and says which extra it needs.
"""

from __future__ import annotations

import importlib.util
import sys

EPP_MODULES = ("hpack", "grpc_health.v1.health_pb2", "envoy.service.ext_proc.v3.external_processor_pb2")
INSTALL_EPP = "pip install 'kvroute[epp]'"


def missing_modules() -> list[str]:
    """The `epp` extra's modules that cannot be found here (looked up, not imported)."""
    missing = []
    for name in EPP_MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    return missing


def require_epp_extra(prog: str = "kvroute epp") -> None:
    """Exit with status 2 and one line naming the extra if a module of it is missing."""
    missing = missing_modules()
    if missing:
        print(f"{prog}: needs the `epp` extra ({', '.join(missing)} missing): {INSTALL_EPP}", file=sys.stderr)
        raise SystemExit(2)
