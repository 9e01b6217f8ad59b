"""Bytes that do not parse as the method's request are INVALID_ARGUMENT, not UNKNOWN.

grpc.aio calls the request deserializer before any handler runs, and a ``DecodeError`` there
ends the call UNKNOWN with a logged traceback: a client could fill the logs with corrupt
messages, and a caller cannot tell its own bad input from a server fault. Every server here
installs this interceptor: it swaps each unary-request handler's deserializer for one that
turns a parse failure into a marker, and the handler answers the marker INVALID_ARGUMENT.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError


class _Malformed:
    def __init__(self, error: DecodeError) -> None:
        self.error = error


def _parse(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except DecodeError as e:
            return _Malformed(e)

    return parse


def _refuse(method: str, err: _Malformed) -> str:
    return f"{method}: the request is not a valid message ({err.error})"


def _unary(behavior: Callable[..., Awaitable[Any]], method: str) -> Callable[..., Awaitable[Any]]:
    async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _refuse(method, request))
        return await behavior(request, context)

    return handle


def _stream(behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
    async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _refuse(method, request))
        async for response in behavior(request, context):
            yield response

    return handle


class MalformedRequests(grpc.aio.ServerInterceptor):
    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = details.method
        parse = _parse(handler.request_deserializer)
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _unary(handler.unary_unary, method), parse, handler.response_serializer
            )
        if handler.unary_stream is not None and inspect.isasyncgenfunction(handler.unary_stream):
            return grpc.unary_stream_rpc_method_handler(
                _stream(handler.unary_stream, method), parse, handler.response_serializer
            )
        return handler  # streaming requests (reflection): left as grpc serves them
