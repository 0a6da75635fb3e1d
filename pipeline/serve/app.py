"""The HTTP layer: `POST /v1/chat/completions` (JSON or server-sent events), `GET /v1/models`, `GET /health`,
`GET /metrics` (Prometheus text, `metrics.py`).

Why Starlette + uvicorn: the server needs exactly three routes, a streaming response for server-sent events and a
standard ASGI server; Starlette (the toolkit FastAPI is built on) gives that without a validation layer, so every
request error is answered in OpenAI's error shape by `protocol.parse_chat` instead of FastAPI's 422 format, and
uvicorn runs it in a thread for tests as easily as from the command line.

Streaming: each round the runtime commits tokens (several when a draft is accepted); the text so far goes through
`calls.CallStream`, which sends `content` deltas while the text cannot be a call and tool-call deltas (id + name,
then argument pieces) once a call's name is known. The non-streaming answer is `calls.view` of the whole text, so
the stream's deltas concatenate to exactly that answer. The last chunk carries `finish_reason`; with
`stream_options.include_usage` a usage chunk follows; then `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .calls import CallStream, view
from .engine import Engine, Job
from .protocol import (MAX_BODY_BYTES, ApiError, Chat, chunk, completion, finish_reason, load_body, parse_chat,
                       read_body, usage)

log = logging.getLogger("pipeline.serve")


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def new_call_id(_index: int = 0) -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def max_calls(chat: Chat) -> int | None:
    return None if chat.parallel_tool_calls else 1  # parallel_tool_calls false: only the first call


def answer(engine: Engine, job: Job, result) -> dict:
    """The non-streaming chat.completion for a finished job."""
    chat = job.chat
    final = view(job.prefix + result.text, final=True, find_calls=chat.find_calls, max_calls=max_calls(chat))
    ids = [new_call_id() for _ in final.calls]
    return completion(chat, final, ids, result.stats.stop, usage(job.prompt_tokens, result.stats))


async def _stream(engine: Engine, job: Job, events: asyncio.Queue):
    chat, stop_ids = job.chat, engine.target.stop_ids
    calls = CallStream(chat.find_calls, max_calls(chat), call_id=new_call_id)
    ids: list[int] = []
    finished = False
    try:
        yield sse(chunk(chat, {"role": "assistant", "content": ""}))
        while True:
            kind, value = await events.get()
            if kind == "tokens":
                ids += [t for t in value if t not in stop_ids]
                text = job.prefix + engine.target.decode(ids)
                for delta in calls.feed(text):
                    yield sse(chunk(chat, delta))
                continue
            if kind == "error":
                yield sse(value.body())
                break
            result = value
            for delta in calls.feed(job.prefix + result.text, final=True):
                yield sse(chunk(chat, delta))
            use = usage(job.prompt_tokens, result.stats)
            yield sse(chunk(chat, {}, finish_reason(calls.sent.calls, result.stats.stop)))
            if chat.include_usage:
                yield sse(chunk(chat, use=use))
            break
        finished = True
        yield "data: [DONE]\n\n"
    except RuntimeError as e:  # a stream that diverged from its final answer: say so rather than end silently
        log.exception("%s: stream failed", chat.id)
        finished = True
        yield sse(ApiError(500, f"stream failed: {e}", kind="server_error").body())
        yield "data: [DONE]\n\n"
    finally:
        if not finished:
            job.cancelled = True  # the client went away: the worker stops at its next commit


def create_app(engine: Engine, max_body_bytes: int = MAX_BODY_BYTES) -> Starlette:
    """The ASGI app over a (started) engine; the caller owns the engine and closes it. A request body past
    `max_body_bytes` is refused with 413 (`protocol.read_body`)."""
    if int(max_body_bytes) < 1:
        raise ValueError(f"max_body_bytes={max_body_bytes!r}: expected a number of bytes >= 1")
    engine.start()

    async def chat_completions(request: Request):
        try:
            auth = request.headers.get("authorization", "")
            key = auth[7:].strip() if auth.lower().startswith("bearer ") else None
            chat = parse_chat(load_body(await read_body(request, max_body_bytes)), engine.model_name, api_key=key)
            job = await run_in_threadpool(engine.prepare, chat)
            events: asyncio.Queue = asyncio.Queue()
            engine.submit(job, asyncio.get_running_loop(), events)
        except ApiError as e:
            engine.metrics.rejected(e.status, e.message)
            return error_response(e)
        if chat.stream:
            return StreamingResponse(_stream(engine, job, events), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        while True:  # a non-streaming client that goes away cancels its job too (checked twice a second)
            try:
                kind, value = await asyncio.wait_for(events.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    job.cancelled = True
                    return Response(status_code=499)  # nobody reads it (nginx's "client closed request")
                continue
            if kind == "error":
                return error_response(value)
            if kind == "done":
                return JSONResponse(answer(engine, job, value))

    async def models(_request: Request):
        return JSONResponse({"object": "list", "data": [{"id": engine.model_name, "object": "model",
                                                         "created": 0, "owned_by": "ooo-spec"}]})

    async def metrics(_request: Request):
        body, content_type = engine.metrics.text()
        return Response(body, media_type=content_type)

    async def health(_request: Request):
        body, status = engine.health()
        return JSONResponse(body, status_code=status)

    async def http_error(_request: Request, exc: HTTPException):
        return error_response(ApiError(exc.status_code, f"{exc.detail}: {_request.method} {_request.url.path}",
                                       code="not_found" if exc.status_code == 404 else None))

    routes = [Route("/v1/chat/completions", chat_completions, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]),
              Route("/health", health, methods=["GET"]),
              Route("/metrics", metrics, methods=["GET"])]
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error})


__all__ = ["create_app", "answer", "error_response"]
