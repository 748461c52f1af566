"""The worker's Responses, Messages and pooling endpoints: output built from a finished (or
streaming) engine job, the stored-response routes, `count_tokens`, rerank and score.

The inference itself is the worker's chat path (worker.py); this module only turns a job's
output into vLLM's Responses / Anthropic shapes (see agent_apis.py for the sources).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from loadtests.sim import agent_apis as agent
from loadtests.sim import openai_shapes as shapes
from loadtests.sim.asgi import Send, send_chunk, start_sse
from normalizer.prefix import chat_segments, prompt_bytes
from normalizer.tokens import CHARS_PER_TOKEN

if TYPE_CHECKING:
    from loadtests.sim.runner import Handle
    from loadtests.sim.worker import Job, SimWorker

Headers = list[tuple[bytes, bytes]]


def _json(payload: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(payload), status_code=status, media_type="application/json")


def _openai_error(exc: shapes.RequestError) -> Response:
    return Response(shapes.error_body(exc.status, exc.message, exc.type, exc.param), exc.status, media_type="application/json")


def messages_error(status: int, message: str, type_: str, param: str | None = None) -> Response:
    return Response(agent.anthropic_error(status, message, type_), status_code=status, media_type="application/json")


# -- Responses -------------------------------------------------------------------------------


def _output_item(job: Job, status: str = "completed") -> dict[str, Any]:
    text = "".join(job.pieces) if status == "completed" else ""
    if job.tool is None:
        return agent.message_item(job.item_id, text, status)
    return agent.function_call_item(job.item_id, job.tool_call_id, job.tool["function"]["name"], text, status)


def _response(worker: SimWorker, job: Job, output: list[dict[str, Any]], status: str, usage: shapes.Usage | None) -> dict[str, Any]:
    max_out = job.request.get("max_output_tokens") or worker.max_model_len - job.prompt_len
    return agent.response_object(
        f"resp_{job.rid}", job.request, worker.config.model, job.created, output, status, max_out, usage
    )


def final_response(worker: SimWorker, job: Job) -> dict[str, Any]:
    """The completed response object; stored (with its prompt's messages) unless `store: false`."""
    status = "incomplete" if job.finish_reason == "length" else "completed"
    out = _response(worker, job, [_output_item(job)], status, worker.usage(job, job.out_tokens))
    if job.request.get("store", True) is not False:
        worker.store.put(out, job.messages)
    return out


async def stream_responses(worker: SimWorker, job: Job, handle: Handle, send: Send, headers: Headers) -> None:
    """vLLM's event order: created, in_progress, (at the first token) output_item.added
    [+ content_part.added], deltas, the item's done events, completed."""
    events = agent.ResponseEvents()
    await start_sse(send, headers)
    initial = _response(worker, job, [], "in_progress", None)
    await send_chunk(send, events.event("response.created", response=initial))
    await send_chunk(send, events.event("response.in_progress", response=initial))
    item = _output_item(job, "in_progress")
    sent = 0
    while sent < job.out_tokens:
        upto = await worker.next_progress(handle, sent)
        if sent == 0:
            for chunk in events.open_item(item):
                await send_chunk(send, chunk)
        await send_chunk(send, events.delta(item, "".join(job.pieces[sent:upto])))
        sent = upto
    final = final_response(worker, job)
    for chunk in events.close_item(final["output"][0]):
        await send_chunk(send, chunk)
    await send_chunk(send, events.event("response.completed", response=final), more=False)


# -- Messages --------------------------------------------------------------------------------


def _content(job: Job) -> list[dict[str, Any]]:
    text = "".join(job.pieces)
    if job.tool is None:
        return [{"type": "text", "text": text}]
    return [agent.tool_use_block(job.tool_call_id, job.tool["function"]["name"], text)]


def final_message(worker: SimWorker, job: Job) -> dict[str, Any]:
    stop = agent.stop_reason(job.finish_reason, job.tool is not None)
    return agent.message_object(job.item_id, worker.config.model, _content(job), stop, worker.usage(job, job.out_tokens))


async def stream_messages(worker: SimWorker, job: Job, handle: Handle, send: Send, headers: Headers) -> None:
    """vLLM's order: message_start, content_block_start, deltas, content_block_stop,
    message_delta (stop_reason, usage), message_stop. vLLM sends no ping."""
    await start_sse(send, headers)
    model, sent = worker.config.model, 0
    if job.tool is None:
        block: dict[str, Any] = {"type": "text", "text": ""}
    else:
        block = {"type": "tool_use", "id": job.tool_call_id, "name": job.tool["function"]["name"], "input": {}}
    while sent < job.out_tokens:
        upto = await worker.next_progress(handle, sent)
        if sent == 0:
            start = agent.message_object(job.item_id, model, [], None, worker.usage(job, 0), stream_start=True)
            await send_chunk(send, agent.anthropic_event("message_start", message=start))
            await send_chunk(send, agent.anthropic_event("content_block_start", index=0, content_block=block))
        text = "".join(job.pieces[sent:upto])
        delta = {"type": "text_delta", "text": text} if job.tool is None else {"type": "input_json_delta", "partial_json": text}
        await send_chunk(send, agent.anthropic_event("content_block_delta", index=0, delta=delta))
        sent = upto
    await send_chunk(send, agent.anthropic_event("content_block_stop", index=0))
    stop = {"stop_reason": agent.stop_reason(job.finish_reason, job.tool is not None), "stop_sequence": None}
    usage = agent.anthropic_usage(worker.usage(job, sent))
    await send_chunk(send, agent.anthropic_event("message_delta", delta=stop, usage=usage))
    await send_chunk(send, agent.anthropic_event("message_stop"), more=False)


# -- pooling (rerank, score): deterministic scores, no engine time ----------------------------


def _texts(value: Any, name: str) -> list[str]:
    items = value if isinstance(value, list) else [value]
    if not items or not all(isinstance(t, str) for t in items):
        raise shapes.RequestError(400, f"{name}: a string or a non-empty list of strings is required", param=name)
    return items


def _score(a: str, b: str) -> float:
    """A relevance in [0, 1) from the pair's bytes: stable across runs and workers."""
    return shapes.seed_of(a.encode() + b"\x00" + b.encode(), "score") / 2**64


def _tokens(*texts: str) -> int:
    return sum(len(t.encode()) for t in texts) // CHARS_PER_TOKEN


async def _pooling_body(worker: SimWorker, request: Request) -> dict[str, Any]:
    worker.requests_total += 1
    body = shapes.json_object(await request.body())
    shapes.check_model(body, worker.config.model)
    return body


def _rerank(worker: SimWorker, body: dict[str, Any]) -> dict[str, Any]:
    query = _texts(body.get("query"), "query")[0]
    documents = _texts(body.get("documents"), "documents")
    top_n = body.get("top_n") or len(documents)
    if isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 0:
        raise shapes.RequestError(400, "top_n must be a non-negative integer", param="top_n")
    results = [
        {"index": i, "document": {"text": d, "multi_modal": None}, "relevance_score": _score(query, d)}
        for i, d in enumerate(documents)
    ]
    results.sort(key=lambda r: r["relevance_score"], reverse=True)
    n = sum(_tokens(query, d) for d in documents)
    return {
        "id": f"rerank-{shapes.seed_of(orjson.dumps(body)):016x}",
        "model": worker.config.model,
        "usage": {"prompt_tokens": n, "total_tokens": n},
        "results": results[:top_n],
    }


def _score_pairs(body: dict[str, Any]) -> list[tuple[str, str]]:
    """vLLM's score inputs (`queries`/`documents`, `queries`/`items`, `text_1`/`text_2`): one
    left side against many right ones, or equally long lists pairwise."""
    for left, right in (("queries", "documents"), ("queries", "items"), ("text_1", "text_2")):
        if left in body:
            one, two = _texts(body.get(left), left), _texts(body.get(right), right)
            if len(one) == 1:
                one = one * len(two)
            if len(one) != len(two):
                raise shapes.RequestError(400, f"{left} and {right} must be one against many or equally long", param=right)
            return list(zip(one, two, strict=True))
    raise shapes.RequestError(400, "expected queries + documents, queries + items or text_1 + text_2")


def _scores(worker: SimWorker, body: dict[str, Any]) -> dict[str, Any]:
    pairs = _score_pairs(body)
    n = sum(_tokens(a, b) for a, b in pairs)
    return {
        "id": f"score-{shapes.seed_of(orjson.dumps(body)):016x}",
        "object": "list",
        "created": shapes.now_s(),
        "model": worker.config.model,
        "data": [{"index": i, "object": "score", "score": _score(a, b)} for i, (a, b) in enumerate(pairs)],
        "usage": {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0, "prompt_tokens_details": None},
    }


# -- routes ------------------------------------------------------------------------------------


def agent_routes(worker: SimWorker) -> list[Route]:
    async def get_response(request: Request) -> Response:
        stored = worker.store.get(request.path_params["response_id"])
        if stored is None:
            return _openai_error(agent.not_found(request.path_params["response_id"]))
        return _json(stored.response)

    async def cancel_response(request: Request) -> Response:
        stored = worker.store.get(request.path_params["response_id"])
        if stored is None:
            return _openai_error(agent.not_found(request.path_params["response_id"]))
        # Only background responses can be cancelled in vLLM; the simulator has none.
        return _openai_error(
            shapes.RequestError(400, "Cannot cancel a synchronous response.", "invalid_request_error", "response_id")
        )

    async def count_tokens(request: Request) -> Response:
        try:
            body = await _pooling_body(worker, request)
            chat = agent.messages_chat(body)
            n = len(prompt_bytes(chat_segments(chat, worker.media))) // CHARS_PER_TOKEN
        except shapes.RequestError as exc:
            return messages_error(exc.status, exc.message, exc.type)
        except (TypeError, ValueError, AttributeError, KeyError) as exc:
            return messages_error(400, f"malformed request: {exc}", "BadRequestError")
        return _json({"input_tokens": n, "context_management": {"original_input_tokens": n}})

    def pooling(build: Any) -> Any:
        async def endpoint(request: Request) -> Response:
            try:
                return _json(build(worker, await _pooling_body(worker, request)))
            except shapes.RequestError as exc:
                return _openai_error(exc)

        return endpoint

    rerank, score = pooling(_rerank), pooling(_scores)
    return [
        Route("/v1/responses/{response_id}", get_response, methods=["GET"]),
        Route("/v1/responses/{response_id}/cancel", cancel_response, methods=["POST"]),
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
        *(Route(path, rerank, methods=["POST"]) for path in ("/rerank", "/v1/rerank", "/v2/rerank")),
        *(Route(path, score, methods=["POST"]) for path in ("/score", "/v1/score")),
    ]
