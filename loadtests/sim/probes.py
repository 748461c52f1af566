"""Endpoints other routers and tools probe on a worker, answered from the simulated engine.

* vLLM: `/tokenize`, `/detokenize`, `/version`, `/ping`, `POST /v1/chat/completions/render`
  (the rendered prompt as token ids, which precise-prefix routers hash themselves).
* SGLang-style probes. At start-up smg (lightseekorg/smg,
  model_gateway/src/core/steps/worker/local/) reads `/v1/models` (`owned_by` "vllm" makes
  it treat the worker as vLLM), `/server_info` (falling back to `/get_server_info`) and
  `/model_info` (`/get_model_info`), then health-checks `/health`. vllm-router
  (vllm-project/router, src/routers/http/router.rs) only waits for `/health` and, with the
  power_of_two policy, polls `/get_load`. `/get_load` answers SGLang's current shape (a
  list per DP rank, which smg reads) or, with `--get-load-format legacy`, `{"load": n}`
  (what sgl-router-derived routers such as vllm-router read).
* `/kv_event_sources`: where this worker publishes KV events (only with --kv-events).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from loadtests.sim import openai_shapes as shapes
from loadtests.sim.engine import BLOCK_SIZE, signed_token_ids, token_ids_of
from normalizer import prefix
from normalizer.prefix import chat_segments, completion_segments

if TYPE_CHECKING:
    from loadtests.sim.worker import SimWorker

SIM_VLLM_VERSION = "0.11.0+sim"


def _json(payload: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(payload), status_code=status, media_type="application/json")


def _error(status: int, message: str) -> Response:
    type_ = "NotFoundError" if status == 404 else "BadRequestError"
    return Response(shapes.error_body(status, message, type_), status_code=status, media_type="application/json")


async def _body(request: Request) -> dict[str, Any]:
    return shapes.json_object(await request.body())


def probe_routes(worker: SimWorker) -> list[Route]:
    cfg = worker.config

    def check_model(body: dict[str, Any]) -> None:
        model = body.get("model")
        if model is not None and model != cfg.model:
            raise shapes.RequestError(404, f"The model `{model}` does not exist.")

    def prompt_bytes(body: dict[str, Any]) -> bytes:
        if "messages" in body:
            if not isinstance(body["messages"], list):
                raise shapes.RequestError(400, "messages must be a list")
            return prefix.prompt_bytes(chat_segments(body, worker.media))
        if "prompt" in body:
            prompt = body["prompt"]
            if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                if not all(-(1 << 31) <= t < 1 << 32 for t in prompt):
                    raise shapes.RequestError(400, "token ids must fit in 32 bits")
                body = {**body, "prompt": signed_token_ids(prompt)}
            return b"".join(completion_segments(body))
        raise shapes.RequestError(400, "either prompt or messages is required")

    async def tokenize(request: Request) -> Response:
        try:
            body = await _body(request)
            check_model(body)
            ids = token_ids_of(prompt_bytes(body))
        except shapes.RequestError as exc:
            return _error(exc.status, exc.message)
        return _json({"count": len(ids), "max_model_len": worker.max_model_len, "tokens": ids, "token_strs": None})

    async def detokenize(request: Request) -> Response:
        try:
            body = await _body(request)
            check_model(body)
            tokens = body.get("tokens")
            if not isinstance(tokens, list) or not all(
                isinstance(t, int) and -(1 << 31) <= t < 1 << 32 for t in tokens
            ):
                raise shapes.RequestError(400, "tokens must be a list of 32-bit ints")
        except shapes.RequestError as exc:
            return _error(exc.status, exc.message)
        data = b"".join((t % (1 << 32)).to_bytes(4, "little") for t in tokens)
        return _json({"prompt": data.decode("utf-8", errors="replace")})

    async def render(request: Request) -> Response:
        try:
            body = await _body(request)
            check_model(body)
            if not isinstance(body.get("messages"), list):
                raise shapes.RequestError(400, "messages must be a list")
            ids = token_ids_of(prefix.prompt_bytes(chat_segments(body, worker.media)))
        except shapes.RequestError as exc:
            return _error(exc.status, exc.message)
        return _json({"token_ids": ids, "count": len(ids)})

    async def version(request: Request) -> Response:
        return _json({"version": SIM_VLLM_VERSION})

    async def ping(request: Request) -> Response:
        return Response(b"", status_code=200)

    async def server_info(request: Request) -> Response:
        e = worker.engine
        return _json(
            {
                "model_id": cfg.model,
                "model_path": cfg.model,
                "served_model_name": cfg.model,
                "tokenizer_path": cfg.model,
                "host": cfg.host,
                "port": cfg.port,
                "tp_size": e.cost.profile.tp,
                "dp_size": 1,
                "page_size": BLOCK_SIZE,
                "max_total_num_tokens": e.capacity_tokens,
                "max_total_tokens": e.capacity_tokens,
                "max_prefill_tokens": e.max_num_batched_tokens,
                "max_running_requests": e.max_num_seqs,
                "max_num_reqs": e.max_num_seqs,
                "max_batch_size": e.max_num_seqs,
                "chunked_prefill_size": e.max_num_batched_tokens,
                "context_length": worker.max_model_len,
                "disaggregation_mode": "null",
                "kv_events_config": orjson.dumps({"endpoint": cfg.kv_events, "topic": cfg.kv_events_topic}).decode()
                if cfg.kv_events
                else None,
                "version": SIM_VLLM_VERSION,
                "internal_states": [{"last_gen_throughput": 0.0, "load": len(e.running) + len(e.waiting)}],
            }
        )

    async def model_info(request: Request) -> Response:
        return _json(
            {
                "model_path": cfg.model,
                "tokenizer_path": cfg.model,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "default",
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
                "max_model_len": worker.max_model_len,
            }
        )

    async def get_load(request: Request) -> Response:
        e = worker.engine
        if cfg.get_load_format == "legacy":
            # sgl-router / vllm-router read {"load": n} (requests on the worker).
            return _json({"load": len(e.running) + len(e.waiting)})
        # Current SGLang (and smg): one object per DP rank.
        return _json(
            [
                {
                    "dp_rank": 0,
                    "num_reqs": len(e.running) + len(e.waiting),
                    "num_waiting_reqs": len(e.waiting),
                    "num_tokens": e.blocks.used * BLOCK_SIZE,
                }
            ]
        )

    async def kv_event_sources(request: Request) -> Response:
        if not cfg.kv_events:
            return _error(404, "this worker does not publish KV events (start it with --kv-events)")
        return _json(
            {
                "sources": [
                    {
                        "endpoint": cfg.kv_events,
                        "topic": cfg.kv_events_topic,
                        "format": "vllm-msgpack",
                        "block_size": BLOCK_SIZE,
                        "dp_rank": 0,
                        "worker": cfg.name,
                        "model": cfg.model,
                    }
                ]
            }
        )

    return [
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/v1/chat/completions/render", render, methods=["POST"]),
        Route("/version", version, methods=["GET"]),
        Route("/ping", ping, methods=["GET", "POST"]),
        Route("/server_info", server_info, methods=["GET"]),
        Route("/get_server_info", server_info, methods=["GET"]),
        Route("/model_info", model_info, methods=["GET"]),
        Route("/get_model_info", model_info, methods=["GET"]),
        Route("/get_load", get_load, methods=["GET"]),
        Route("/kv_event_sources", kv_event_sources, methods=["GET"]),
    ]
