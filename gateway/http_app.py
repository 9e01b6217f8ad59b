"""The HTTP edge: OpenAI-compatible endpoints, health, metrics, admin pass-through, and the
cache dashboard (``gateway.dashboard``).

Every error leaves as an OpenAI error body (``{"error": {"message", "type", "param",
"code"}}``) with a 4xx/5xx status, whatever raised it: a typed gateway error, a schema
violation, an unknown path, an oversized body. Bodies are parsed here rather than by
FastAPI's body binding, so a JSON body is accepted whatever Content-Type curl sent and every
validation message has the same shape.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect

from gateway.admin_routes import admin_router
from gateway.core import Gateway
from gateway.dashboard import dashboard_router
from gateway.errors import (
    OUTAGE_RETRY_AFTER_S,
    STARTING_RETRY_AFTER_S,
    GatewayError,
    Unauthorized,
    error_body,
    error_headers,
    openai_error_body,
)
from gateway.metrics import CONTENT_TYPE
from gateway.middleware import (
    CLIENT_CLOSED,
    BodyLimit,
    ClientConcurrency,
    InternalErrors,
    RequestMetrics,
)
from gateway.openai_serving import Served
from gateway.openapi_schema import document_bodies
from gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    parse_json,
)
from gateway.streams import settle

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


def create_app(gw: Gateway) -> FastAPI:
    app = FastAPI(
        title="kvserve gateway",
        summary="OpenAI-compatible API over a shared, paged, prefix-indexed KV cache",
        version="0.1.0",
    )
    # The first added is the innermost: InternalErrors answers inside the metrics and the
    # concurrency slot, which then see its 500 like any other response.
    app.add_middleware(InternalErrors)
    app.add_middleware(BodyLimit, max_bytes=gw.config.max_body_bytes)
    app.add_middleware(ClientConcurrency, limiter=gw.concurrency)
    app.add_middleware(RequestMetrics, metrics=gw.metrics)
    if origins := gw.config.cors_origins:
        # Outermost: a browser's preflight (OPTIONS) is answered before any limit or route,
        # and every response, errors included, carries the headers a page needs to read it.
        app.add_middleware(
            CORSMiddleware, allow_origins=list(origins), allow_methods=["*"], allow_headers=["*"]
        )
    _install_error_handlers(app)
    app.include_router(admin_router(gw))
    app.include_router(dashboard_router(gw))
    _add_health_routes(app, gw)
    _add_openai_routes(app, gw)
    document_bodies(
        app, {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}
    )
    return app


def _add_health_routes(app: FastAPI, gw: Gateway) -> None:
    """/health (for load balancers) and /metrics (Prometheus)."""

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while at least one worker is healthy, 503 otherwise (load balancers stop
        sending here)."""
        body, ok, retry = health_report(gw)
        headers = {} if ok else {"retry-after": str(retry)}
        return JSONResponse(body, status_code=200 if ok else 503, headers=headers)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(gw.metrics.render(), media_type=CONTENT_TYPE)


def health_report(gw: Gateway) -> tuple[dict[str, Any], bool, float]:
    """/health's body, whether it is healthy (some worker is and the cache service is
    reachable), and the Retry-After to send when not."""
    workers = [
        {
            "worker": w.pool_id,
            "address": w.address,
            "healthy": w.healthy,
            "reason": w.unhealthy_reason or None,
            "in_flight": w.in_flight,
            # An unhealthy worker's last poll is stale: its requests are not running.
            "running": w.load.running if w.load and w.healthy else None,
            "waiting": w.load.waiting if w.load and w.healthy else None,
            "max_pending_requests": w.load.max_pending if w.load else None,
        }
        for w in gw.directory.views()
    ]
    cache = gw.cache_status
    cache_body = {
        "reachable": cache.down_since is None,
        "unreachable_for_s": round(cache.down_for(), 1),
        "error": cache.last_error if cache.down_since is not None else None,
    }
    ok = any(w["healthy"] for w in workers) and not cache.down
    # "starting": no worker has registered yet (a worker loads its model for seconds).
    if cache.down:
        status, retry = "cache service unreachable", OUTAGE_RETRY_AFTER_S
    else:
        status = "ok" if ok else "no healthy worker" if workers else "starting"
        retry = STARTING_RETRY_AFTER_S
    body = {"status": status, "model": gw.config.model_name, "cache_service": cache_body}
    return {**body, "workers": workers}, ok, retry


def _add_openai_routes(app: FastAPI, gw: Gateway) -> None:
    """/v1/models, /v1/completions and /v1/chat/completions, behind the API key if one is set."""

    def check_api_key(request: Request) -> None:
        if not gw.config.api_key:
            return
        if not bearer_matches(request.headers.get("authorization", ""), gw.config.api_key):
            raise Unauthorized("Incorrect API key provided.", code="invalid_api_key")

    def model_card() -> ModelCard:
        return ModelCard(
            id=gw.config.model_name,
            created=gw.started_at,
            root=gw.config.model,
            # What a request can use: the model's context, or the largest KV pool if smaller.
            max_model_len=gw.serving.max_context,
            runners=sorted(
                {w.load.runner for w in gw.directory.views() if w.load and w.load.runner}
            ),
        )

    @app.get("/v1/models")
    async def models(request: Request) -> ModelList:
        check_api_key(request)
        return ModelList(data=[model_card()])

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> ModelCard:
        check_api_key(request)
        gw.serving.check_model(model_id)
        return model_card()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        arrival = time.perf_counter()
        check_api_key(request)
        body = await parse_body(request, CompletionRequest)
        return respond(await until_disconnected(request, gw.completions.create(body, arrival)))

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        arrival = time.perf_counter()
        check_api_key(request)
        body = await parse_body(request, ChatCompletionRequest)
        return respond(await until_disconnected(request, gw.chat.create(body, arrival)))


def respond(served: Served) -> Response:
    if served.events is not None:
        headers = {**served.headers, "cache-control": "no-cache", "x-accel-buffering": "no"}
        return StreamingResponse(served.events, media_type="text/event-stream", headers=headers)
    assert served.body is not None
    return JSONResponse(served.body.model_dump(mode="json"), headers=served.headers)


# Bodies at least this large are parsed on a worker thread: a 4 MB body takes tens of ms.
OFF_LOOP_BODY_BYTES = 64 * 1024


async def parse_body(request: Request, model: type[M]) -> M:
    body = await request.body()
    if len(body) < OFF_LOOP_BODY_BYTES:
        return parse_json(body, model)
    return await asyncio.to_thread(parse_json, body, model)


def bearer_matches(header: str, secret: str) -> bool:
    """``Authorization: Bearer <secret>``, the scheme in any case (RFC 9110, 11.1)."""
    scheme, _, given = header.partition(" ")
    ok_scheme = scheme.lower() == "bearer"
    return hmac.compare_digest(given.strip().encode(), secret.encode()) and ok_scheme


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it if the client disconnects first.

    Cancelling the work cancels its worker calls, so a client that gives up on a long
    non-streaming request frees the worker's batch slot and KV blocks at once. (Streaming
    responses get the same from Starlette, which cancels the stream on disconnect.)
    """
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        log.info("client disconnected; cancelling %s %s", request.method, request.url.path)
        raise ClientDisconnected()
    finally:
        await settle(watcher)
        await settle(task)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(GatewayError)
    async def gateway_error(_: Request, exc: GatewayError) -> JSONResponse:
        status, body = error_body(exc)
        return JSONResponse(body, status_code=status, headers=error_headers(exc))

    @app.exception_handler(ClientDisconnected)
    async def disconnected(_: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=CLIENT_CLOSED)

    @app.exception_handler(ClientDisconnect)
    async def disconnected_in_body(request: Request, exc: ClientDisconnect) -> Response:
        # Starlette's own, from ``request.body()`` when the client closes the connection
        # before its whole body arrived: the client went away, as above (499 in the metrics,
        # nobody to answer), not an error of the gateway's (it was a 500, logged with a
        # traceback by InternalErrors).
        log.info(
            "client disconnected while sending its request body: %s %s",
            request.method,
            request.url.path,
        )
        return Response(status_code=CLIENT_CLOSED)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        loc = [str(p) for p in errors[0]["loc"] if p not in ("body", "query", "path")]
        param = ".".join(loc) or None
        msg = f"{param}: {errors[0]['msg']}" if param else str(errors[0]["msg"])
        body = openai_error_body(msg, "invalid_request_error", param=param)
        return JSONResponse(body, status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        body = openai_error_body(str(exc.detail), kind, code=exc.status_code)
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        status, body = error_body(exc)
        return JSONResponse(body, status_code=status)
