"""Fixtures shared by every test area: a simulated vLLM fleet, a real Redis Cluster, a
recording upstream and a router process, each started once per test module.

A module shapes them with markers on `pytestmark`, whose keyword arguments are passed
through unchanged (so each module's fleet or router stays as it was when the module built
its own):

    pytestmark = [pytest.mark.sim_cluster(workers=2, time_scale=4.0, pool=False),
                  pytest.mark.router_process(policy="least_loaded")]

`router` fronts the module's simulated fleet; a module that puts it in front of something
else overrides `router_workers`. Plain helpers (polling, the system Redis, the recording
upstream itself) are in `tests.support`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, TypeVar

import pytest

if TYPE_CHECKING:
    from loadtests.e2e.replicas import RedisClusterNodes
    from loadtests.sim.cluster import SimCluster
    from loadtests.support.routerproc import RouterProcess
    from tests.support.upstream import RecordingUpstream

T = TypeVar("T")

# The process-starting modules are imported inside the fixtures that use them: importing
# them all (simulator, Redis cluster, uvicorn/starlette) adds 0.5-1 s to `import pytest`'s
# 0.2-0.7 s here, which every run of a pure unit-test file (normalizer, policies, engine)
# would otherwise pay at collection.


def started(
    request: pytest.FixtureRequest, marker: str, make: Callable[..., AbstractContextManager[T]], *args: Any
) -> Iterator[T]:
    """`make(*args, **kwargs)` entered for the fixture's lifetime, with `kwargs` from the
    closest `marker` (the module's, for module fixtures; none: `make`'s defaults)."""
    found = request.node.get_closest_marker(marker)
    with make(*args, **(found.kwargs if found else {})) as thing:
        yield thing


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest) -> Iterator[SimCluster]:
    """Simulated vLLM workers (and pool) on loopback; `pytest.mark.sim_cluster(...)` gives
    SimCluster's arguments."""
    from loadtests.sim.cluster import SimCluster

    yield from started(request, "sim_cluster", SimCluster)


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[RedisClusterNodes]:
    """A real three-master Redis Cluster on free ports (never the system Redis)."""
    from loadtests.e2e.replicas import RedisClusterNodes

    with RedisClusterNodes() as nodes:
        yield nodes


@pytest.fixture(scope="module")
def upstream(request: pytest.FixtureRequest) -> Iterator[RecordingUpstream]:
    """One recording OpenAI-compatible upstream; `pytest.mark.recording_upstream(...)` gives
    RecordingUpstream's arguments."""
    from tests.support.upstream import RecordingUpstream

    yield from started(request, "recording_upstream", RecordingUpstream)


@pytest.fixture(scope="module")
def router_workers(cluster: SimCluster) -> dict[str, str]:
    """The workers `router` is started with: name -> URL."""
    return cluster.worker_urls


@pytest.fixture(scope="module")
def router(request: pytest.FixtureRequest, router_workers: dict[str, str]) -> Iterator[RouterProcess]:
    """`kvroute serve` in a subprocess in front of `router_workers`;
    `pytest.mark.router_process(...)` gives RouterProcess's other arguments."""
    from loadtests.support.routerproc import RouterProcess

    yield from started(request, "router_process", RouterProcess, router_workers)


@pytest.fixture
def redis_prefix() -> Iterator[str]:
    """A key prefix (and hash tag) of the system Redis for one test; its keys are removed after."""
    import uuid

    from tests.support.system_redis import SYSTEM_REDIS, delete_prefix

    prefix = f"test-{uuid.uuid4().hex[:12]}"
    yield prefix
    delete_prefix(SYSTEM_REDIS, "{" + prefix + "}")
