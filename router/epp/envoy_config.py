"""`kvroute envoy-config`: an Envoy bootstrap that routes through `kvroute epp`, for trying
the picker locally (docs/epp.md shows the Kubernetes manifests for the gateways).

    kvroute envoy-config --listen 127.0.0.1:8080 --epp 127.0.0.1:9002 \
        --worker http://127.0.0.1:8001 --worker http://127.0.0.1:8002 > envoy.yaml
    envoy -c envoy.yaml

What it prints:

* a listener whose HTTP filters are the ext_proc filter (the request body in
  `FULL_DUPLEX_STREAMED` mode, as the endpoint picker protocol asks; responses streamed to
  the picker too, which observes them) and the router;
* the pool's cluster, `kvroute_pool`. By default its endpoints are the workers given (or the
  addresses of a `dns://HOST:PORT` target) under Envoy's `override_host` load-balancing
  policy: each try goes to the next endpoint of the picker's list
  (`x-gateway-destination-endpoint` in the `envoy.lb` metadata), and the endpoint chosen is
  written back as `x-gateway-destination-endpoint-served`, which the picker reads from the
  response's metadata. Retries (`--max-attempts` tries) walk the picker's fallbacks. When
  the picker gave no list (it is down and `--failure-mode-allow` let the request through),
  the policy falls back to round robin over the pool.
* with `--original-dst`, an `ORIGINAL_DST` cluster on the `x-gateway-destination-endpoint`
  header instead: Envoy needs no endpoint list, but parses the header as one `ip:port`, so
  the picker must name one endpoint (`kvroute epp --max-attempts 1`) and a failed try is
  not moved to another endpoint;
* the picker's cluster, `kvroute_epp` (HTTP/2, health-checked with the gRPC health
  protocol on the ext_proc service's name); with `--epp-tls`, dialled over TLS without
  verifying the picker's certificate (`kvroute epp --epp-self-signed-tls`), as kgateway does.

`--failure-mode-allow`: what Envoy does while the picker cannot be reached. Off (the
default, `FailClose`): such requests fail (HTTP 500). On (`FailOpen`): they go on unrouted,
to an endpoint the cluster's own policy picks (round robin; with `--original-dst`, there is
none to pick). Envoy fails open only while it still holds the request's body, so with it
the request body goes to the picker BUFFERED (the picker answers the same protocol there:
its destination and the canonical body come with the body's answer).
"""

from __future__ import annotations

import argparse
import ipaddress
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import yaml

from router.epp.protocol import (
    DESTINATION_ENDPOINT,
    EXT_PROC_SERVICE,
    LB_NAMESPACE,
    SERVED_ENDPOINT,
    SUBSET_NAMESPACE,
)

_HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
_EXT_PROC = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"
_ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
_HTTP_OPTIONS = "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
_OVERRIDE_HOST = "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost"
_ROUND_ROBIN = "type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin"
_TLS = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"
_HEADER_TO_METADATA = "type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config"

SUBSET_TEST_HEADER = "x-kvroute-test-subset"
"""With `subset_header`, a request header whose value Envoy puts in the subset hint (tests:
a gateway sets the hint from its own routing, which a local bootstrap has none of)."""


def host_port(text: str) -> tuple[str, int]:
    """`HOST:PORT` (`[V6]:PORT` for an IPv6 address)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def _address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _endpoint(host: str, port: int) -> dict[str, Any]:
    return {"endpoint": {"address": _address(host, port)}}


def _resolved(host: str) -> str:
    """An IP literal for `host`: the override_host policy matches the picker's `ip:port`
    strings against the cluster's resolved addresses."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]


@dataclass
class EnvoyBootstrap:
    """What `kvroute envoy-config` prints, as data (tests and `kvroute bench --via envoy`
    build it directly)."""

    listen: tuple[str, int]
    epp: tuple[str, int]
    endpoints: list[tuple[str, int]] = field(default_factory=list)
    """The pool's endpoints (a STATIC cluster); empty with `dns` or `original_dst`."""
    dns: tuple[str, int] | None = None
    """A name whose addresses are the pool (a STRICT_DNS cluster)."""
    original_dst: bool = False
    max_attempts: int = 3
    failure_mode_allow: bool = False
    admin: tuple[str, int] | None = None
    response_body_mode: str = "FULL_DUPLEX_STREAMED"
    request_body_mode: str | None = None
    """FULL_DUPLEX_STREAMED (the protocol's), or BUFFERED: Envoy keeps the body until the
    picker answers, so it can still send the request on unrouted if the picker fails
    (FULL_DUPLEX_STREAMED fails open only until the body's first chunk has gone to the
    picker, which a request arriving whole passes at once). None: BUFFERED with
    `failure_mode_allow`, else FULL_DUPLEX_STREAMED."""
    message_timeout_s: float = 30.0
    """How long Envoy waits for each of the picker's answers (its decision may wait in the
    admission queue: keep above --queue-timeout-s)."""
    subset_header: bool = False
    """Tests only: `SUBSET_TEST_HEADER` sets the subset hint."""
    picker: bool = True
    """False: no picker at all, Envoy balancing the endpoints round robin (the baseline the
    picker's added latency is measured against)."""
    epp_tls: bool = False
    """Dial the picker over TLS without verifying its certificate (`kvroute epp
    --epp-self-signed-tls`), as kgateway does."""

    def to_dict(self) -> dict[str, Any]:
        """Envoy's bootstrap: the gateway's listener, the pool's cluster and the picker's."""
        clusters = [self._pool(), self._epp_cluster()] if self.picker else [self._pool()]
        bootstrap: dict[str, Any] = {"static_resources": {"listeners": [self._listener()], "clusters": clusters}}
        if self.admin is not None:
            bootstrap["admin"] = {"address": _address(*self.admin)}
        return bootstrap

    def _listener(self) -> dict[str, Any]:
        """Every request to the pool, through the HTTP filters (`_http_filters`)."""
        route = {
            "cluster": "kvroute_pool",
            # Streams last as long as generation does; the picker's idle timeout is the workers'.
            "timeout": "0s",
            "idle_timeout": "300s",
            "retry_policy": self._retry_policy(),
        }
        return {
            "name": "kvroute_gateway",
            "address": _address(*self.listen),
            "filter_chains": [{"filters": [{
                "name": "envoy.filters.network.http_connection_manager",
                "typed_config": {
                    "@type": _HCM,
                    "stat_prefix": "kvroute_gateway",
                    "route_config": {"name": "pool", "virtual_hosts": [{
                        "name": "pool", "domains": ["*"], "routes": [{"match": {"prefix": "/"}, "route": route}],
                    }]},
                    "http_filters": self._http_filters(),
                    "stream_idle_timeout": "300s",
                },
            }]}],
        }  # fmt: skip

    def _retry_policy(self) -> dict[str, Any]:
        return {
            # Failures before the response began: refused or reset connections, and a 5xx
            # answer (as kvroute serve retries them), each on the picker's next endpoint.
            "retry_on": "connect-failure,refused-stream,reset-before-request,retriable-status-codes",
            "retriable_status_codes": [500, 502, 503, 504],
            "num_retries": max(self.max_attempts - 1, 0),
            "retry_back_off": {"base_interval": "0.001s", "max_interval": "0.01s"},
        }

    def _http_filters(self) -> list[dict[str, Any]]:
        """The test header that sets the subset hint (`subset_header`), the picker (unless
        `picker` is off), and the router."""
        http_filters: list[dict[str, Any]] = []
        if self.subset_header:
            http_filters.append({
                "name": "envoy.filters.http.header_to_metadata",
                "typed_config": {
                    "@type": _HEADER_TO_METADATA,
                    "request_rules": [{
                        "header": SUBSET_TEST_HEADER,
                        "on_header_present": {"metadata_namespace": SUBSET_NAMESPACE, "key": "x-gateway-destination-endpoint-subset", "type": "STRING"},
                        "remove": True,
                    }],
                },
            })  # fmt: skip
        if self.picker:
            http_filters.append(self._ext_proc_filter())
        http_filters.append({"name": "envoy.filters.http.router", "typed_config": {"@type": _ROUTER, "suppress_envoy_headers": True}})
        return http_filters

    def _ext_proc_filter(self) -> dict[str, Any]:
        """The picker, as Envoy's ext_proc filter: what it is sent of each request and answer."""
        return {
            "name": "envoy.filters.http.ext_proc",
            "typed_config": {
                "@type": _EXT_PROC,
                "grpc_service": {"envoy_grpc": {"cluster_name": "kvroute_epp"}},
                "failure_mode_allow": self.failure_mode_allow,
                "processing_mode": {
                    "request_header_mode": "SEND",
                    "response_header_mode": "SEND",
                    "request_body_mode": self.request_mode(),
                    "response_body_mode": self.response_body_mode,
                    # FULL_DUPLEX_STREAMED bodies need their trailers sent (they end the body).
                    "request_trailer_mode": "SEND" if self.request_mode() == "FULL_DUPLEX_STREAMED" else "SKIP",
                    "response_trailer_mode": "SEND" if self.response_body_mode == "FULL_DUPLEX_STREAMED" else "SKIP",
                },
                "message_timeout": f"{self.message_timeout_s:g}s",
                "metadata_options": {
                    "forwarding_namespaces": {"untyped": [LB_NAMESPACE, SUBSET_NAMESPACE]},
                    "receiving_namespaces": {"untyped": [LB_NAMESPACE]},
                },
                # Where the response came from: the upstream address (for a cluster that
                # writes no served-endpoint metadata, ORIGINAL_DST) and whether Envoy
                # answered itself (no endpoint reached).
                "response_attributes": ["upstream.address", "response.code_details"],
            },
        }  # fmt: skip

    def request_mode(self) -> str:
        if self.request_body_mode is not None:
            return self.request_body_mode
        return "BUFFERED" if self.failure_mode_allow else "FULL_DUPLEX_STREAMED"

    def _pool(self) -> dict[str, Any]:
        limits = {"thresholds": [{"max_connections": 100000, "max_pending_requests": 100000, "max_requests": 100000, "max_retries": 100000}]}
        if self.original_dst:
            return {
                "name": "kvroute_pool", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED",
                "connect_timeout": "5s", "circuit_breakers": limits,
                "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION_ENDPOINT},
            }  # fmt: skip
        if self.dns is not None:
            kind, endpoints = "STRICT_DNS", [_endpoint(*self.dns)]
        else:
            if not self.endpoints:
                raise ValueError("the pool needs endpoints (--worker), a dns:// target (--discover) or --original-dst")
            kind, endpoints = "STATIC", [_endpoint(_resolved(h), p) for h, p in self.endpoints]
        override = {
            "@type": _OVERRIDE_HOST,
            "override_host_sources": [{"metadata": {"key": LB_NAMESPACE, "path": [{"key": DESTINATION_ENDPOINT}]}}],
            "selected_host_key": {"key": LB_NAMESPACE, "path": [{"key": SERVED_ENDPOINT}]},
            "fallback_policy": {"policies": [{"typed_extension_config": {
                "name": "envoy.load_balancing_policies.round_robin", "typed_config": {"@type": _ROUND_ROBIN},
            }}]},
        }  # fmt: skip
        pool = {
            "name": "kvroute_pool", "type": kind, "connect_timeout": "5s", "circuit_breakers": limits,
            "load_assignment": {"cluster_name": "kvroute_pool", "endpoints": [{"lb_endpoints": endpoints}]},
        }
        if not self.picker:
            return pool
        return {
            **pool,
            "load_balancing_policy": {"policies": [{"typed_extension_config": {
                "name": "envoy.load_balancing_policies.override_host", "typed_config": override,
            }}]},
        }  # fmt: skip

    def _epp_cluster(self) -> dict[str, Any]:
        host, port = self.epp
        try:
            ipaddress.ip_address(host)
            kind = "STATIC"
        except ValueError:
            kind = "STRICT_DNS"
        return {
            "name": "kvroute_epp", "type": kind, "connect_timeout": "1s",
            "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": _HTTP_OPTIONS, "explicit_http_config": {"http2_protocol_options": {}},
            }},
            "circuit_breakers": {"thresholds": [{"max_connections": 100000, "max_pending_requests": 100000, "max_requests": 100000}]},
            "load_assignment": {"cluster_name": "kvroute_epp", "endpoints": [{"lb_endpoints": [_endpoint(host, port)]}]},
            **({"transport_socket": {"name": "envoy.transport_sockets.tls", "typed_config": {
                "@type": _TLS, "common_tls_context": {"alpn_protocols": ["h2"]},
            }}} if self.epp_tls else {}),
            "health_checks": [{
                "timeout": "1s", "interval": "2s", "unhealthy_threshold": 2, "healthy_threshold": 1,
                "grpc_health_check": {"service_name": EXT_PROC_SERVICE},
            }],
        }  # fmt: skip

    def yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)


def _workers(items: Sequence[str]) -> list[tuple[str, int]]:
    from router.workers import parse_worker_arg

    out = []
    for item in items:
        for one in (x for x in item.split(",") if x):
            parts = urlsplit(parse_worker_arg(one).url)
            if parts.hostname is None or parts.port is None:
                raise ValueError(f"a worker URL needs a host and a port: {one!r}")
            out.append((parts.hostname, parts.port))
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvroute envoy-config",
        description="Print an Envoy bootstrap (YAML) that asks `kvroute epp` where each request goes.",
    )
    p.add_argument("--listen", required=True, help="HOST:PORT Envoy serves clients on")
    p.add_argument("--epp", required=True, help="HOST:PORT of kvroute epp (its --epp-listen)")
    p.add_argument("--worker", action="append", default=[], help="a pool endpoint as URL or NAME=URL (repeatable), as given to kvroute epp")
    p.add_argument("--discover", default=None, help="dns://HOST:PORT: the pool is that name's addresses")
    p.add_argument("--original-dst", action="store_true", help="an ORIGINAL_DST cluster on the endpoint header (one endpoint, no fallbacks)")
    p.add_argument("--max-attempts", type=int, default=3, help="tries per request, each on the picker's next endpoint")
    p.add_argument("--failure-mode-allow", action=argparse.BooleanOptionalAction, default=False,
                   help="let requests through unrouted while the picker cannot be reached (FailOpen)")
    p.add_argument("--epp-tls", action="store_true", help="dial the picker over TLS, unverified (kvroute epp --epp-self-signed-tls)")
    p.add_argument("--admin", default=None, help="HOST:PORT of Envoy's admin interface (none by default)")
    p.add_argument("--request-body-mode", default=None, choices=("FULL_DUPLEX_STREAMED", "BUFFERED"),
                   help="how requests reach the picker (default: BUFFERED with --failure-mode-allow, which can fail open "
                   "only with a buffered body; else FULL_DUPLEX_STREAMED)")
    p.add_argument("--response-body-mode", default="FULL_DUPLEX_STREAMED", choices=("FULL_DUPLEX_STREAMED", "STREAMED", "NONE"),
                   help="how responses reach the picker (NONE: it learns no first-token times, usage or Responses ids)")
    return p


def cli(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        dns = None
        if args.discover:
            from router.discovery import parse_discovery_target

            target = parse_discovery_target(args.discover)
            if target.scheme != "dns" or not isinstance(target.port, int):
                raise ValueError("--discover takes a dns://HOST:PORT target here")
            dns = (target.host, target.port)
        bootstrap = EnvoyBootstrap(
            listen=host_port(args.listen), epp=host_port(args.epp), endpoints=_workers(args.worker), dns=dns,
            original_dst=args.original_dst, max_attempts=args.max_attempts, failure_mode_allow=args.failure_mode_allow,
            admin=host_port(args.admin) if args.admin else None, response_body_mode=args.response_body_mode,
            epp_tls=args.epp_tls, request_body_mode=args.request_body_mode,
        )
        text = bootstrap.yaml()
    except (ValueError, OSError) as exc:
        print(f"kvroute envoy-config: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    return 0
