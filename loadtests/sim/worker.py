"""One simulated vLLM worker: vLLM's OpenAI-compatible HTTP API over the simulated engine.

`kvroute sim-worker --name NAME --port P [--host 127.0.0.1] [--model sim-llama3-8b]
[--profile h200-llama3-8b] [--time-scale S] [--kv-capacity-tokens N] [--pool URL]
[--kv-events tcp://HOST:PORT] [--max-tokens-default 32]`

Tokenization is the shared estimate, applied to the request exactly as received (no
canonicalization: the simulator shows what a real engine would see): the prompt is
`b"".join(chat_segments(body))` (or `completion_segments`), one token per 4 bytes.

Besides the OpenAI endpoints (`/v1/chat/completions`, `/v1/completions`, `/v1/models`),
vLLM's agent APIs (`/v1/responses` with a per-worker store, `/v1/messages`,
`/v1/messages/count_tokens`; see agent_apis.py) and rerank / score, it serves `/health`, `/metrics` (vLLM metric names, simulated seconds), the probes other
routers make (`/server_info`, `/model_info`, `/get_load`, `/tokenize`, `/detokenize`,
`/v1/chat/completions/render`, `/kv_event_sources`, `/version`) and test hooks
(`GET /sim/state`, `POST /sim/fault`, `POST /reset_prefix_cache`).

Prefill/decode disaggregation follows vLLM's NixlConnector (`kv_transfer_params` on every
inference API; see nixl.py); `--role prefill|decode|both` labels the worker.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from loadtests.sim import agent_apis as agent
from loadtests.sim import agent_serving as serving
from loadtests.sim import openai_shapes as shapes
from loadtests.sim.asgi import Send, WatchedResponse, send_chunk, send_json, start_sse
from loadtests.sim.costs import (
    DEFAULT_PROFILE,
    DISK,
    DISK_GBYTES_S,
    KV_LINK_GBPS,
    NIXL,
    POOL,
    PROFILES,
    REMOTE,
    REMOTE_GBPS,
    CostModel,
    build_cost_model,
)
from loadtests.sim.engine import (
    BLOCK_SIZE,
    BlockHasher,
    Engine,
    KVEvent,
    Seq,
    signed_token_ids,
    token_ids_of,
)
from loadtests.sim.kv_events import MEDIUM_CPU, MEDIUM_GPU, KVEventPublisher, encode_event
from loadtests.sim.metrics import Exposition, escape_label
from loadtests.sim.nixl import (
    DECODE,
    NIXL_ABORT_TIMEOUT_S,
    PREFILL,
    ROLES,
    NixlAgent,
    NixlPeers,
    parse_params,
    prompt_digest,
    side_of,
)
from loadtests.sim.pool import CHUNK_TOKENS, LocalPoolClient, PoolClient, chunk_keys
from loadtests.sim.runner import Handle, Runner
from normalizer.media import MediaReader, MediaSettings
from normalizer.prefix import chat_segments, completion_segments, prompt_bytes
from normalizer.tokens import CHARS_PER_TOKEN

DEFAULT_MODEL = "sim-llama3-8b"
FAULT_MODES = ("none", "error500", "hang", "slow", "eos")


@dataclass
class WorkerConfig:
    name: str
    port: int = 0
    host: str = "127.0.0.1"
    model: str = DEFAULT_MODEL
    profile: str = DEFAULT_PROFILE
    time_scale: float = 1.0
    speed: float = 1.0
    """Relative speed of this worker's GPU: 0.5 = every step takes twice as long."""
    kv_capacity_tokens: int | None = None
    pool_url: str | None = None
    node: str | None = None
    """The node it runs on (its pool's), as `kvroute sim-cluster --nodes` places it."""
    disk_gbytes_s: float = DISK_GBYTES_S
    remote_gbps: float = REMOTE_GBPS
    kv_events: str | None = None
    kv_events_topic: str = ""
    max_tokens_default: int = 32
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    get_load_format: str = "sglang"
    # tool_choice "auto": "call" the first tool after a user turn (agent loops), or answer "text".
    auto_tool_calls: str = "call"
    image_rule: str = "auto"
    """How an image in a prompt counts (normalizer/media.py): the router's default rule, so
    that the two agree on image conversations unless told otherwise."""
    role: str = "both"
    """Its part in a disaggregated fleet (prefill, decode, both): a label the router reads
    from /sim/state and /metrics; any worker serves either side of the protocol, as vLLM's
    `kv_both` does."""
    kv_link_gbps: float = KV_LINK_GBPS
    """Bandwidth of a KV pull from a prefill worker."""
    nixl_timeout_s: float = NIXL_ABORT_TIMEOUT_S
    """Simulated seconds a prefill worker holds unread blocks (VLLM_NIXL_ABORT_REQUEST_TIMEOUT)."""


@dataclass
class Fault:
    mode: str = "none"
    slow_factor: float = 1.0
    include_health: bool = True


@dataclass
class Job:
    """One parsed inference request."""

    rid: str
    kind: str  # "chat" or "completion": how the engine renders the prompt
    stream: bool
    include_usage: bool
    continuous_usage: bool
    data: bytes
    prompt_len: int
    out_tokens: int
    finish_reason: str
    pieces: list[str]
    tool: dict[str, Any] | None = None
    tool_call_id: str = ""
    handle: Handle | None = None
    created: int = field(default_factory=shapes.now_s)
    api: str = "chat"  # the endpoint's output shape: chat, completion, responses, messages
    request: dict[str, Any] = field(default_factory=dict)  # the body as received (Responses echo it)
    messages: list[dict[str, Any]] = field(default_factory=list)  # the chat messages rendered
    item_id: str = ""  # the Responses output item / Messages id
    cache_salt: str | None = None  # vLLM's: keys the prompt's cached blocks apart from other salts
    kv_params: dict[str, Any] | None = None  # the request's kv_transfer_params, as received
    pd: str | None = None  # PREFILL or DECODE: its side of a disaggregated request, or None


def _int_field(body: dict[str, Any], *names: str) -> int | None:
    for name in names:
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise shapes.RequestError(400, f"{name} must be a positive integer, got {value!r}", param=name)
        return value
    return None


def _cache_salt(body: dict[str, Any]) -> str | None:
    """vLLM's `cache_salt` (chat, completions, Responses; honoured on Messages here too):
    absent or null, else a non-empty string, as vLLM checks it."""
    salt = body.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise shapes.RequestError(400, "Parameter 'cache_salt' must be a non-empty string if provided.", param="cache_salt")
    return salt


def _is_function_tool(tool: Any) -> bool:
    return isinstance(tool, dict) and isinstance(tool.get("function"), dict) and isinstance(tool["function"].get("name"), str)


class SimWorker:
    """The worker's state and its HTTP app. Create it inside a running event loop."""

    def __init__(
        self,
        config: WorkerConfig,
        cost: CostModel | None = None,
        pool: LocalPoolClient | None = None,
        peers: NixlPeers | None = None,
    ) -> None:
        self.media = MediaReader(MediaSettings(image_rule=config.image_rule))
        """Images in prompts as the router counts them: one element each, its model's tokens."""
        self.config = config
        self.cost = cost or build_cost_model(
            config.profile,
            disk_gbytes_s=config.disk_gbytes_s,
            remote_gbps=config.remote_gbps,
            kv_link_gbps=config.kv_link_gbps,
        )
        capacity = config.kv_capacity_tokens or self.cost.default_capacity_tokens
        self.engine = Engine(
            self.cost,
            capacity,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            pool_chunk_tokens=CHUNK_TOKENS,
            has_pool=config.pool_url is not None,
        )
        self.max_model_len = min(self.cost.profile.max_model_len, self.engine.capacity_tokens)
        self.hasher = BlockHasher(config.model.encode())
        self.pool: PoolClient | LocalPoolClient | None = pool
        if self.pool is None and config.pool_url:
            self.pool = PoolClient(config.pool_url)
        self.publisher = (
            KVEventPublisher(config.kv_events, topic=config.kv_events_topic) if config.kv_events else None
        )
        if self.publisher is not None:
            self.engine.blocks.record_events = True
        self.runner = Runner(
            self.engine,
            time_scale=config.time_scale,
            speed=config.speed,
            on_events=self._publish_events if self.publisher else None,
            on_pool_store=self._store_to_pool if self.pool else None,
        )
        self.nixl = NixlAgent(
            config.name,
            config.host,
            config.port,
            config.role,
            self.engine,
            self.runner,
            self.cost,
            config.time_scale,
            timeout_s=config.nixl_timeout_s,
            peers=peers,
        )
        self.runner.on_pull_start = self.nixl.on_pull_start
        self.runner.on_hold = self.nixl.on_hold
        self.fault = Fault()
        self.store = agent.ResponseStore()
        self.requests_total = 0
        self.rejected_total = 0
        self.app = self._build_app()
        self.runner.start()

    async def close(self) -> None:
        await self.runner.close()
        await self.nixl.close()
        if self.pool is not None:
            await self.pool.close()
        if self.publisher is not None:
            self.publisher.close()

    # -- engine side hooks ----------------------------------------------------------------

    def _publish_events(self, events: list[KVEvent], ts: float) -> None:
        assert self.publisher is not None
        self.publisher.publish([encode_event(e, MEDIUM_GPU) for e in events])

    def _store_to_pool(self, seq: Seq, first_chunk: int, end_chunk: int) -> None:
        assert self.pool is not None
        self.pool.store(seq.pool_keys[first_chunk:end_chunk])
        if self.publisher is not None:
            self._publish_pool_store(seq, first_chunk, end_chunk)

    def _publish_pool_store(self, seq: Seq, first_chunk: int, end_chunk: int) -> None:
        """Tell subscribers that the pool (medium CPU) now holds these blocks."""
        assert self.publisher is not None
        per_chunk = CHUNK_TOKENS // BLOCK_SIZE
        start, end = first_chunk * per_chunk, end_chunk * per_chunk
        event = KVEvent(
            "stored",
            tuple(seq.block_hashes[start:end]),
            seq.block_hashes[start - 1] if start > 0 else None,
            tuple(token_ids_of(seq.data[start * BLOCK_SIZE * CHARS_PER_TOKEN : end * BLOCK_SIZE * CHARS_PER_TOKEN])),
        )
        self.publisher.publish([encode_event(event, MEDIUM_CPU)])

    # -- request parsing ------------------------------------------------------------------

    def _parse(self, raw: bytes, kind: str, request_id: str | None) -> Job:
        try:
            return self._parse_body(raw, kind, request_id)
        except (TypeError, ValueError, AttributeError, KeyError) as exc:
            # Odd shapes the renderer cannot handle are the client's error, not a crash.
            raise shapes.RequestError(400, f"malformed request: {exc}") from None

    def _parse_body(self, raw: bytes, kind: str, request_id: str | None) -> Job:
        body = shapes.json_object(raw)
        shapes.check_model(body, self.config.model)
        cache_salt = _cache_salt(body)  # read here: the agent APIs' chat form drops it
        kv_params = parse_params(body.get("kv_transfer_params"))
        pd = side_of(kv_params)
        api, request = kind, body
        if api == "responses":
            body = agent.responses_chat(body, self.store)
        elif api == "messages":
            body = agent.messages_chat(body)
        kind = "completion" if api == "completion" else "chat"
        if kind == "chat":
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise shapes.RequestError(400, "messages: a non-empty list is required", param="messages")
            if not all(isinstance(m, dict) and "role" in m for m in messages):
                raise shapes.RequestError(400, "messages: every message needs a role", param="messages")
            segments = chat_segments(body, self.media)
        else:
            prompt = body.get("prompt")
            if prompt in (None, "", []):
                raise shapes.RequestError(400, "prompt: a non-empty prompt is required", param="prompt")
            if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                if not all(-(1 << 31) <= t < 1 << 32 for t in prompt):
                    raise shapes.RequestError(400, "prompt: token ids must fit in 32 bits", param="prompt")
                # Ids from /tokenize are u32; the shared renderer packs int32 (same bytes).
                body = {**body, "prompt": signed_token_ids(prompt)}
            segments = completion_segments(body)
        n = body.get("n", 1)
        if n not in (1, None):
            raise shapes.RequestError(400, "n > 1 is not supported by the simulator", param="n")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise shapes.RequestError(400, "stream must be a boolean", param="stream")
        stream_options = body.get("stream_options") or {}
        if not isinstance(stream_options, dict):
            raise shapes.RequestError(400, "stream_options must be an object", param="stream_options")
        max_tokens = _int_field(body, "max_completion_tokens", "max_tokens")
        data = prompt_bytes(segments)
        prompt_len = len(data) // CHARS_PER_TOKEN
        if prompt_len == 0:
            raise shapes.RequestError(400, "the prompt is empty (fewer than 4 bytes)")
        seed = shapes.seed_of(data, kind)
        tool = self._tool_choice(body) if kind == "chat" else None
        if tool is not None:
            args = shapes.tool_arguments(tool, seed)
            pieces = shapes.split_pieces(args)
            finish = "tool_calls"
        else:
            out = max_tokens if max_tokens is not None else self.config.max_tokens_default
            pieces = shapes.text_pieces(seed, out)
            finish = "length" if max_tokens is not None else "stop"
        if pd == PREFILL and max_tokens is not None and len(pieces) > max_tokens:
            # vLLM's length cap decides whether P holds the KV; the simulator otherwise lets
            # a tool call run to its end. A cut call is text, as a tool parser gives it back.
            tool, pieces, finish = None, shapes.text_pieces(seed, max_tokens), "length"
        if self.fault.mode == "eos":
            # The model sampled a stop token first: one token, finish "stop" (a prefill
            # request so answered carries no kv_transfer_params).
            tool, pieces, finish = None, shapes.text_pieces(seed, 1), "stop"
        out_tokens = len(pieces)
        if prompt_len + out_tokens > self.max_model_len or not self.engine.fits(prompt_len, out_tokens):
            raise shapes.RequestError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {prompt_len + out_tokens} tokens ({prompt_len} in the messages, "
                f"{out_tokens} in the completion). Please reduce the length of the messages or completion.",
            )
        rid = request_id or uuid.uuid4().hex
        item_prefix = {"responses": "fc_" if tool is not None else "msg_", "messages": "msg_"}.get(api, "")
        return Job(
            api=api,
            request=request,
            messages=body["messages"] if kind == "chat" else [],
            item_id=f"{item_prefix}{uuid.uuid4().hex}",
            rid=rid,
            kind=kind,
            stream=stream,
            include_usage=bool(stream_options.get("include_usage")),
            continuous_usage=bool(stream_options.get("continuous_usage_stats")),
            data=data,
            prompt_len=prompt_len,
            out_tokens=out_tokens,
            finish_reason=finish,
            pieces=pieces,
            tool=tool,
            tool_call_id=f"chatcmpl-tool-{uuid.uuid4().hex}" if tool is not None else "",
            cache_salt=cache_salt,
            kv_params=kv_params,
            pd=pd,
        )

    def _tool_choice(self, body: dict[str, Any]) -> dict[str, Any] | None:
        """The tool to call: the forced one (`required`: the first; a named function), or on
        `auto` (the default) the first function tool when the last message is the user's —
        after a tool result the model answers in text, so agent loops run and end."""
        tools = body.get("tools")
        choice = body.get("tool_choice")
        if not tools or not isinstance(tools, list):
            return None
        if choice in (None, "auto"):
            if self.config.auto_tool_calls == "text":
                return None
            messages = body.get("messages") or [{}]
            if not isinstance(messages[-1], dict) or messages[-1].get("role") != "user":
                return None
            return next((t for t in tools if _is_function_tool(t)), None)
        if choice == "required":
            tool = tools[0]
            if not _is_function_tool(tool):
                raise shapes.RequestError(400, "tools[0] is not a function tool with a name", param="tools")
            return tool
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name")
            for tool in tools:
                if _is_function_tool(tool) and tool["function"]["name"] == name:
                    return tool
            raise shapes.RequestError(400, f"tool_choice names {name!r}, which is not in tools", param="tool_choice")
        return None

    # -- running a job ----------------------------------------------------------------------

    async def _submit(self, job: Job) -> Handle:
        keys: list[int] = []
        runs: list[tuple[str, int]] = []
        plan = self.nixl.plan(job.kv_params, job.pd)
        if self.pool is not None:
            keys = chunk_keys(job.data, self.config.model, job.cache_salt)
            if plan is None:  # a pull replaces the pool lookup: the KV beyond the local hit comes from P
                runs = [(tier, chunks * CHUNK_TOKENS) for tier, chunks in await self.pool.lookup(keys)]
        seq = Seq(
            id=job.rid,
            prompt_len=job.prompt_len,
            max_tokens=job.out_tokens,
            block_hashes=self.hasher.hashes(job.data, job.cache_salt),
            arrival=0.0,
            pool_hit_tokens=sum(tokens for _, tokens in runs),
            pool_runs=runs,
            data=job.data if self.publisher is not None else b"",
            pool_keys=keys,
        )
        while seq.id in self.engine.seqs or seq.id in self.engine.held:
            seq.id = f"{job.rid}-{uuid.uuid4().hex[:8]}"
        if job.pd is not None:
            seq.prompt_digest = prompt_digest(job.data)
        # vLLM holds the blocks only of a length-capped prefill; a stop token frees them.
        seq.hold = job.pd == PREFILL and job.finish_reason == "length"
        if plan is not None:
            seq.pull = True
            self.nixl.plans[seq.id] = plan
        job.handle = self.runner.submit(seq)
        return job.handle

    def usage(self, job: Job, produced: int) -> shapes.Usage:
        seq = job.handle.seq if job.handle else None
        cached = (seq.gpu_hit_tokens + seq.pool_loaded_tokens + seq.nixl_tokens) if seq is not None else 0
        return shapes.Usage(job.prompt_len, produced, cached)

    async def _run_job(self, job: Job, send: Send) -> None:
        headers = [(b"x-request-id", job.rid.encode())]
        if self.fault.mode == "hang":
            await asyncio.Event().wait()
        handle = await self._submit(job)
        try:
            if job.stream:
                if job.api == "responses":
                    await serving.stream_responses(self, job, handle, send, headers)
                elif job.api == "messages":
                    await serving.stream_messages(self, job, handle, send, headers)
                else:
                    await self._stream(job, handle, send, headers)
            else:
                while not handle.finished:
                    if handle.aborted:
                        raise RuntimeError("request aborted")
                    await handle.wait()
                await send_json(send, 200, orjson.dumps(self._final_body(job)), headers)
        finally:
            self.runner.abort(handle)
            if job.pd == DECODE:
                self.nixl.job_done(handle.seq.id)

    async def next_progress(self, handle: Handle, sent: int) -> int:
        """Tokens produced so far, once more than `sent` are; raises if the engine aborted."""
        while handle.produced == sent and not handle.aborted:
            await handle.wait()
        if handle.aborted:
            raise RuntimeError("request aborted")
        return handle.produced

    def _final_body(self, job: Job) -> dict[str, Any]:
        body = self._final_shape(job)
        params = self.nixl.answer_params(job.handle.seq, job.pd) if job.handle is not None else None
        if params is not None:
            # Top-level on chat, completions, Responses and Messages answers alike (vLLM
            # drops nulls from Messages, so there the key appears only when set).
            body["kv_transfer_params"] = params
        return body

    def _final_shape(self, job: Job) -> dict[str, Any]:
        if job.api == "responses":
            return serving.final_response(self, job)
        if job.api == "messages":
            return serving.final_message(self, job)
        usage = self.usage(job, job.out_tokens)
        created = job.created
        if job.kind == "completion":
            return shapes.completion_response(
                f"cmpl-{job.rid}", self.config.model, created, "".join(job.pieces), job.finish_reason, usage
            )
        if job.tool is not None:
            call = {
                "id": job.tool_call_id,
                "type": "function",
                "function": {"name": job.tool["function"]["name"], "arguments": "".join(job.pieces)},
            }
            return shapes.chat_response(
                f"chatcmpl-{job.rid}", self.config.model, created, None, call, job.finish_reason, usage
            )
        return shapes.chat_response(
            f"chatcmpl-{job.rid}", self.config.model, created, "".join(job.pieces), None, job.finish_reason, usage
        )

    async def _stream(self, job: Job, handle: Handle, send: Send, headers: list[tuple[bytes, bytes]]) -> None:
        model = self.config.model
        chat = job.kind == "chat"
        rid = f"chatcmpl-{job.rid}" if chat else f"cmpl-{job.rid}"
        await start_sse(send, headers)
        sent = 0
        while sent < job.out_tokens:
            while handle.produced == sent and not handle.aborted:
                await handle.wait()
            if handle.aborted:
                raise RuntimeError("request aborted")
            upto = handle.produced
            last = upto >= job.out_tokens
            finish = job.finish_reason if last else None
            usage = self.usage(job, upto) if job.continuous_usage else None
            text = "".join(job.pieces[sent:upto])
            if chat:
                if sent == 0:
                    role = {"role": "assistant", "content": ""}
                    await send_chunk(send, shapes.sse(shapes.chat_chunk(rid, model, job.created, role)))
                if job.tool is not None:
                    call: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
                    if sent == 0:
                        call = {
                            "id": job.tool_call_id,
                            "type": "function",
                            "index": 0,
                            "function": {"name": job.tool["function"]["name"], "arguments": text},
                        }
                    delta: dict[str, Any] = {"tool_calls": [call]}
                else:
                    delta = {"content": text}
                payload = shapes.chat_chunk(rid, model, job.created, delta, finish, usage)
            else:
                payload = shapes.completion_chunk(rid, model, job.created, text, finish, usage)
            await send_chunk(send, shapes.sse(payload))
            sent = upto
        if job.include_usage:
            obj = "chat.completion.chunk" if chat else "text_completion"
            usage_payload = shapes.usage_chunk(rid, model, job.created, obj, self.usage(job, sent))
            await send_chunk(send, shapes.sse(usage_payload))
        await send_chunk(send, shapes.SSE_DONE, more=False)

    # -- HTTP -----------------------------------------------------------------------------

    def _inference(self, kind: str) -> Callable[[Request], Any]:
        # /v1/messages answers errors in Anthropic's shape, as vLLM's translate_error_response.
        error = serving.messages_error if kind == "messages" else _error

        async def endpoint(request: Request) -> Any:
            self.requests_total += 1
            if self.fault.mode == "error500":
                return error(500, "simulated engine failure (fault injection)", "InternalServerError")
            raw = await request.body()
            try:
                job = self._parse(raw, kind, request.headers.get("x-request-id"))
            except shapes.RequestError as exc:
                self.rejected_total += 1
                return error(exc.status, exc.message, exc.type, exc.param)

            def on_disconnect(noticed_at: float) -> None:
                if job.handle is not None:
                    self.runner.abort(job.handle, client_gone_at=noticed_at)
                else:
                    self.runner.client_aborts += 1

            return WatchedResponse(lambda send: self._run_job(job, send), on_disconnect)

        return endpoint

    def _build_app(self) -> Starlette:
        from loadtests.sim.probes import probe_routes

        async def models(request: Request) -> Response:
            return _json(
                {
                    "object": "list",
                    "data": [
                        {
                            "id": self.config.model,
                            "object": "model",
                            "created": shapes.now_s(),
                            "owned_by": "vllm",
                            "root": self.config.model,
                            "parent": None,
                            "max_model_len": self.max_model_len,
                        }
                    ],
                }
            )

        async def health(request: Request) -> Response:
            if self.fault.include_health:
                if self.fault.mode == "error500":
                    return _error(500, "simulated engine failure (fault injection)", "InternalServerError")
                if self.fault.mode == "hang":
                    await asyncio.Event().wait()
            return Response(b"", status_code=200)

        async def metrics(request: Request) -> Response:
            return Response(self.render_metrics(), media_type="text/plain; version=0.0.4; charset=utf-8")

        async def sim_state(request: Request) -> Response:
            return _json(self.state())

        async def sim_fault(request: Request) -> Response:
            try:
                body = orjson.loads(await request.body() or b"{}")
                mode = body.get("mode", "none")
                factor = float(body.get("slow_factor", 1.0))
                include_health = bool(body.get("include_health", True))
            except (orjson.JSONDecodeError, AttributeError, TypeError, ValueError):
                return _error(400, 'expected {"mode": ..., "slow_factor": x}', "BadRequestError")
            if mode not in FAULT_MODES or factor <= 0:
                return _error(400, f"mode must be one of {FAULT_MODES}, slow_factor > 0", "BadRequestError")
            self.fault = Fault(mode, factor if mode == "slow" else 1.0, include_health)
            self.runner.slow_factor = self.fault.slow_factor
            return _json({"mode": self.fault.mode, "slow_factor": self.fault.slow_factor})

        async def sim_speed(request: Request) -> Response:
            # A GPU that slows down at runtime (thermal throttling, a noisy neighbour):
            # what the router's online cost calibration must follow.
            try:
                speed = float(orjson.loads(await request.body() or b"{}")["speed"])
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
                return _error(400, 'expected {"speed": x} with x > 0', "BadRequestError")
            if not speed > 0 or speed == float("inf"):
                return _error(400, "speed must be a positive number", "BadRequestError")
            self.config.speed = self.runner.speed = speed
            return _json({"speed": speed, "sim_time_s": self.runner.sim_now()})

        async def reset_prefix_cache(request: Request) -> Response:
            if not self.engine.reset_prefix_cache():
                return _error(409, "requests are running; the prefix cache was not reset", "ConflictError")
            self.runner.flush_events()
            return Response(b"", status_code=200)

        routes = [
            Route("/v1/chat/completions", self._inference("chat"), methods=["POST"]),
            Route("/v1/completions", self._inference("completion"), methods=["POST"]),
            Route("/v1/responses", self._inference("responses"), methods=["POST"]),
            Route("/v1/messages", self._inference("messages"), methods=["POST"]),
            *serving.agent_routes(self),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/sim/state", sim_state, methods=["GET"]),
            Route("/sim/fault", sim_fault, methods=["POST"]),
            Route("/sim/speed", sim_speed, methods=["POST"]),
            Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"]),
            *self.nixl.routes(),
            *probe_routes(self),
        ]
        return Starlette(routes=routes)

    # -- observation ------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        e, c = self.engine, self.engine.counters
        return {
            "name": self.config.name,
            "role": self.config.role,
            "model": self.config.model,
            "profile": self.cost.profile.name,
            "time_scale": self.config.time_scale,
            "speed": self.runner.speed,
            "sim_time_s": self.runner.sim_now(),
            "running": len(e.running),
            "waiting": len(e.waiting),
            "aborted": self.runner.client_aborts,
            "engine_aborted": c.aborted,
            "last_abort_delays_s": list(self.runner.abort_delays),
            "finished": c.finished,
            "requests_total": self.requests_total,
            "rejected_total": self.rejected_total,
            "kv_capacity_tokens": e.capacity_tokens,
            "kv_used_blocks": e.blocks.used,
            "kv_cached_blocks": e.blocks.cached_blocks,
            "kv_usage": e.kv_usage,
            "prefix_queries_tokens": c.prefix_queries,
            "prefix_hits_tokens": c.prefix_hits,
            "external_queries_tokens": c.external_queries,
            "external_hits_tokens": c.external_hits,
            "cached_tokens_by_tier": self._cached_by_tier(),
            "computed_prompt_tokens": c.computed_prompt_tokens,
            "preemptions": c.preemptions,
            "steps": c.steps,
            "busy_s": c.busy_s,
            "kv_held_s": c.kv_held_s,
            "fault": {"mode": self.fault.mode, "slow_factor": self.fault.slow_factor},
            "pool": self.config.pool_url,
            "node": self.config.node,
            "pool_errors": self.pool.errors if self.pool else 0,
            "kv_events": self.config.kv_events,
            "kv_event_batches": self.publisher.sent if self.publisher else 0,
            "generation_tokens": c.generation_tokens,
            "inter_token_latency_s": self._itl_summary(),
            "nixl": self.nixl.state(),
        }

    def _itl_summary(self) -> dict[str, float | int | None]:
        """Inter-token latency, simulated seconds: every token's (count, mean) and the
        recent ones' exact percentiles (vLLM's histogram buckets start at 10 ms, coarser
        than a decode step). Decode tokens/s per stream is 1 / mean."""
        r = self.runner
        recent = sorted(r.itl_recent)

        def pct(q: float) -> float | None:
            return recent[min(int(q * len(recent)), len(recent) - 1)] if recent else None

        return {
            "count": r.itl.n,
            "mean": r.itl.total / r.itl.n if r.itl.n else None,
            "recent": len(recent),
            "p50": pct(0.50),
            "p90": pct(0.90),
            "p99": pct(0.99),
            "max": recent[-1] if recent else None,
        }

    def _cached_by_tier(self) -> dict[str, int]:
        """Prompt tokens not recomputed, by where they came from: the GPU's prefix cache,
        or loaded from the node's pool, its disk, the remote tier."""
        c = self.engine.counters
        return {
            "gpu": c.prefix_hits,
            POOL: c.tier_hits[POOL],
            DISK: c.tier_hits[DISK],
            REMOTE: c.tier_hits[REMOTE],
            NIXL: c.nixl_hits,
        }

    def render_metrics(self) -> str:
        e, c, r = self.engine, self.engine.counters, self.runner
        labels = f'model_name="{escape_label(self.config.model)}",engine="0"'
        x = Exposition()
        x.metric("vllm:num_requests_running", "gauge", "Requests in model execution batches.", len(e.running), labels)
        x.metric("vllm:num_requests_waiting", "gauge", "Requests waiting to be processed.", len(e.waiting), labels)
        x.metric("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", e.kv_usage, labels)
        x.metric("vllm:gpu_cache_usage_perc", "gauge", "GPU KV-cache usage (pre-V1 name).", e.kv_usage, labels)
        x.metric("vllm:prefix_cache_queries_total", "counter", "Prefix cache queries, in tokens.", c.prefix_queries, labels)
        x.metric("vllm:prefix_cache_hits_total", "counter", "Prefix cache hits, in tokens.", c.prefix_hits, labels)
        x.metric(
            "vllm:external_prefix_cache_queries_total", "counter",
            "External (KV connector) prefix cache queries, in tokens.", c.external_queries, labels,
        )  # fmt: skip
        x.metric(
            "vllm:external_prefix_cache_hits_total", "counter",
            "External (KV connector) prefix cache hits, in tokens.", c.external_hits, labels,
        )  # fmt: skip
        x.metric("vllm:prompt_tokens_total", "counter", "Prefill tokens processed.", c.prompt_tokens, labels)
        x.metric("vllm:generation_tokens_total", "counter", "Generation tokens processed.", c.generation_tokens, labels)
        x.metric("vllm:num_preemptions_total", "counter", "Cumulative preemptions.", c.preemptions, labels)
        x.metric("vllm:request_success_total", "counter", "Successfully finished requests.", c.finished, labels)
        x.histogram("vllm:time_to_first_token_seconds", "Time to first token in seconds.", r.ttft, labels)
        x.histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency in seconds.", r.e2e, labels)
        x.histogram("vllm:request_queue_time_seconds", "Time spent waiting in the queue.", r.queue_time, labels)
        x.histogram(
            "vllm:request_prefill_time_seconds", "Time spent in the prefill phase.", r.prefill_time, labels,
        )  # fmt: skip
        x.histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", r.itl, labels)
        x.histogram(
            "vllm:request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds per request.",
            r.tpot, labels,
        )  # fmt: skip
        x.histogram("vllm:request_decode_time_seconds", "Time spent in the decode phase.", r.decode_time, labels)
        info = (
            f'block_size="{BLOCK_SIZE}",cache_dtype="auto",enable_prefix_caching="True",'
            f'gpu_memory_utilization="0.85",num_gpu_blocks="{e.blocks.num_blocks}",'
            f'num_cpu_blocks="None",engine="0"'
        )
        x.metric("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig.", 1, info)
        x.metric("sim:client_aborts_total", "counter", "Requests aborted because the client left.", r.client_aborts, labels)
        x.metric("sim:computed_prompt_tokens_total", "counter", "Prompt tokens actually prefilled.", c.computed_prompt_tokens, labels)
        x.metric("sim:busy_seconds_total", "counter", "Simulated seconds spent in engine steps.", c.busy_s, labels)
        x.metric(
            "sim:kv_held_seconds_total", "counter",
            "Simulated seconds of engine steps during which a waiting request waited for KV blocks.", c.kv_held_s, labels,
        )  # fmt: skip
        x.metric("sim:simulated_seconds", "gauge", "Simulated clock.", r.sim_now(), labels)
        self._render_nixl(x, labels)
        return x.render() + self._render_cached_by_tier(labels)

    def _render_nixl(self, x: Exposition, labels: str) -> None:
        """The worker's role and its side of prefill/decode disaggregation."""
        n, c, st = self.nixl, self.engine.counters, self.nixl.stats
        info = f'{labels},role="{self.config.role}",kv_engine_id="{escape_label(n.engine_id)}"'
        x.metric("kvroute_sim:worker_info", "gauge", "The worker's role (prefill, decode, both) and NIXL engine id.", 1, info)
        x.metric("kvroute_sim:nixl_held_blocks", "gauge", "KV blocks held for decode workers to pull.", n.held_blocks, labels)
        x.metric("kvroute_sim:nixl_held_requests", "gauge", "Finished prefill requests whose blocks are held.", len(n.holds), labels)
        x.metric("kvroute_sim:nixl_holds_total", "counter", "Prefill requests answered with kv_transfer_params.", st.holds, labels)
        x.metric(
            "kvroute_sim:nixl_prefill_no_params_total", "counter",
            "Prefill requests (do_remote_decode) answered without kv_transfer_params (a stop token).", st.no_params, labels,
        )  # fmt: skip
        x.family(
            "kvroute_sim:nixl_released_total", "counter",
            "Holds freed: read by a decode worker, released without a read, or expired.",
            [(f'{labels},reason="{k}"', v) for k, v in st.released.items()],
        )  # fmt: skip
        x.metric("kvroute_sim:nixl_released_blocks_total", "counter", "Held blocks freed.", st.released_blocks, labels)
        x.metric("kvroute_sim:nixl_pulls_total", "counter", "Requests whose prompt KV was pulled from a prefill worker.", c.pulls, labels)
        x.metric("kvroute_sim:nixl_pulled_blocks_total", "counter", "KV blocks pulled from prefill workers.", c.pulled_blocks, labels)
        x.metric("kvroute_sim:nixl_pulled_tokens_total", "counter", "Prompt tokens of KV pulled from prefill workers.", c.pulled_tokens, labels)
        x.metric("kvroute_sim:nixl_pull_seconds_total", "counter", "Simulated seconds of KV transfer from prefill workers.", st.pull_s, labels)
        x.family(
            "kvroute_sim:pd_local_prefills_total", "counter",
            "Prompts a worker prefilled itself where a pull was expected or asked for, by reason.",
            [(f'{labels},reason="{k}"', v) for k, v in st.local_prefills.items()],
        )  # fmt: skip

    def _render_cached_by_tier(self, labels: str) -> str:
        """`kvroute_sim:cached_tokens_total{tier=...}`: LMCache counts hits per storage
        backend; this counts every tier a prompt token can come from without being
        recomputed, the GPU included, so its samples sum to vLLM's prefix cache hits plus
        its external (connector) hits."""
        name = "kvroute_sim:cached_tokens_total"
        lines = [
            f"# HELP {name} Prompt tokens not recomputed, by the tier they were served from (gpu, pool, disk, remote).",
            f"# TYPE {name} counter",
        ]
        lines += [f'{name}{{{labels},tier="{tier}"}} {tokens}' for tier, tokens in self._cached_by_tier().items()]
        return "\n".join(lines) + "\n"


def _json(payload: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(payload), status_code=status, media_type="application/json")


def _error(status: int, message: str, type_: str, param: str | None = None) -> Response:
    return Response(shapes.error_body(status, message, type_, param), status_code=status, media_type="application/json")


# -- command line ---------------------------------------------------------------------------


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", default=DEFAULT_PROFILE, choices=sorted(PROFILES))
    p.add_argument("--time-scale", type=float, default=1.0, help="real seconds per simulated second")
    p.add_argument(
        "--speed", type=positive_float, default=1.0,
        help="relative speed of the simulated GPU: 0.5 = every step takes twice as long (POST /sim/speed changes it)",
    )  # fmt: skip
    p.add_argument("--kv-capacity-tokens", type=int, default=None, help="GPU KV capacity (default: from the profile)")
    p.add_argument("--max-tokens-default", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--get-load-format", choices=("sglang", "legacy"), default="sglang")
    p.add_argument(
        "--auto-tool-calls", choices=("call", "text"), default="call",
        help='tool_choice "auto": call the first tool after a user turn, or always answer in text',
    )  # fmt: skip
    p.add_argument(
        "--image-rule", default="auto",
        help="how an image counts: auto (by the model's name), qwen2_vl, pixtral, llava, gemma3, fixed:N",
    )  # fmt: skip
    p.add_argument(
        "--kv-link-gbps", type=positive_float, default=KV_LINK_GBPS,
        help="bandwidth of a KV pull from a prefill worker, Gb/s (default: one GPU's 400 Gb/s NIC)",
    )  # fmt: skip
    p.add_argument(
        "--nixl-abort-timeout-s", type=positive_float, default=NIXL_ABORT_TIMEOUT_S,
        help="simulated seconds a prefill worker holds unread KV blocks (vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT)",
    )  # fmt: skip


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError("must be positive")
    return value


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvroute sim-worker", description="one simulated vLLM worker")
    p.add_argument("--name", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--pool", default=None, help="URL of the shared pool (kvroute sim-pool)")
    p.add_argument("--kv-events", default=None, help="ZMQ endpoint to bind for KV events, tcp://HOST:PORT")
    p.add_argument("--kv-events-topic", default="")
    p.add_argument("--print-costs", action="store_true", help="print the derived cost model and exit")
    p.add_argument("--role", choices=ROLES, default="both", help="its part in a prefill/decode-disaggregated fleet")
    add_engine_args(p)
    return p.parse_args(argv)


def config_from_args(
    args: argparse.Namespace,
    name: str,
    port: int,
    pool: str | None,
    kv_events: str | None,
    speed: float | None = None,
    node: str | None = None,
    role: str | None = None,
) -> WorkerConfig:
    return WorkerConfig(
        name=name,
        port=port,
        host=args.host,
        model=args.model,
        profile=args.profile,
        time_scale=args.time_scale,
        speed=speed if speed is not None else args.speed,
        kv_capacity_tokens=args.kv_capacity_tokens,
        pool_url=pool,
        kv_events=kv_events,
        kv_events_topic=getattr(args, "kv_events_topic", ""),
        max_tokens_default=args.max_tokens_default,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        get_load_format=args.get_load_format,
        auto_tool_calls=args.auto_tool_calls,
        image_rule=args.image_rule,
        node=node,
        # Only sim-cluster, which builds the slower tiers, has their bandwidth flags.
        disk_gbytes_s=getattr(args, "disk_gbytes_s", DISK_GBYTES_S),
        remote_gbps=getattr(args, "remote_gbps", REMOTE_GBPS),
        role=role or getattr(args, "role", "both"),
        kv_link_gbps=args.kv_link_gbps,
        nixl_timeout_s=args.nixl_abort_timeout_s,
    )


def cli(argv: list[str]) -> int:
    from loadtests.sim.costs import summary
    from loadtests.sim.serving import QuietServer, Teardown, run_servers, server_for

    args = parse_args(argv)
    if args.print_costs:
        model = build_cost_model(args.profile, kv_link_gbps=args.kv_link_gbps)
        print(orjson.dumps(summary(model), option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS).decode())
        return 0
    config = config_from_args(args, args.name, args.port, args.pool, args.kv_events)

    async def build() -> tuple[list[QuietServer], Teardown]:
        worker = SimWorker(config)
        return [server_for(worker.app, config.host, config.port)], worker.close

    return run_servers(build, on_ready=lambda: print("READY", flush=True))


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
