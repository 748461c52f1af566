"""/debug/route explains the very decision: the numbers it shows are the ones the policy
ranked by, from the decision's own single index lookup (in-process, no router subprocess)."""

from __future__ import annotations

from collections.abc import Sequence

import httpx

from cache_client.base import IndexView, PrefixIndex, key_tokens_of
from cache_client.memory import MemoryIndex
from normalizer.prefix import PrefixKey
from router.app import build_app
from router.config_loader import flat_config
from router.routing import RouteRequest
from router.workers import WorkerSpec
from tests.support.upstream import RecordingUpstream

TOKEN = "admin-debug-route-1234"
CONVO = {"model": "rec-model", "messages": [
    {"role": "system", "content": "You are a careful assistant. " * 40},
    {"role": "user", "content": "Summarise the plot of a long novel. " * 20},
]}


class CountingIndex:
    """A prefix index that counts its lookups; everything else goes to the wrapped one."""

    def __init__(self, inner: PrefixIndex) -> None:
        self.inner = inner
        self.lookups = 0

    async def lookup(self, keys: Sequence[PrefixKey]) -> IndexView:
        self.lookups += 1
        return await self.inner.lookup(keys)

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


async def test_debug_route_reports_the_numbers_the_policy_ranked_by() -> None:
    index = CountingIndex(MemoryIndex(1_000_000))
    with RecordingUpstream() as a, RecordingUpstream() as b:
        config = flat_config(
            workers=[WorkerSpec("a", a.url), WorkerSpec("b", b.url)], policy="cache_aware", admin_token=TOKEN
        )
        app = build_app(config, index=index)
        async with app.lifespan(app.api):
            assert app.proxy is not None
            canonical = app.proxy.canonical(CONVO, "chat")
            chain = app.chains.build(canonical, "chat")
            await index.record("b", chain.keys, key_tokens_of(chain.cum_tokens))
            busy = app.loads.acquire("b", 0.004)  # queued prefill on b: part of its prediction
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
                lookups_before = index.lookups
                resp = await client.post("/debug/route", json=CONVO, headers={"authorization": f"Bearer {TOKEN}"})
            assert resp.status_code == 200, resp.text
            assert index.lookups == lookups_before + 1  # decide's lookup, and no second one

            # What the policy ranks by, for the same view and loads.
            view = await index.inner.lookup(chain.keys)
            loads = app.loads.snapshot(["a", "b"])
            decision = app.policy.choose(RouteRequest(chain), view, loads, app.proxy.cost)
            app.loads.release(busy)

    why = resp.json()
    assert why["chosen"]["worker"] == decision.worker == "b" and why["chosen"]["reason"] == "gpu_hit"
    chosen = next(s for s in decision.scores if s.worker == decision.worker)
    assert chosen.ttft_s > 0.004
    assert why["chosen"]["predicted_ttft_s"] == chosen.ttft_s
    assert why["chosen"]["predicted_prefill_s"] == chosen.prefill_s == decision.prefill_s
    assert why["chosen"]["score_s"] == chosen.score_s
    # Every candidate, in the policy's order, with the policy's own numbers.
    assert [row["worker"] for row in why["candidates"]] == [s.worker for s in decision.scores]
    for row, score in zip(why["candidates"], decision.scores, strict=True):
        assert row["cached_tokens_gpu"] == score.gpu_tokens
        assert row["cached_tokens_pool"] == score.reuse.pool
        assert (row["tier"], row["cached_tokens"]) == (score.reuse.tier, score.reuse.tokens)
        assert row["predicted_prefill_s"] == score.prefill_s
        assert row["predicted_ttft_s"] == score.ttft_s
        assert row["queued_prefill_s"] == score.load.queued_prefill_s
        assert row["prefilling"] == score.load.prefilling
        assert row["lag_s"] == score.load.lag_s
        assert row["within_load_bound"] == score.within_bound
    assert why["cost_model"]["inflight_penalty_s"] == app.proxy.cost.inflight_penalty_s
    assert why["cost_model"]["step_s"] == app.proxy.cost.step_s


async def test_a_dry_run_does_not_change_the_next_real_decision() -> None:
    """A dry run of a second continuation of a prompt must not mark that prompt a shared
    prefix: the real continuation still finds its home (the worker its prompt went to)."""
    base = "You are a careful completions agent. " * 60
    first, one, two = base + "\nStep 1:", base + "\nStep 1: done." + " check" * 80, base + "\nOther:" + " plan" * 80
    with RecordingUpstream() as a, RecordingUpstream() as b:
        config = flat_config(
            workers=[WorkerSpec("a", a.url), WorkerSpec("b", b.url)], policy="cache_aware", admin_token=TOKEN
        )
        app = build_app(config, index=MemoryIndex(1_000_000))
        async with app.lifespan(app.api):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:

                async def complete(prompt: str) -> httpx.Response:
                    return await client.post("/v1/completions", json={"model": "rec-model", "prompt": prompt})

                home = (await complete(first)).headers["x-kvroute-worker"]
                for _ in range(6):  # its worker's recent count is over the cap: only a home stays
                    app.loads.release(app.loads.acquire(home, 0.0))
                dry = await client.post(
                    "/debug/route", params={"path": "/v1/completions"}, json={"model": "rec-model", "prompt": two},
                    headers={"authorization": f"Bearer {TOKEN}"},
                )
                assert dry.status_code == 200, dry.text
                real = await complete(one)
    assert dry.json()["chosen"]["worker"] == home  # the first continuation of `first`, so far
    assert (real.headers["x-kvroute-worker"], real.headers["x-kvroute-route-reason"]) == (home, "gpu_hit")
    # The dry run sent nothing anywhere.
    assert len(a.received) + len(b.received) == 2



async def test_debug_route_takes_any_body_the_proxy_takes() -> None:
    """A long conversation (screenshots, a long history) is explained, not refused at the
    admin API's own 64 KiB; beyond the proxy's limit it is refused as the proxy would."""
    big = {"model": "rec-model", "messages": [{"role": "user", "content": "a long history. " * 20_000}]}
    with RecordingUpstream() as a:
        config = flat_config(workers=[WorkerSpec("a", a.url)], admin_token=TOKEN, max_body_bytes=400_000)
        app = build_app(config)
        async with app.lifespan(app.api):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
                auth = {"authorization": f"Bearer {TOKEN}"}
                ok = await client.post("/debug/route", json=big, headers=auth)
                assert ok.status_code == 200, ok.text
                assert ok.json()["prompt_tokens"] > 60_000
                huge = {**big, "messages": big["messages"] * 2}
                refused = await client.post("/debug/route", json=huge, headers=auth)
                assert refused.status_code == 413 and refused.json()["error"]["code"] == "request_too_large"


async def test_debug_route_names_each_media_element_with_its_tokens() -> None:
    import base64
    import struct

    def png(width: int, height: int, seed: int) -> str:
        head = b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + b"IHDR" + struct.pack(">II", width, height)
        return "data:image/png;base64," + base64.b64encode(head + bytes([seed]) * 200_000).decode()

    body = {"model": "rec-model", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What changed between these two screens?"},
        {"type": "image_url", "image_url": {"url": png(1920, 1080, 1)}},
        {"type": "image_url", "image_url": {"url": png(1280, 800, 2)}},
    ]}]}  # fmt: skip
    with RecordingUpstream() as a:
        # The served model's name says no family here: the rule is set (as a deployment would).
        app = build_app(flat_config(workers=[WorkerSpec("a", a.url)], admin_token=TOKEN, image_rule="qwen2_vl"))
        async with app.lifespan(app.api):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
                why = await client.post("/debug/route", json=body, headers={"authorization": f"Bearer {TOKEN}"})
    assert why.status_code == 200, why.text
    media = why.json()["media"]
    assert [(m["kind"], m["tokens"]) for m in media] == [("image", 39 * 69 + 2), ("image", 29 * 46 + 2)]
    assert media[0]["key"] != media[1]["key"]
    assert why.json()["prompt_tokens"] < 39 * 69 + 29 * 46 + 100  # the base64 text is not counted as text
