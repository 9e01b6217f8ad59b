"""The HTTP edge's ASGI middlewares: each wraps the whole app and acts before (or after) any
route runs, so what it refuses never reaches a parser or a worker.

``InternalErrors`` (a 500 for what no handler took, the connection kept), ``BodyLimit`` (413
before a body is read past the limit), ``ClientConcurrency`` (429 past a
client's concurrent requests, the slot held to the response's end), ``RequestMetrics`` (counts
and latencies by endpoint and status, to the last byte of a stream).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.concurrency import ConcurrencyLimiter, client_of_host
from gateway.errors import (
    GatewayError,
    InvalidRequest,
    RequestTooLarge,
    TooManyRequests,
    error_body,
    error_headers,
)
from gateway.metrics import GatewayMetrics

log = logging.getLogger(__name__)

GENERATE = ("/v1/completions", "/v1/chat/completions")
ENDPOINTS = (*GENERATE, "/v1/models", "/health", "/metrics")
CLIENT_CLOSED = 499  # nginx's code for "the client went away first"


class InternalErrors:
    """A 500 with an OpenAI error body for an exception no handler took, on the same connection.

    Starlette's last resort (``ServerErrorMiddleware``) sends its 500 and then re-raises, so the
    server logs it again and drops the connection: a keep-alive client's next request on it was
    reset (seen: a response that failed to serialize, then the client's next call failed with
    ECONNRESET). Here the exception ends with the response. Once a response has started (a
    stream), nothing more can be said in it: re-raised, and the server ends the stream."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as e:
            if started:
                raise
            log.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            status, body = error_body(e)
            await JSONResponse(body, status_code=status)({"type": "http"}, _no_receive, send)


class BodyLimit:
    """Refuses request bodies over ``max_bytes`` (413) before anyone parses them: by the
    Content-Length header when there is one, by counting the chunks when there is not."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        try:
            declared = int(length) if length is not None else None
        except ValueError:
            await _send_error(send, InvalidRequest("invalid Content-Length header"))
            return
        if declared is not None and declared > self.max_bytes:
            await _send_error(send, self._too_large())
            return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise self._too_large()
            return message

        await self.app(scope, limited, send)

    def _too_large(self) -> RequestTooLarge:
        return RequestTooLarge(
            f"The request body is larger than {self.max_bytes} bytes.", code="request_too_large"
        )


async def _send_error(send: Send, err: GatewayError) -> None:
    status, body = error_body(err)
    response = JSONResponse(body, status_code=status, headers=error_headers(err))
    await response({"type": "http"}, _no_receive, send)


class ClientConcurrency:
    """Holds one of the client's slots (``gateway.concurrency``) for each generation request,
    from accept until the app returns: for a stream that is after its last event, or once
    Starlette saw the client disconnect and cancelled it, so every way a request ends (done,
    error, disconnect, cancellation) gives the slot back. Over a limit: 429 with Retry-After,
    before the body is read."""

    def __init__(self, app: ASGIApp, limiter: ConcurrencyLimiter) -> None:
        self.app = app
        self.limiter = limiter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in GENERATE:
            await self.app(scope, receive, send)
            return
        peer = scope.get("client")
        client = client_of_host(peer[0] if peer else None)
        try:
            self.limiter.acquire(client)
        except TooManyRequests as e:
            await _send_error(send, e)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.limiter.release(client)


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}


class RequestMetrics:
    """Counts requests by endpoint and status and times them to the end of the response
    (the last SSE event for streams)."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        endpoint = (
            path if path in ENDPOINTS else "/admin" if path.startswith("/admin/") else "other"
        )
        start = time.perf_counter()
        status: list[Any] = [CLIENT_CLOSED]

        async def send_and_record(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            self.metrics.requests.labels(endpoint, str(status[0])).inc()
            self.metrics.request_latency.labels(endpoint).observe(time.perf_counter() - start)
