"""The `epp` section of the router's config: what only `kvroute epp` reads."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EppSettings:
    """`kvroute epp`'s own settings; the rest of its config (workers, routing, tenants,
    admission, ...) is the router's, read from the same flags, variables and YAML keys."""

    listen: str = "127.0.0.1:9002"
    """HOST:PORT of its gRPC server: the ext_proc service the gateway calls and the gRPC
    health service (liveness, readiness, the ext_proc service's name). Its HTTP side
    (/metrics, /ready, /admin, /debug/route) is the router's --host and --port."""
    tls_cert_file: str | None = None
    """Serve gRPC over TLS with this certificate (PEM; with `tls_key_file`). Gateways that
    dial pickers over TLS (kgateway; Istio with a DestinationRule) need it or `self_signed_tls`."""
    tls_key_file: str | None = None
    self_signed_tls: bool = False
    """Serve gRPC over TLS with a certificate made at start: for gateways that encrypt
    without verifying the picker's certificate, as the protocol's reference picker expects."""

    def __post_init__(self) -> None:
        host, sep, port = self.listen.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"epp.listen must be HOST:PORT, not {self.listen!r}")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("epp TLS needs both tls_cert_file and tls_key_file")
        if self.tls_cert_file and self.self_signed_tls:
            raise ValueError("epp TLS: give a certificate or self_signed_tls, not both")
