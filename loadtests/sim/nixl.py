"""Prefill/decode disaggregation on the simulated worker: vLLM's NixlConnector protocol.

What vLLM does (`vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py`, and the
toy proxy in `tests/v1/kv_connector/nixl_integration/toy_proxy_server.py`):

* Prefill side (P). A request whose `kv_transfer_params` has `do_remote_decode: true` runs
  as usual (the proxy sends it with `max_tokens: 1`, `stream: false`). When it finishes
  length-capped, its blocks are not freed: `request_finished` returns them and the answer
  carries `kv_transfer_params` = `{do_remote_prefill: true, do_remote_decode: false,
  remote_block_ids, remote_engine_id, remote_request_id, remote_host, remote_port,
  tp_size}`. P frees them when a decode worker notifies it has read them, or when
  `VLLM_NIXL_ABORT_REQUEST_TIMEOUT` (480 s) passes. A request that finished otherwise (its
  one token was a stop token, or it was aborted) frees its blocks at once and its answer has
  no params.
* Decode side (D). A request with `do_remote_prefill: true` and every remote field present
  gets its local prefix hit, blocks for the rest of its prompt, and waits
  (WAITING_FOR_REMOTE_KVS) while those blocks are read from P, beside the engine's steps;
  then P is notified and frees them. Params missing or incomplete: D prefills the prompt
  itself, silently. A D request aborted before its read started still notifies P, so P's
  blocks are freed.

Here the read is a call to P, in-process when both run in one `sim-cluster` process (a
shared `NixlPeers`), else over HTTP to P's own address (`remote_host`/`remote_port` are the
worker's HTTP address): `POST /sim/nixl/read` checks that P still holds the request's
blocks, D waits the transfer time (KV bytes ÷ `--kv-link-gbps`), then `POST
/sim/nixl/release` is vLLM's notification. The same release call is the hook a router may
use to free a hold it knows no D will read (vLLM has no such endpoint: there, the router
frees P's blocks by sending D the params and aborting it, which the simulator honours too).
Beyond vLLM, D checks that P holds the same prompt (a digest of its bytes): a router that
sent D other tokens than P gets a local prefill counted as `mismatch`, not silent garbage.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx
import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from loadtests.sim import openai_shapes as shapes

if TYPE_CHECKING:
    from loadtests.sim.costs import CostModel
    from loadtests.sim.engine import Engine, Seq
    from loadtests.sim.runner import Runner

ROLES = ("both", "prefill", "decode")
PREFILL, DECODE = "prefill", "decode"
"""How a request takes part in a disaggregated flow (`Job.pd`), named after the side."""
NIXL_ABORT_TIMEOUT_S = 480.0
"""vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT default: how long P holds unread blocks."""
REMOTE_FIELDS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")
"""Fields vLLM requires, besides a non-empty `remote_block_ids`, to start a read."""
LOCAL_PREFILL_REASONS = ("missing", "invalid", "stale", "mismatch", "unreachable")
"""Why a decode worker prefilled a prompt itself: no params on a decode-role worker; params
vLLM would not act on; P no longer holds the blocks (timed out, released, restarted);
P holds another prompt; P could not be reached."""
RELEASE_REASONS = ("pulled", "released", "expired")
"""Why a prefill worker freed held blocks: a D read them; a D or the router released them
without reading (an aborted request); the hold timed out."""


def parse_params(raw: Any) -> dict[str, Any] | None:
    """A request's `kv_transfer_params`: absent or null, else an object, as vLLM's schema."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise shapes.RequestError(400, "kv_transfer_params must be an object", param="kv_transfer_params")
    return raw


def side_of(params: dict[str, Any] | None) -> str | None:
    """Which side a request plays: DECODE (`do_remote_prefill`, checked first as vLLM's
    `request_finished` does), PREFILL (`do_remote_decode`), or None."""
    if not params:
        return None
    if params.get("do_remote_prefill"):
        return DECODE
    if params.get("do_remote_decode"):
        return PREFILL
    return None


def prompt_digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


@dataclass
class PullPlan:
    """A decode request's params, as vLLM's `RemoteMeta` reads them."""

    engine_id: str
    request_id: str
    host: str
    port: int
    block_ids: list[int]
    started: bool = False

    @classmethod
    def of(cls, params: dict[str, Any]) -> PullPlan | None:
        """None when vLLM would not read (no block ids, a remote field missing)."""
        blocks = params.get("remote_block_ids")
        if not blocks or not isinstance(blocks, list) or not all(p in params for p in REMOTE_FIELDS):
            return None
        try:
            port = int(params["remote_port"])
        except (TypeError, ValueError):
            return None
        return cls(str(params["remote_engine_id"]), str(params["remote_request_id"]), str(params["remote_host"]), port, blocks)


@dataclass
class Hold:
    """A finished prefill request's blocks, waiting for a read."""

    seq: Seq
    block_ids: list[int]
    held_at: float
    timer: asyncio.TimerHandle | None = None


@dataclass
class NixlStats:
    holds: int = 0
    no_params: int = 0
    """Prefill requests (do_remote_decode) answered without params (a stop token)."""
    released: dict[str, int] = field(default_factory=lambda: dict.fromkeys(RELEASE_REASONS, 0))
    released_blocks: int = 0
    pull_s: float = 0.0
    local_prefills: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LOCAL_PREFILL_REASONS, 0))


class NixlPeers:
    """The agents of one process by engine id: a decode worker reads from a prefill worker
    in the same process directly, without HTTP."""

    def __init__(self) -> None:
        self.agents: dict[str, NixlAgent] = {}


class HttpPeer:
    """A prefill worker in another process, through its /sim/nixl endpoints."""

    def __init__(self, client: httpx.AsyncClient, base: str) -> None:
        self.client = client
        self.base = base

    async def read(self, request_id: str, engine_id: str, blocks: int, digest: bytes) -> tuple[bool, str]:
        body = {"remote_request_id": request_id, "remote_engine_id": engine_id, "blocks": blocks, "prompt_digest": digest.hex()}
        r = await self.client.post(f"{self.base}/sim/nixl/read", json=body)
        r.raise_for_status()
        out = r.json()
        return bool(out.get("ok")), str(out.get("reason", ""))

    async def release(self, request_id: str, engine_id: str, pulled: bool) -> None:
        body = {"remote_request_id": request_id, "remote_engine_id": engine_id, "pulled": pulled}
        r = await self.client.post(f"{self.base}/sim/nixl/release", json=body)
        r.raise_for_status()


class NixlAgent:
    """One worker's side of the protocol: holds (as P) and pulls (as D)."""

    def __init__(
        self,
        name: str,
        host: str,
        port: int,
        role: str,
        engine: Engine,
        runner: Runner,
        cost: CostModel,
        time_scale: float,
        timeout_s: float = NIXL_ABORT_TIMEOUT_S,
        peers: NixlPeers | None = None,
    ) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.role = role
        # vLLM's engine_id is a fresh uuid per start unless configured: a restarted P is a
        # new engine, so params it gave out before are stale.
        self.engine_id = f"sim-{name}-{uuid.uuid4().hex[:12]}"
        self.host, self.port = host, port
        self.engine, self.runner, self.cost = engine, runner, cost
        self.time_scale = time_scale
        self.timeout_s = timeout_s
        self.peers = peers or NixlPeers()
        self.peers.agents[self.engine_id] = self
        self.holds: dict[str, Hold] = {}
        self.plans: dict[str, PullPlan] = {}
        """Decode requests' params by engine request id, until their pull ended."""
        self.stats = NixlStats()
        self._next_block_id = 0
        self._client: httpx.AsyncClient | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def close(self) -> None:
        self.peers.agents.pop(self.engine_id, None)
        for hold in self.holds.values():
            if hold.timer is not None:
                hold.timer.cancel()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._client is not None:
            await self._client.aclose()

    # -- prefill side -----------------------------------------------------------------------

    def on_hold(self, seq: Seq) -> None:
        """The engine kept a finished prefill request's blocks: name them and start the timeout."""
        n = len(seq.table)
        ids = list(range(self._next_block_id, self._next_block_id + n))
        self._next_block_id += n
        hold = Hold(seq, ids, self.runner.sim_now())
        loop = asyncio.get_running_loop()
        hold.timer = loop.call_later(self.timeout_s * self.time_scale, self._expire, seq.id)
        self.holds[seq.id] = hold
        self.stats.holds += 1

    def answer_params(self, seq: Seq, side: str | None) -> dict[str, Any] | None:
        """The `kv_transfer_params` of a prefill request's answer: the hold's, or None (its
        one token was a stop token, as vLLM's `request_finished` returns for anything not
        length-capped)."""
        if side != PREFILL:
            return None
        hold = self.holds.get(seq.id)
        if hold is None:
            self.stats.no_params += 1
            return None
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": hold.block_ids,
            "remote_engine_id": self.engine_id,
            "remote_request_id": seq.id,
            "remote_host": self.host,
            "remote_port": self.port,
            "tp_size": self.cost.profile.tp,
        }

    def read(self, request_id: str, engine_id: str, blocks: int, digest: bytes) -> tuple[bool, str]:
        """A decode worker starts reading `blocks` blocks of a hold."""
        hold = self.holds.get(request_id) if engine_id == self.engine_id else None
        if hold is None:
            return False, "stale"
        if blocks > len(hold.block_ids) or (digest and hold.seq.prompt_digest and digest != hold.seq.prompt_digest):
            return False, "mismatch"
        return True, ""

    def release(self, request_id: str, reason: str, engine_id: str | None = None) -> int | None:
        """Free a hold (read, released without reading, or expired); None if not held."""
        if engine_id is not None and engine_id != self.engine_id:
            return None
        hold = self.holds.pop(request_id, None)
        if hold is None:
            return None
        if hold.timer is not None:
            hold.timer.cancel()
        freed = self.engine.release_held(request_id) or 0
        self.stats.released[reason] += 1
        self.stats.released_blocks += freed
        self.runner.wake()
        return freed

    def _expire(self, request_id: str) -> None:
        self.release(request_id, "expired")

    # -- decode side ------------------------------------------------------------------------

    def plan(self, params: dict[str, Any] | None, side: str | None) -> PullPlan | None:
        """The pull a request asks for, counting the local prefills it implies: params vLLM
        would not act on, or none at all on a decode-role worker."""
        if side == DECODE:
            plan = PullPlan.of(params or {})
            if plan is None:
                self.stats.local_prefills["invalid"] += 1
            return plan
        if side is None and self.role == DECODE:
            self.stats.local_prefills["missing"] += 1
        return None

    def on_pull_start(self, seq: Seq) -> None:
        """The engine admitted a decode request: read its blocks from P beside the steps."""
        plan = self.plans.get(seq.id)
        if plan is None:
            # Called from the step loop, which is about to wait for work: answer after it does.
            asyncio.get_running_loop().call_soon(self.runner.pull_done, seq.id, False)
            return
        plan.started = True
        task = asyncio.create_task(self._pull(seq, plan), name=f"nixl-pull-{seq.id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def job_done(self, seq_id: str) -> None:
        """A decode request's handler ended: if it never started its read (aborted while
        queued), tell P to free the blocks, as vLLM's `request_finished` does."""
        plan = self.plans.get(seq_id)
        if plan is None or plan.started:
            return
        del self.plans[seq_id]
        task = asyncio.create_task(self._release_unread(plan), name=f"nixl-release-{seq_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _peer(self, plan: PullPlan) -> NixlAgent | HttpPeer:
        local = self.peers.agents.get(plan.engine_id)
        if local is not None:
            return local
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(5.0), trust_env=False)
        return HttpPeer(self._client, f"http://{plan.host}:{plan.port}")

    async def _peer_read(self, peer: NixlAgent | HttpPeer, plan: PullPlan, seq: Seq) -> tuple[bool, str]:
        if isinstance(peer, NixlAgent):
            return peer.read(plan.request_id, plan.engine_id, seq.pull_blocks, seq.prompt_digest)
        return await peer.read(plan.request_id, plan.engine_id, seq.pull_blocks, seq.prompt_digest)

    async def _peer_release(self, peer: NixlAgent | HttpPeer, plan: PullPlan, pulled: bool) -> None:
        if isinstance(peer, NixlAgent):
            peer.release(plan.request_id, "pulled" if pulled else "released", plan.engine_id)
            return
        with contextlib.suppress(httpx.HTTPError):
            await peer.release(plan.request_id, plan.engine_id, pulled)

    async def _pull(self, seq: Seq, plan: PullPlan) -> None:
        ok, reason = False, "unreachable"
        try:
            peer = self._peer(plan)
            try:
                ok, reason = await self._peer_read(peer, plan, seq)
            except (httpx.HTTPError, ValueError):
                ok, reason = False, "unreachable"
            if ok:
                seconds = self.cost.nixl_pull_s(seq.pull_tokens)
                self.stats.pull_s += seconds
                await asyncio.sleep(seconds * self.time_scale)
                await self._peer_release(peer, plan, pulled=True)
        finally:
            self.plans.pop(seq.id, None)
        if not ok:
            self.stats.local_prefills[reason if reason in LOCAL_PREFILL_REASONS else "stale"] += 1
        self.runner.pull_done(seq.id, ok)

    async def _release_unread(self, plan: PullPlan) -> None:
        await self._peer_release(self._peer(plan), plan, pulled=False)

    # -- observation and HTTP ---------------------------------------------------------------

    @property
    def held_blocks(self) -> int:
        return self.engine.held_blocks

    def state(self, list_holds: int | None = 50) -> dict[str, Any]:
        """The figures, and the oldest `list_holds` holds (None: all of them)."""
        now = self.runner.sim_now()
        c = self.engine.counters
        holds = list(self.holds.items())[:list_holds] if list_holds is not None else list(self.holds.items())
        return {
            "engine_id": self.engine_id,
            "held_requests": len(self.holds),
            "held_blocks": self.held_blocks,
            "held": [
                {"remote_request_id": rid, "blocks": len(h.block_ids), "age_s": now - h.held_at}
                for rid, h in holds
            ],
            "holds": self.stats.holds,
            "no_params": self.stats.no_params,
            "released": dict(self.stats.released),
            "released_blocks": self.stats.released_blocks,
            "pulling": len(self.engine.pulling),
            "pulls": c.pulls,
            "pull_failures": c.pull_failures,
            "pulled_blocks": c.pulled_blocks,
            "pulled_tokens": c.pulled_tokens,
            "pull_s": self.stats.pull_s,
            "local_prefills": dict(self.stats.local_prefills),
            "timeout_s": self.timeout_s,
            "link_gbps": self.cost.link_bps * 8 / 1e9,
        }

    def routes(self) -> list[Route]:
        async def read(request: Request) -> Response:
            try:
                body = orjson.loads(await request.body())
                rid, engine_id = str(body["remote_request_id"]), str(body["remote_engine_id"])
                blocks = int(body.get("blocks", 0))
                digest = bytes.fromhex(body.get("prompt_digest") or "")
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
                return _json({"error": "expected remote_request_id, remote_engine_id, blocks"}, 400)
            ok, reason = self.read(rid, engine_id, blocks, digest)
            return _json({"ok": ok, "reason": reason})

        async def release(request: Request) -> Response:
            try:
                body = orjson.loads(await request.body())
                rid = str(body["remote_request_id"])
                engine_id = body.get("remote_engine_id")
                pulled = bool(body.get("pulled", False))
            except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
                return _json({"error": "expected remote_request_id"}, 400)
            freed = self.release(rid, "pulled" if pulled else "released", str(engine_id) if engine_id else None)
            return _json({"released": freed is not None, "blocks": freed or 0})

        async def state(request: Request) -> Response:
            return _json({"role": self.role, **self.state(list_holds=None)})

        return [
            Route("/sim/nixl/read", read, methods=["POST"]),
            Route("/sim/nixl/release", release, methods=["POST"]),
            Route("/sim/nixl", state, methods=["GET"]),
        ]


def _json(payload: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(payload), status_code=status, media_type="application/json")

