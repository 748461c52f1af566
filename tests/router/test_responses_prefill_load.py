"""A `/v1/responses` stream opens with `response.created` and `response.in_progress`
before the engine has prefilled anything (vLLM sends them at once, as the simulator does):
the router must keep the request's prefill in its worker's queued load until the first
output item, as it does until the first token of a chat stream. Releasing it at the first
byte made busy workers look idle: `kvroute bench --api responses` measured cache_aware's
TTFT 1.5x (mean) and 2.5x (p99) its chat figures on the same sessions before the fix.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

TOKEN = "admin-token-for-tests-prefill"
AUTH = {"authorization": "Bearer " + TOKEN}

# A slow simulated clock: the 20k-token prefill below takes seconds of wall time.
pytestmark = [
    pytest.mark.sim_cluster(workers=1, time_scale=4.0, pool=False, extra_args=["--auto-tool-calls", "text"]),
    pytest.mark.router_process(policy="cache_aware", env={"KVROUTE_ADMIN_TOKEN": TOKEN}),
]


def _queued_prefill_s(client: httpx.Client, model: str) -> float:
    probe = {"model": model, "messages": [{"role": "user", "content": "probe"}]}
    resp = client.post("/debug/route", json=probe, headers=AUTH)
    assert resp.status_code == 200, resp.text
    return sum(row["queued_prefill_s"] for row in resp.json()["candidates"])


def test_a_responses_stream_holds_its_prefill_until_the_first_output(router: Any, cluster: Any) -> None:
    model = cluster.model
    body = {"model": model, "input": "prefill me " * 8000, "stream": True, "store": False, "max_output_tokens": 4}

    async def run() -> tuple[float, float, list[bytes]]:
        seen: list[bytes] = []
        async with httpx.AsyncClient(base_url=router.url, trust_env=False, timeout=120) as client:
            async with client.stream("POST", "/v1/responses", json=body) as resp:
                assert resp.status_code == 200
                chunks = resp.aiter_bytes()
                seen.append(await anext(chunks))
                with httpx.Client(base_url=router.url, trust_env=False, timeout=30) as admin:
                    during = await asyncio.to_thread(_queued_prefill_s, admin, model)
                seen += [chunk async for chunk in chunks]
            with httpx.Client(base_url=router.url, trust_env=False, timeout=30) as admin:
                after = await asyncio.to_thread(_queued_prefill_s, admin, model)
        return during, after, seen

    during, after, seen = asyncio.run(run())
    assert b"response.created" in seen[0] and b"response.output_item.added" not in seen[0]
    assert b"response.completed" in b"".join(seen)
    assert during > 0, "the prefill left the worker's load at response.created"
    assert after == 0
