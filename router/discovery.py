"""Worker discovery: keep the fleet in step with a Kubernetes Service while the router runs.

Two sources, both polled:

* `dns://HOST:PORT` — resolve HOST (a headless Service, so one A/AAAA record per ready pod)
  every `interval_s` with the event loop's `getaddrinfo` (a thread-pool call: the loop never
  blocks on DNS). Each address becomes a worker named `IP:PORT` at `http://IP:PORT`.
* `k8s://NAMESPACE/SERVICE:PORT` — list the Service's EndpointSlices from the API server with
  the pod's service-account token. It sees readiness directly (and terminating pods), at
  the price of RBAC (`list` on `endpointslices` in NAMESPACE). It also sees where each pod
  runs: an endpoint's `nodeName` becomes its worker's node (`WorkerSpec.node`), the LMCache
  server whose pool and disk tier that worker loads from (cache_client/tiers.py). DNS
  cannot tell, so its workers are placed by `--node`, else on the default node. A pod's
  label `kvroute.io/role` (or llm-d's `llm-d.ai/role`: `prefill`, `decode`, `both`) becomes
  its worker's role in a disaggregated fleet (`WorkerSpec.role`), read once per pod from
  the endpoint's `targetRef` (RBAC: `get` on `pods`; without it, roles come from `--role`).

Membership diffs are applied with `Fleet.add` and `Fleet.remove`; `remove` runs the fleet's
`on_down` callback, which drops the leaving worker's index entries. Workers are named after
their pod IP on purpose: a restarted pod comes back with a new IP and an empty KV cache, so
it must not inherit the index entries of its predecessor. For the same reason a worker whose
node changes between two lookups (its address reused by a pod on another node) leaves and
joins again: it is a new pod, with an empty GPU cache, loading from another node's tiers.

A failed lookup (resolver error, API server unreachable) keeps the current membership:
health checks already stop routing to workers that are really gone, while wiping the fleet
on a DNS hiccup would throw away every worker's index entries.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import ssl
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

import httpx

from router.aio import cancel_and_wait
from router.workers import ROLES, Fleet, WorkerSpec

log = logging.getLogger("kvroute.discovery")

Resolver = Callable[[str], Awaitable[list[str]]]
"""HOST -> the addresses it resolves to now (an empty list: the name has no records)."""

Endpoints = dict[str, str | None]
"""Address of each ready worker -> the node it runs on (None: the source does not say)."""

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")

# getaddrinfo errors meaning "this name has no addresses", as opposed to "DNS is broken".
# A headless Service scaled to zero answers NXDOMAIN: that is an authoritative empty fleet.
_NO_ADDRESS_ERRORS = frozenset(
    code
    for code in (getattr(socket, "EAI_NONAME", None), getattr(socket, "EAI_NODATA", None))
    if code is not None
)


@dataclass(frozen=True, slots=True)
class DiscoveryTarget:
    scheme: str
    """"dns" or "k8s"."""
    host: str
    """DNS name to resolve (dns), or the Service name (k8s)."""
    port: int | str
    """Worker port. For k8s a name is allowed and matched against the EndpointSlice port names."""
    namespace: str | None = None
    """Namespace of the Service (k8s only)."""


def parse_discovery_target(target: str) -> DiscoveryTarget:
    """Parse `dns://HOST:PORT` or `k8s://NAMESPACE/SERVICE:PORT`; raise ValueError otherwise."""
    parts = urlsplit(target.strip())
    scheme = parts.scheme.lower()
    if scheme == "dns":
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise ValueError(f"dns discovery target must be dns://HOST:PORT: {target!r}")
        try:
            port = parts.port
        except ValueError as exc:
            raise ValueError(f"bad port in discovery target {target!r}") from exc
        if not parts.hostname or port is None:
            raise ValueError(f"dns discovery target needs a host and a port: {target!r}")
        return DiscoveryTarget("dns", parts.hostname, port)
    if scheme == "k8s":
        namespace = parts.netloc
        service, sep, port_s = parts.path.lstrip("/").rpartition(":")
        if not namespace or not sep or not service or "/" in service or not port_s:
            raise ValueError(
                f"k8s discovery target must be k8s://NAMESPACE/SERVICE:PORT: {target!r}"
            )
        port: int | str = int(port_s) if port_s.isdigit() else port_s
        if isinstance(port, int) and not 0 < port < 65536:
            raise ValueError(f"bad port in discovery target {target!r}")
        return DiscoveryTarget("k8s", service, port, namespace=namespace)
    raise ValueError(f"unknown discovery scheme in {target!r} (expected dns:// or k8s://)")


def _hostport(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def spec_for(ip: str, port: int, scheme: str = "http", node: str | None = None, role: str | None = None) -> WorkerSpec:
    """The worker a discovered address stands for: named `IP:PORT`, at `http://IP:PORT`, on
    `node` (None: wherever the fleet's `--node` map puts it), with `role` (None: as `--role`
    gives it)."""
    hostport = _hostport(ip, port)
    return WorkerSpec(name=hostport, url=f"{scheme}://{hostport}", node=node, role=role)


ROLE_LABELS = ("kvroute.io/role", "llm-d.ai/role")
"""Pod labels naming a worker's role, first found wins (llm-d's values are the same words)."""


def role_of(labels: Mapping[str, Any] | None) -> str | None:
    """A pod's role from its labels; None when none names one of `ROLES`."""
    for label in ROLE_LABELS:
        value = (labels or {}).get(label)
        if value in ROLES:
            return str(value)
    return None


def endpoint_pods(slices: Iterable[dict[str, Any]]) -> dict[str, str]:
    """Address -> the name of the pod behind it (the endpoint's `targetRef` of kind Pod)."""
    pods: dict[str, str] = {}
    for item in slices:
        for endpoint in item.get("endpoints") or []:
            ref = endpoint.get("targetRef") or {}
            if ref.get("kind") == "Pod" and ref.get("name"):
                for address in endpoint.get("addresses") or []:
                    pods[str(address)] = str(ref["name"])
    return pods


def kv_events_endpoint(spec: WorkerSpec, port: int = 5557) -> str:
    """The ZMQ endpoint a discovered vLLM worker publishes KV events on (same host, `port`)."""
    host = urlsplit(spec.url).hostname or ""
    return f"tcp://{_hostport(host, port)}"


async def system_resolver(host: str) -> list[str]:
    """Resolve with the loop's getaddrinfo (run in the default executor, never on the loop)."""
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        if exc.errno in _NO_ADDRESS_ERRORS:
            return []
        raise
    return [str(info[4][0]) for info in infos]


class _Source(Protocol):
    async def endpoints(self) -> Endpoints: ...


class _MembershipSync:
    """Apply address-set diffs to the fleet; shared by the DNS and EndpointSlice sources."""

    def __init__(
        self,
        fleet: Fleet,
        port: int,
        *,
        scheme: str,
        on_added: Callable[[WorkerSpec], Awaitable[None]] | None,
        on_removed: Callable[[str], Awaitable[None]] | None,
        check_new: bool,
    ) -> None:
        self.fleet = fleet
        self.port = port
        self.scheme = scheme
        self._on_added = on_added
        self._on_removed = on_removed
        self._check_new = check_new
        self._owned: dict[str, str | None] = {}
        """Name of each worker this sync added -> the node its spec was given."""
        self._clashes: set[str] = set()
        self.roles: Mapping[str, str | None] = {}
        """Address -> role, from the source's pod labels (none: as `--role` gives them)."""

    @property
    def members(self) -> list[str]:
        return sorted(self._owned)

    async def apply(self, endpoints: Mapping[str, str | None]) -> tuple[list[str], list[str]]:
        """Make the fleet's discovered workers those of `endpoints` (address -> node):
        (names added, names removed). A worker whose node changed is in both."""
        wanted = {
            spec.name: spec
            for spec in (
                spec_for(ip, self.port, self.scheme, node, self.roles.get(ip)) for ip, node in endpoints.items()
            )
        }
        # A moved worker leaves before it joins again under the same name; the others join
        # before the leavers go, so the fleet never looks empty while a whole set is replaced.
        moved = sorted(
            name for name, node in self._owned.items() if name in wanted and wanted[name].node != node
        )
        for name in moved:
            log.info(
                "worker %s moved from node %s to node %s; it joins again with an empty cache",
                name, self._owned.pop(name), wanted[name].node,
            )  # fmt: skip
            await self.fleet.remove(name)
        added: list[WorkerSpec] = []
        for name in sorted(wanted.keys() - self._owned.keys()):
            if self.fleet.get(name) is not None:
                # A statically configured worker with the same address: leave it alone (and
                # don't remove it later either), but say so once.
                if name not in self._clashes:
                    log.warning("discovered worker %s is already configured; not managing it", name)
                    self._clashes.add(name)
                continue
            self.fleet.add(wanted[name])
            self._owned[name] = wanted[name].node
            added.append(wanted[name])
        gone = sorted(self._owned.keys() - wanted.keys())
        for name in gone:
            del self._owned[name]
            await self.fleet.remove(name)
        self._clashes &= wanted.keys()
        for name in gone:
            log.info("worker %s left (no longer in discovery)", name)
        removed = sorted([*moved, *gone])
        if self._on_removed is not None:
            for name in removed:
                await self._on_removed(name)
        if added:
            log.info("workers joined: %s", ", ".join(s.name for s in added))
            if self._check_new:
                # Probe newcomers now instead of waiting for the next health round, so a
                # scaled-up worker takes traffic within one discovery interval.
                workers = [w for w in (self.fleet.get(s.name) for s in added) if w is not None]
                await asyncio.gather(
                    *(self.fleet.check(w) for w in workers), return_exceptions=True
                )
            if self._on_added is not None:
                for spec in added:
                    await self._on_added(spec)
        return [s.name for s in added], removed

    async def forget_all(self) -> None:
        for name in sorted(self._owned):
            await self.fleet.remove(name)
            if self._on_removed is not None:
                await self._on_removed(name)
        self._owned.clear()


class _Poller:
    """Poll a source every interval and sync the fleet; `start` syncs once before returning."""

    def __init__(
        self, source: _Source, sync: _MembershipSync, interval_s: float, describe: str
    ) -> None:
        if interval_s <= 0:
            raise ValueError("discovery interval must be positive")
        self._source = source
        self._sync = sync
        self.interval_s = interval_s
        self._describe = describe
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self.last_error: str | None = None

    @property
    def members(self) -> list[str]:
        """Names of the workers this discovery added and still manages."""
        return self._sync.members

    async def refresh(self) -> tuple[list[str], list[str]]:
        """One lookup and sync: (names added, names removed). Raises if the lookup fails."""
        async with self._lock:
            endpoints = await self._source.endpoints()
            result = await self._sync.apply(endpoints)
            self.last_error = None
            return result

    async def _refresh_logged(self) -> None:
        try:
            await self.refresh()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # keep the fleet as it is; see the module docstring
            self.last_error = f"{type(exc).__name__}: {exc}"
            log.warning(
                "discovery of %s failed, keeping %d workers: %s",
                self._describe,
                len(self.members),
                self.last_error,
            )

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self._refresh_logged()

    async def start(self) -> None:
        if self._task is not None:
            return
        await self._refresh_logged()
        self._task = asyncio.create_task(self._loop(), name=f"kvroute-discovery-{self._describe}")

    async def stop(self) -> None:
        """Stop polling. Discovered workers stay in the fleet (the router is shutting down)."""
        await cancel_and_wait(self._task)
        self._task = None


class _DnsSource:
    def __init__(self, host: str, resolver: Resolver) -> None:
        self.host = host
        self._resolver = resolver

    async def endpoints(self) -> Endpoints:
        out: Endpoints = {}
        for raw in await self._resolver(self.host):
            # Normalise (e.g. IPv6 zero compression) so the same pod keeps the same name,
            # and refuse non-addresses so a buggy resolver can't inject odd worker URLs.
            out[str(ipaddress.ip_address(raw.split("%", 1)[0]))] = None
        return out


class DnsDiscovery(_Poller):
    """Workers = the addresses of `dns://HOST:PORT`, re-resolved every `interval_s`.

    `on_added(spec)` / `on_removed(name)` run after the fleet changed (e.g. to subscribe to a
    newcomer's KV events at `kv_events_endpoint(spec)`), `on_removed` first for a worker that
    left and joined again (its node changed); `check_new` health-checks newcomers at
    once so they are routable before the fleet's next health round.
    """

    def __init__(
        self,
        fleet: Fleet,
        target: str,
        interval_s: float = 5.0,
        resolver: Resolver | None = None,
        *,
        on_added: Callable[[WorkerSpec], Awaitable[None]] | None = None,
        on_removed: Callable[[str], Awaitable[None]] | None = None,
        check_new: bool = True,
        scheme: str = "http",
    ) -> None:
        parsed = parse_discovery_target(target)
        if parsed.scheme != "dns" or not isinstance(parsed.port, int):
            raise ValueError(f"DnsDiscovery needs a dns://HOST:PORT target, not {target!r}")
        self.target = parsed
        sync = _MembershipSync(
            fleet,
            parsed.port,
            scheme=scheme,
            on_added=on_added,
            on_removed=on_removed,
            check_new=check_new,
        )
        super().__init__(
            _DnsSource(parsed.host, resolver or system_resolver), sync, interval_s, target
        )


# -- Kubernetes EndpointSlices --------------------------------------------------------------


def endpoint_slice_endpoints(
    slices: Iterable[dict[str, Any]], port: int | str
) -> tuple[Endpoints, int | None]:
    """Ready addresses in `slices` serving `port`, each with its endpoint's `nodeName` (None
    where the slice has none), and the resolved port number.

    `port` is a number (matched against the slices' port numbers) or a port name. Endpoints
    whose `conditions.ready` is false are skipped; a missing condition counts as ready, as
    the EndpointSlice API specifies.
    """
    endpoints: Endpoints = {}
    number: int | None = port if isinstance(port, int) else None
    for item in slices:
        ports = item.get("ports") or []
        match = None
        for p in ports:
            if (isinstance(port, int) and p.get("port") == port) or (
                isinstance(port, str) and p.get("name") == port
            ):
                match = p
                break
        if match is None:
            continue
        if number is None and isinstance(match.get("port"), int):
            number = match["port"]
        for endpoint in item.get("endpoints") or []:
            if (endpoint.get("conditions") or {}).get("ready") is False:
                continue
            node = endpoint.get("nodeName")
            node = str(node) if node else None
            for address in endpoint.get("addresses") or []:
                # An address can sit in two slices while the controller moves it; one that
                # names its node wins, so a slice without nodeName never unplaces a worker.
                if endpoints.get(str(address)) is None:
                    endpoints[str(address)] = node
    return endpoints, number


def endpoint_slice_addresses(
    slices: Iterable[dict[str, Any]], port: int | str
) -> tuple[list[str], int | None]:
    """Ready addresses in `slices` serving `port`, and the resolved port number (see
    `endpoint_slice_endpoints`, which also says each address's node)."""
    endpoints, number = endpoint_slice_endpoints(slices, port)
    return list(endpoints), number


class _EndpointSliceSource:
    def __init__(
        self, client: httpx.AsyncClient, namespace: str, service: str, port: int | str
    ) -> None:
        self._client = client
        self.path = f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
        self.pods_path = f"/api/v1/namespaces/{namespace}/pods/"
        self.params = {"labelSelector": f"kubernetes.io/service-name={service}"}
        self.port = port
        self.resolved_port: int | None = port if isinstance(port, int) else None
        self.roles: dict[str, str | None] = {}
        """Address -> its pod's role label (None: no role label, or the pod unreadable)."""
        self._pod_roles: dict[str, str | None] = {}
        self._pods_unreadable = False

    async def _roles(self, pods: Mapping[str, str]) -> dict[str, str | None]:
        """Each address's pod's role, each pod read once (a role is set when a pod starts)."""
        known = {name: self._pod_roles[name] for name in set(pods.values()) if name in self._pod_roles}
        for name in sorted(set(pods.values()) - known.keys()):
            try:
                r = await self._client.get(self.pods_path + name)
                r.raise_for_status()
                known[name] = role_of(((r.json() or {}).get("metadata") or {}).get("labels"))
            except (httpx.HTTPError, ValueError, AttributeError) as exc:
                if not self._pods_unreadable:
                    log.warning("cannot read pod labels for roles (%s); roles come from --role", type(exc).__name__)
                    self._pods_unreadable = True
                continue  # read again next time: RBAC may be granted meanwhile
        self._pod_roles = known
        return {address: known.get(name) for address, name in pods.items()}

    async def endpoints(self) -> Endpoints:
        r = await self._client.get(self.path, params=self.params)
        r.raise_for_status()
        items = r.json().get("items") or []
        endpoints, number = endpoint_slice_endpoints(items, self.port)
        self.roles = await self._roles({a: p for a, p in endpoint_pods(items).items() if a in endpoints})
        if number is not None:
            self.resolved_port = number
        if endpoints and self.resolved_port is None:
            raise LookupError(f"EndpointSlice port {self.port!r} has no number")
        return endpoints


def in_cluster_client(
    *,
    api_server: str | None = None,
    token_path: Path | None = None,
    ca_path: Path | None = None,
    timeout_s: float = 5.0,
    environ: Mapping[str, str] | None = None,
) -> httpx.AsyncClient:
    """An httpx client for the API server as the pod's service account sees it; without
    `api_server`, the one `environ` (the router's environment, router/config_loader.py)
    names in `KUBERNETES_SERVICE_HOST` / `_PORT`.

    The token is re-read on every request: Kubernetes rotates projected service-account tokens
    (hourly by default), and a token read once at start-up would expire under a long-running
    router.
    """
    sa = SERVICE_ACCOUNT_DIR
    if api_server is None:
        env = environ or {}
        host = env.get("KUBERNETES_SERVICE_HOST")
        port = env.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise RuntimeError("not running in a Kubernetes pod (KUBERNETES_SERVICE_HOST is unset)")
        api_server = f"https://{_hostport(host, int(port))}"
    token_file = token_path or sa / "token"
    ca_file = ca_path or sa / "ca.crt"

    async def add_token(request: httpx.Request) -> None:
        token = await asyncio.to_thread(token_file.read_text)
        request.headers["authorization"] = f"Bearer {token.strip()}"

    verify: ssl.SSLContext | bool = (
        ssl.create_default_context(cafile=str(ca_file)) if ca_file.exists() else True
    )
    return httpx.AsyncClient(
        base_url=api_server, verify=verify, timeout=timeout_s, event_hooks={"request": [add_token]}
    )


class EndpointSliceDiscovery(_Poller):
    """Workers = ready endpoints of `k8s://NAMESPACE/SERVICE:PORT`, listed every `interval_s`,
    each on the node its endpoint's `nodeName` names (none: placed as `--node` says).

    Pass `client` to talk to a specific API server (tests use a fake one on loopback);
    otherwise `in_cluster_client()` is used and closed by `stop()`.
    """

    def __init__(
        self,
        fleet: Fleet,
        target: str,
        interval_s: float = 5.0,
        client: httpx.AsyncClient | None = None,
        *,
        on_added: Callable[[WorkerSpec], Awaitable[None]] | None = None,
        on_removed: Callable[[str], Awaitable[None]] | None = None,
        check_new: bool = True,
        scheme: str = "http",
        environ: Mapping[str, str] | None = None,
    ) -> None:
        parsed = parse_discovery_target(target)
        if parsed.scheme != "k8s" or parsed.namespace is None:
            raise ValueError(
                f"EndpointSliceDiscovery needs a k8s://NAMESPACE/SERVICE:PORT target, not {target!r}"
            )
        self.target = parsed
        self._own_client = client is None
        self._client = client if client is not None else in_cluster_client(environ=environ)
        self._slices = _EndpointSliceSource(
            self._client, parsed.namespace, parsed.host, parsed.port
        )
        sync = _SlicePortSync(
            self._slices,
            fleet,
            scheme=scheme,
            on_added=on_added,
            on_removed=on_removed,
            check_new=check_new,
        )
        super().__init__(self._slices, sync, interval_s, target)

    async def stop(self) -> None:
        await super().stop()
        if self._own_client:
            await self._client.aclose()


class _SlicePortSync(_MembershipSync):
    """A named port is only known once a slice was read: take the number from the source."""

    def __init__(self, source: _EndpointSliceSource, fleet: Fleet, **kwargs: Any) -> None:
        super().__init__(fleet, source.resolved_port or 0, **kwargs)
        self._source = source

    async def apply(self, endpoints: Mapping[str, str | None]) -> tuple[list[str], list[str]]:
        if self._source.resolved_port is not None:
            self.port = self._source.resolved_port
        self.roles = self._source.roles
        return await super().apply(endpoints)


def make_discovery(
    fleet: Fleet,
    target: str,
    interval_s: float = 5.0,
    *,
    on_added: Callable[[WorkerSpec], Awaitable[None]] | None = None,
    on_removed: Callable[[str], Awaitable[None]] | None = None,
    environ: Mapping[str, str] | None = None,
) -> DnsDiscovery | EndpointSliceDiscovery:
    """The discovery for a `--discover` target (dns:// or k8s://); `environ` locates the
    Kubernetes API server for k8s:// (see `in_cluster_client`)."""
    scheme = parse_discovery_target(target).scheme
    if scheme == "dns":
        return DnsDiscovery(fleet, target, interval_s, on_added=on_added, on_removed=on_removed)
    return EndpointSliceDiscovery(
        fleet, target, interval_s, on_added=on_added, on_removed=on_removed, environ=environ
    )


async def start_discovery(
    fleet: Fleet,
    target: str,
    interval_s: float = 5.0,
    *,
    on_added: Callable[[WorkerSpec], Awaitable[None]] | None = None,
    on_removed: Callable[[str], Awaitable[None]] | None = None,
    environ: Mapping[str, str] | None = None,
) -> DnsDiscovery | EndpointSliceDiscovery:
    """Build the discovery for `target`, sync the fleet once and keep polling; `stop()` it."""
    discovery = make_discovery(
        fleet, target, interval_s, on_added=on_added, on_removed=on_removed, environ=environ
    )
    await discovery.start()
    return discovery
