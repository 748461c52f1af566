"""The endpoint picker protocol's names (Gateway API Inference Extension, proposal 004):
headers, metadata namespaces and keys, and the gRPC services a picker serves. Plain
strings: the Envoy bootstrap generator uses them without the `epp` extra."""

from __future__ import annotations

DESTINATION_ENDPOINT = "x-gateway-destination-endpoint"
"""Request header and `envoy.lb` metadata key: the chosen endpoint, then the fallbacks."""
SERVED_ENDPOINT = "x-gateway-destination-endpoint-served"
"""`envoy.lb` metadata key the gateway sets on the response: the endpoint that served it."""
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
"""Key, in the `envoy.lb.subset_hint` namespace, of the endpoints the picker must choose among."""
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
HEALTH_SERVICES = ("liveness", "readiness", EXT_PROC_SERVICE)
"""The gRPC health services a picker answers (besides the server's own, "")."""
