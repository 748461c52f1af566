"""kvroute as a Gateway API Inference Extension endpoint picker (`kvroute epp`).

A gateway (Envoy, Istio, kgateway, ...) asks the picker, over Envoy's external processing
gRPC stream, which endpoint of its `InferencePool` takes each request; the picker answers
on the proxy's decision path (router/epp/picker.py) and the gateway carries the bytes.
`kvroute envoy-config` prints an Envoy bootstrap to try it with (router/epp/envoy_config.py).

This module stays importable without the `epp` extra (HPACK, the ext_proc and health
stubs): the command checks for it first and says which extra it needs.
"""

from __future__ import annotations

from router.extras import require_extra

EPP_MODULES = ("hpack", "grpc_health.v1.health_pb2", "envoy.service.ext_proc.v3.external_processor_pb2")


def require_epp_extra(prog: str = "kvroute epp") -> None:
    """Exit with status 2 and one line naming the extra if a module of it is missing."""
    require_extra(prog, "epp", EPP_MODULES)
