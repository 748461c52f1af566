"""`kvroute epp`: the endpoint picker's process. The router's config (same flags, `KVROUTE_*`
variables and YAML keys, plus the `epp` section) and its components (`build_services`),
served as:

* gRPC on `--epp-listen` (router/epp/h2grpc.py): Envoy's `ExternalProcessor/Process`
  (router/epp/picker.py) and the gRPC health protocol (`grpc.health.v1.Health`, Check and
  Watch): `liveness` serves while the process runs; `readiness` and the ext_proc service's
  name while a worker serves; "" (the server) always;
* HTTP on `--host`/`--port`: the router's own endpoints (/health, /ready, /metrics,
  /admin/*, /debug/route, /v1/models); the proxied ones answer 404, since requests come
  through the gateway.

SIGTERM: readiness goes to not serving, new streams are refused, and the ones in flight
get `--shutdown-grace-s` to finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import ssl
import sys
import tempfile
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from router.epp import require_epp_extra
from router.epp.protocol import EXT_PROC_SERVICE

if TYPE_CHECKING:
    import uvicorn

    from router.epp.h2grpc import GrpcServer
    from router.epp.picker import Picker
    from router.services import Services
    from router.workers import Fleet

log = logging.getLogger("kvroute.epp")

READINESS_INTERVAL_S = 1.0
"""How often readiness follows the fleet (a worker serving or none)."""
PROCESS = f"/{EXT_PROC_SERVICE}/Process"
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
HEALTH_WATCH = "/grpc.health.v1.Health/Watch"
GRPC_NOT_FOUND = 5


class GatewayOnly:
    """The picker's HTTP side: the router's app without its proxied endpoints (requests
    reach the workers through the gateway, never through the picker)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        from router.proxy.settings import PROXIED_PATHS, api_of
        from router.proxy.stateful import RESPONSES_BY_ID

        path = scope.get("path", "")
        if scope["type"] == "http" and (path in PROXIED_PATHS or path.startswith(RESPONSES_BY_ID)):
            from router.errors import RouterError
            from router.proxy.relay import send_whole

            error = RouterError(404, "kvroute epp picks endpoints for a gateway: send requests through the gateway.", "not_found")
            await send_whole(send, 404, error.headers(), error.body(api_of(path)))
            return
        await self.app(scope, receive, send)


class Health:
    """The gRPC health protocol's statuses, by service name, and the calls answering them."""

    def __init__(self) -> None:
        from grpc_health.v1 import health_pb2

        self.pb = health_pb2
        self.statuses: dict[str, int] = {}
        self.changed = asyncio.Event()

    def set(self, service: str, serving: bool) -> None:
        status = self.pb.HealthCheckResponse.SERVING if serving else self.pb.HealthCheckResponse.NOT_SERVING
        if self.statuses.get(service) != status:
            self.statuses[service] = status
            self.changed.set()
            self.changed = asyncio.Event()

    def _answer(self, service: str) -> bytes:
        status = self.statuses.get(service, self.pb.HealthCheckResponse.SERVICE_UNKNOWN)
        return self.pb.HealthCheckResponse(status=status).SerializeToString()

    async def check(self, call: Any) -> None:
        raw = await call.read()
        service = self.pb.HealthCheckRequest.FromString(raw or b"").service
        if service not in self.statuses:
            call.finish(GRPC_NOT_FOUND, f"unknown service {service}")
            return
        call.send(self._answer(service))

    async def watch(self, call: Any) -> None:
        raw = await call.read()
        service = self.pb.HealthCheckRequest.FromString(raw or b"").service
        while not call.closed:
            call.send(self._answer(service))
            await self.changed.wait()


def self_signed_certificate(days: int = 365) -> tuple[bytes, bytes]:
    """(key, certificate) in PEM, made now: a P-256 key and a certificate for it signed by
    itself, for gateways that encrypt to the picker without verifying it."""
    import datetime
    import ipaddress
    import socket

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvroute-epp")])
    now = datetime.datetime.now(datetime.timezone.utc)
    names: list[x509.GeneralName] = [x509.DNSName("localhost"), x509.DNSName(socket.gethostname()),
                                     x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]  # fmt: skip
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    return key_pem, cert.public_bytes(serialization.Encoding.PEM)


def tls_context(settings: Any) -> ssl.SSLContext | None:
    """The gRPC server's TLS context from the `epp` settings (ALPN h2); None: plaintext (h2c)."""
    if not settings.tls_cert_file and not settings.self_signed_tls:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["h2"])
    if settings.tls_cert_file:
        context.load_cert_chain(settings.tls_cert_file, settings.tls_key_file)
        return context
    key, cert = self_signed_certificate()
    # load_cert_chain reads files: the pair goes through a private directory, removed at once.
    with tempfile.TemporaryDirectory(prefix="kvroute-epp-tls-") as tmp:
        key_path, cert_path = os.path.join(tmp, "key.pem"), os.path.join(tmp, "cert.pem")
        for path, data in ((key_path, key), (cert_path, cert)):
            with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as fh:
                fh.write(data)
        context.load_cert_chain(cert_path, key_path)
    return context


def _quiet_uvicorn() -> Any:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn without its own signal handling: the picker stops both servers."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    return Server


async def serve(config: Any, environ: Mapping[str, str]) -> None:
    """Run the picker until SIGTERM or SIGINT."""
    from router.epp.picker import Picker
    from router.services import build_services, start_all, stop_all

    services = build_services(config, environ=environ)
    health = Health()
    server = _grpc_server(Picker(services.proxy, services.api_keys, services.tenants), health)
    listen = config.epp.listen
    host, _, port = listen.rpartition(":")
    try:
        context = tls_context(config.epp)
    except (OSError, ssl.SSLError) as exc:
        raise SystemExit(f"kvroute epp: cannot load the TLS certificate or key: {exc}") from None
    await start_all(services)
    health.set("", True)
    health.set("liveness", True)
    try:
        await server.start(host.strip("[]"), int(port), ssl=context)
    except OSError as exc:
        await stop_all(services.lifecycle)
        raise SystemExit(f"kvroute epp: cannot listen on {listen}: {exc.strerror}") from None
    http = _http_server(config, services)
    http_task = asyncio.create_task(http.serve(), name="kvroute-epp-http")
    stopping = _stopped_by_signals()
    log.info("kvroute epp: ext_proc on %s (%s), HTTP on %s:%d, %d workers, policy %s", listen,
             "TLS" if context is not None else "plaintext", config.server.host, config.server.port,
             len(services.fleet), services.policy.name)  # fmt: skip
    try:
        await _follow_readiness(services.fleet, health, stopping, http_task)
    finally:
        for name in ("readiness", EXT_PROC_SERVICE):
            health.set(name, False)
        await server.stop(config.server.shutdown_grace_s)
        http.should_exit = True
        with contextlib.suppress(Exception):
            await http_task
        await stop_all(services.lifecycle)


def _grpc_server(picker: Picker, health: Health) -> GrpcServer:
    """The gRPC side: Envoy's ext_proc `Process` (the picker) and the gRPC health protocol."""
    from router.epp.h2grpc import GrpcServer
    from router.epp.picker import CallStream

    async def process(call: Any) -> None:
        await picker.process(CallStream(call))

    return GrpcServer({PROCESS: process, HEALTH_CHECK: health.check, HEALTH_WATCH: health.watch})


def _http_server(config: Any, services: Services) -> uvicorn.Server:
    """The HTTP side: the router's own endpoints (`GatewayOnly`), served by uvicorn in this loop."""
    import uvicorn

    from router.app import KvrouteApp

    return _quiet_uvicorn()(uvicorn.Config(
        GatewayOnly(KvrouteApp(services)), host=config.server.host, port=config.server.port, loop="none",
        http="httptools", lifespan="off", log_level=config.server.log_level, access_log=False, server_header=False,
    ))  # fmt: skip


def _stopped_by_signals() -> asyncio.Event:
    """An event SIGTERM and SIGINT set."""
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    return stopping


async def _follow_readiness(fleet: Fleet, health: Health, stopping: asyncio.Event, http_task: asyncio.Task) -> None:
    """Readiness (and the ext_proc service's status) follows the fleet, a worker serving or
    none, until `stopping` is set or the HTTP server ends."""
    while not stopping.is_set() and not http_task.done():
        ready = fleet.any_serving()
        for name in ("readiness", EXT_PROC_SERVICE):
            health.set(name, ready)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stopping.wait(), READINESS_INTERVAL_S)


def cli(argv: list[str]) -> int:
    require_epp_extra()
    import uvloop

    from router.config_loader import environment, load_config
    from router.precise import require_precise_extra
    from router.serve import check_secrets, configure_logging

    environ = environment()
    config = load_config(argv, environ, prog="kvroute epp")
    check_secrets(config)
    if config.precise.tokenizer:
        require_precise_extra()
    configure_logging(config.server.log_level)
    if not config.workers and not config.discover:
        print("kvroute epp: give the pool's endpoints: --worker URL (repeatable) or --discover TARGET", file=sys.stderr)
        return 2
    if config.server.processes > 1:
        print("kvroute epp: runs one process (--processes 1); run more replicas sharing --redis instead", file=sys.stderr)
        return 2
    uvloop.run(serve(config, environ))
    return 0
