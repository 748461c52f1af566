"""The fleet: which workers exist, which are healthy, what models they serve.

Active health checks probe `GET /health` and `GET /v1/models` on every worker; passive
failures (a connection refused while forwarding) mark a worker down at once. A worker that
goes down loses its index entries: if it restarts, its KV cache is empty.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

import httpx
import orjson

from cache_client.redact import exc_summary
from cache_client.tiers import DEFAULT_NODE
from router.aio import cancel_and_wait
from router.breaker import BreakerSettings, CircuitBreaker

log = logging.getLogger("kvroute.workers")

BOTH, PREFILL, DECODE = "both", "prefill", "decode"
ROLES = (BOTH, PREFILL, DECODE)
"""A worker's part in a prefill/decode-disaggregated fleet: `both` serves whole requests
(and either side), `prefill` computes prompts for decode workers, `decode` generates."""


def check_role(role: str) -> str:
    """`role` if it is one of `ROLES` (llm-d's label values are the same words)."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, not {role!r}")
    return role


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    name: str
    url: str
    api_key: str | None = None
    """Credential sent to this worker (`Authorization: Bearer`), never the client's."""
    node: str | None = None
    """The node it runs on (its LMCache server's); None: as `--node` places it, else the
    default node."""
    role: str | None = None
    """Its part in a prefill/decode-disaggregated fleet (`ROLES`); None: as `--role` gives
    it, else `both`."""


@dataclass(slots=True)
class Worker:
    name: str
    url: str
    api_key: str | None = None
    node: str = DEFAULT_NODE
    """The node it runs on: the pool and disk tier it can load from (cache_client/tiers.py)."""
    role: str = BOTH
    """prefill, decode or both (router/policies/disagg.py): a fleet whose workers are all
    `both` is aggregated."""
    healthy: bool = False
    draining: bool = False
    models: frozenset[str] = frozenset()
    failures: int = 0
    """Consecutive failed health checks or forwards."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Last scraped engine gauges (vllm:num_requests_waiting, ...)."""
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    """Passive health from real traffic (router/breaker.py); open means no new requests."""

    @property
    def serving(self) -> bool:
        return self.healthy and not self.draining and self.breaker.admits()


def parse_worker_arg(arg: str) -> WorkerSpec:
    """`NAME=URL` or a bare `URL` (named after its host:port)."""
    name, sep, url = arg.partition("=")
    if not sep or "://" in name:
        url = arg
        name = url.split("://", 1)[-1].rstrip("/")
    url = url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"worker URL must start with http:// or https://: {arg!r}")
    return WorkerSpec(name=name, url=url)


SCRAPED_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


def parse_vllm_gauges(text: str) -> dict[str, float]:
    """Sum the few engine gauges we use over all their label sets."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in SCRAPED_GAUGES:
            try:
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
            except (ValueError, IndexError):
                continue
    return out


@dataclass(frozen=True)
class HealthSettings:
    """The `health` section of the router's config: active health checks of the fleet."""

    interval_s: float = 2.0
    unhealthy_after: int = 2
    """Consecutive failed checks that take a worker out of routing."""
    scrape_metrics: bool = False
    """Also read each worker's vLLM gauges (running, waiting, KV usage) on every check."""

    def fleet(
        self,
        specs: list[WorkerSpec],
        client: httpx.AsyncClient,
        *,
        on_down: Callable[[str], Awaitable[None]] | None = None,
        on_removed: Callable[[str], None] | None = None,
        on_added: Callable[[Worker], None] | None = None,
        breaker: BreakerSettings | None = None,
        nodes: Mapping[str, str] | None = None,
        roles: Mapping[str, str] | None = None,
    ) -> Fleet:
        return Fleet(
            specs, client, health_interval_s=self.interval_s, unhealthy_after=self.unhealthy_after,
            scrape_metrics=self.scrape_metrics, on_down=on_down, on_removed=on_removed, on_added=on_added,
            breaker=breaker, nodes=nodes, roles=roles,
        )


class Fleet:
    def __init__(
        self,
        specs: list[WorkerSpec],
        client: httpx.AsyncClient,
        *,
        health_interval_s: float = 2.0,
        health_timeout_s: float = 2.0,
        unhealthy_after: int = 2,
        scrape_metrics: bool = False,
        on_down: Callable[[str], Awaitable[None]] | None = None,
        on_removed: Callable[[str], None] | None = None,
        on_added: Callable[[Worker], None] | None = None,
        breaker: BreakerSettings | None = None,
        nodes: Mapping[str, str] | None = None,
        roles: Mapping[str, str] | None = None,
    ) -> None:
        """`on_down(name)`: a worker went down or was removed (its index entries go).
        `on_removed(name)`: it was removed for good (what the router learnt of it goes too:
        its load counts and learned costs, which a worker only down keeps). `on_added(worker)`:
        it joined (static, discovered or added by an operator). `nodes`: worker name -> node,
        for workers whose spec names none (`--node`); `roles`: worker name -> role, likewise
        (`--role`)."""
        self._client = client
        self.breaker_settings = breaker or BreakerSettings()
        self._workers: dict[str, Worker] = {}
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self.unhealthy_after = unhealthy_after
        self.scrape_metrics = scrape_metrics
        self._on_down = on_down
        self._on_removed = on_removed
        self._on_added = on_added
        self._nodes: Mapping[str, str] = nodes or {}
        self._roles: Mapping[str, str] = roles or {}
        self._task: asyncio.Task | None = None
        self._checking: dict[str, asyncio.Task] = {}
        """Health checks in flight, by worker: at most one each."""
        for spec in specs:
            self.add(spec)

    # -- membership -------------------------------------------------------------------
    def add(self, spec: WorkerSpec) -> Worker:
        if spec.name in self._workers:
            raise ValueError(f"worker {spec.name!r} already exists")
        node = spec.node if spec.node is not None else self._nodes.get(spec.name, DEFAULT_NODE)
        role = check_role(spec.role if spec.role is not None else self._roles.get(spec.name, BOTH))
        worker = Worker(spec.name, spec.url, spec.api_key, node, role)
        worker.breaker = CircuitBreaker(self.breaker_settings, spec.name)
        self._workers[spec.name] = worker
        if self._on_added is not None:
            self._on_added(worker)
        return worker

    async def remove(self, name: str) -> bool:
        worker = self._workers.pop(name, None)
        if worker is None:
            return False
        if self._on_down is not None:
            await self._on_down(name)
        if self._on_removed is not None:
            self._on_removed(name)
        return True

    def drain(self, name: str, draining: bool = True) -> bool:
        worker = self._workers.get(name)
        if worker is None:
            return False
        worker.draining = draining
        return True

    def get(self, name: str) -> Worker | None:
        return self._workers.get(name)

    def __iter__(self):
        return iter(list(self._workers.values()))

    def __len__(self) -> int:
        return len(self._workers)

    def names(self) -> list[str]:
        return list(self._workers)

    # -- selection --------------------------------------------------------------------
    def candidates(self, model: str | None) -> list[Worker]:
        """Serving workers that serve `model` (workers whose model list is unknown count)."""
        return [
            w
            for w in self._workers.values()
            if w.serving and (model is None or not w.models or model in w.models)
        ]

    def models(self) -> list[str]:
        seen: dict[str, None] = {}
        for w in self._workers.values():
            if w.healthy:
                for m in sorted(w.models):
                    seen.setdefault(m, None)
        return list(seen)

    def disaggregated(self) -> bool:
        """Some worker has a prefill or decode role: requests may be split between two."""
        return any(w.role != BOTH for w in self._workers.values())

    def any_serving(self) -> bool:
        return any(w.serving for w in self._workers.values())

    # -- health -----------------------------------------------------------------------
    async def mark_failed(self, name: str) -> None:
        """A forward to `name` failed before its first byte (connection refused, reset)."""
        worker = self._workers.get(name)
        if worker is None:
            return
        worker.failures += 1
        if worker.healthy:
            await self._set_down(worker, "forward failed")

    def mark_ok(self, name: str) -> None:
        worker = self._workers.get(name)
        if worker is not None:
            worker.failures = 0

    async def _set_down(self, worker: Worker, why: str) -> None:
        worker.healthy = False
        log.warning("worker %s is down (%s); its index entries are dropped", worker.name, why)
        if self._on_down is not None:
            await self._on_down(worker.name)

    def _headers(self, worker: Worker) -> dict[str, str]:
        return {"authorization": f"Bearer {worker.api_key}"} if worker.api_key else {}

    async def check(self, worker: Worker) -> bool:
        try:
            r = await self._client.get(
                worker.url + "/health", headers=self._headers(worker), timeout=self.health_timeout_s
            )
            ok = r.status_code == 200
            if ok:
                r = await self._client.get(
                    worker.url + "/v1/models", headers=self._headers(worker), timeout=self.health_timeout_s
                )
                if r.status_code == 200:
                    data = orjson.loads(r.content).get("data") or []
                    worker.models = frozenset(str(m.get("id")) for m in data if isinstance(m, dict))
            if ok and self.scrape_metrics:
                r = await self._client.get(worker.url + "/metrics", timeout=self.health_timeout_s)
                if r.status_code == 200:
                    worker.metrics = parse_vllm_gauges(r.text)
        except (httpx.HTTPError, orjson.JSONDecodeError, AttributeError, OSError) as exc:
            ok = False
            why = type(exc).__name__
        else:
            why = "unhealthy answer"
        if ok:
            if not worker.healthy:
                log.info("worker %s is up", worker.name)
                # Back from the dead (restarted): a circuit opened by its connection errors
                # lets a probe through now rather than when its open period ends.
                worker.breaker.probe_now()
            worker.healthy = True
            worker.failures = 0
        else:
            worker.failures += 1
            if worker.healthy and worker.failures >= self.unhealthy_after:
                await self._set_down(worker, why)
        return ok

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(w) for w in list(self._workers.values())))

    async def _check_one(self, worker: Worker) -> None:
        try:
            await self.check(worker)
        except Exception as exc:  # a bug here must not stop health checking
            log.error("health check of %s failed: %s", worker.name, exc_summary(exc))
        finally:
            self._checking.pop(worker.name, None)

    async def _loop(self) -> None:
        # Each worker is checked on its own schedule: a round that waited for every check
        # would let one slow worker (timing out under load) delay noticing that another
        # came back, or went away, by the whole health timeout.
        while True:
            await asyncio.sleep(self.health_interval_s)
            for worker in list(self._workers.values()):
                if worker.name not in self._checking:
                    self._checking[worker.name] = asyncio.create_task(
                        self._check_one(worker), name=f"kvroute-health-{worker.name}"
                    )

    async def start(self) -> None:
        await self.check_all()
        self._task = asyncio.create_task(self._loop(), name="kvroute-health")

    async def stop(self) -> None:
        await cancel_and_wait(self._task, *self._checking.values())
        self._task = None
        self._checking.clear()
