"""Typed errors of the gateway and the one table that maps them to HTTP and gRPC.

Domain code raises these; the HTTP app renders them as OpenAI error bodies and the gRPC
servicer aborts with the status code, both through :data:`ERROR_TABLE`, so a given failure
reads the same on either edge.
"""

from __future__ import annotations

import logging
import re
from typing import NamedTuple

import grpc

log = logging.getLogger(__name__)


class GatewayError(Exception):
    """Base class: a request the gateway cannot serve. ``param`` names the offending field."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class InvalidRequest(GatewayError):
    """The request is malformed or asks for something this server cannot do."""


class ContextLengthExceeded(InvalidRequest):
    """Prompt (plus the requested completion) does not fit the model's context."""

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message, param=param, code="context_length_exceeded")


class RequestTooLarge(InvalidRequest):
    """The HTTP body is over the configured limit (checked before it is parsed)."""


class ModelNotFound(GatewayError):
    """The request names a model this gateway does not serve."""

    def __init__(self, model: str):
        super().__init__(
            f"The model `{model}` does not exist.", param="model", code="model_not_found"
        )


class NotFound(GatewayError):
    """An unknown path or admin object (pool, prefix)."""


class Unauthorized(GatewayError):
    """An admin call without the right bearer token."""


class PoolTooSmall(ContextLengthExceeded):
    """A worker refused a request its KV pool could never hold (INVALID_ARGUMENT, "the request
    needs N KV blocks; this worker's pool has M": ``worker.engine.intake``). The gateway checks
    every request against the largest pool before dispatch (``OpenAIServing.max_context``), so
    one that meets this was routed to a smaller pool, or came before the workers were polled:
    the dispatcher tries its next worker, and says the limit once none could hold it.
    ``pool_blocks``: the refusing pool's size, as it said it. ``held_back``: the pool is larger
    but could give only ``pool_blocks`` of it, the rest pinned or past the namespace's quota
    there (the cache service's refusal, passed on by the worker): another pool may hold the
    request all the same, so it is failed over alike."""

    def __init__(self, message: str, *, pool_blocks: int = 0, held_back: bool = False):
        super().__init__(message)
        self.pool_blocks = pool_blocks
        self.held_back = held_back


class WorkersBusy(GatewayError):
    """Every worker refused the request for lack of room (RESOURCE_EXHAUSTED): retry later.
    Never a health mark: a full worker is up. ``said``: the refusing worker's own words (its
    status details), for the message the client gets once every worker refused."""

    def __init__(
        self, message: str, *, param: str | None = None, code: str | None = None, said: str = ""
    ):
        super().__init__(message, param=param, code=code)
        self.said = said


class AtPendingLimit(WorkersBusy):
    """The worker already holds its --max-pending-requests (the worker's Overloaded, refused
    before it holds anything)."""


class PoolFull(WorkersBusy):
    """The worker's KV pool had no room for the request within its --admission-timeout-s (the
    worker's NotAdmitted, after the request waited in its queue): its blocks were held by
    running requests, pinned prefixes or a namespace quota."""


class TooManyRequests(GatewayError):
    """The client (or the whole gateway) has as many requests in flight as it may
    (--max-concurrent-per-client, --max-concurrent-requests): retry once one has ended."""


class NoWorkerAvailable(GatewayError):
    """No worker serves the model, or none answered."""


class CacheServiceDown(GatewayError):
    """The cache service has been unreachable past the grace period (``gateway.cache_status``):
    no worker can admit a request, so new ones are refused at once. 503 with Retry-After."""


class NoWorkerYet(NoWorkerAvailable):
    """No worker of the model is registered: the system is starting (a worker loads its
    model in seconds), or every worker is gone. 503 with Retry-After: retrying is right."""


class WorkerUnavailable(GatewayError):
    """One worker could not be reached. Internal: the dispatcher fails over to another and
    only surfaces :class:`NoWorkerAvailable` when none is left."""


class RequestAborted(GatewayError):
    """The worker aborted the request (shutdown, lost lease) after it had started."""


class UpstreamError(GatewayError):
    """A worker or the cache service failed in a way the client cannot fix."""


class WorkerSilent(UpstreamError):
    """A worker's channel is up but the worker did not answer a health probe in time: it may be
    hung or stalled (a stopped process still accepts connections). The poller marks it
    unhealthy after a few of these in a row (``gateway.poller``)."""


class UpstreamInternalError(UpstreamError):
    """A worker (or the cache service) answered INTERNAL: a bug hit this one request, the
    server is up. HTTP 500; no fail-over and no health mark (only a worker that cannot be
    reached is marked). The details stay in the gateway's log."""


class ErrorMapping(NamedTuple):
    http_status: int
    openai_type: str
    grpc_code: grpc.StatusCode
    # Sent as HTTP Retry-After: the OpenAI SDKs wait that long before their retry (they retry
    # 429 and 5xx, with backoff when there is no header).
    retry_after_s: int | None = None


# Busy is a state of seconds: a slot frees when any request ends. One second spreads the
# retries of many clients without idling a slot for long.
RETRY_AFTER_S = 1
# No worker yet: a worker of the default model gets ready within seconds of its start.
STARTING_RETRY_AFTER_S = 2
# The cache service away: a restarted one is back in about a second, workers re-register
# within a heartbeat (lease TTL / 4).
OUTAGE_RETRY_AFTER_S = 5


ERROR_TABLE: dict[type[GatewayError], ErrorMapping] = {
    ContextLengthExceeded: ErrorMapping(
        400, "invalid_request_error", grpc.StatusCode.INVALID_ARGUMENT
    ),
    RequestTooLarge: ErrorMapping(413, "invalid_request_error", grpc.StatusCode.INVALID_ARGUMENT),
    InvalidRequest: ErrorMapping(400, "invalid_request_error", grpc.StatusCode.INVALID_ARGUMENT),
    ModelNotFound: ErrorMapping(404, "invalid_request_error", grpc.StatusCode.NOT_FOUND),
    NotFound: ErrorMapping(404, "invalid_request_error", grpc.StatusCode.NOT_FOUND),
    Unauthorized: ErrorMapping(401, "authentication_error", grpc.StatusCode.UNAUTHENTICATED),
    # Over capacity is 429, not 503, on both counts: it is gRPC's RESOURCE_EXHAUSTED in HTTP
    # (503 is UNAVAILABLE here: no worker reachable), the OpenAI SDKs retry either, and a proxy
    # or load balancer in front counts a 5xx as a failing gateway (Envoy's outlier detection
    # ejects it) where a 429 passes through to the client that should slow down.
    WorkersBusy: ErrorMapping(
        429, "rate_limit_error", grpc.StatusCode.RESOURCE_EXHAUSTED, RETRY_AFTER_S
    ),
    TooManyRequests: ErrorMapping(
        429, "rate_limit_error", grpc.StatusCode.RESOURCE_EXHAUSTED, RETRY_AFTER_S
    ),
    CacheServiceDown: ErrorMapping(
        503, "service_unavailable", grpc.StatusCode.UNAVAILABLE, OUTAGE_RETRY_AFTER_S
    ),
    NoWorkerYet: ErrorMapping(
        503, "service_unavailable", grpc.StatusCode.UNAVAILABLE, STARTING_RETRY_AFTER_S
    ),
    # None answered: a dead worker is restarted by its supervisor and serves again within
    # seconds (its pool taken back at once: worker.pool_claim).
    NoWorkerAvailable: ErrorMapping(
        503, "service_unavailable", grpc.StatusCode.UNAVAILABLE, STARTING_RETRY_AFTER_S
    ),
    WorkerUnavailable: ErrorMapping(503, "service_unavailable", grpc.StatusCode.UNAVAILABLE),
    RequestAborted: ErrorMapping(
        503, "service_unavailable", grpc.StatusCode.ABORTED, RETRY_AFTER_S
    ),
    UpstreamInternalError: ErrorMapping(500, "server_error", grpc.StatusCode.INTERNAL),
    UpstreamError: ErrorMapping(502, "server_error", grpc.StatusCode.INTERNAL),
}
INTERNAL = ErrorMapping(500, "server_error", grpc.StatusCode.INTERNAL)


def mapping_of(err: BaseException) -> ErrorMapping:
    """The most specific table entry for ``err``; unknown exceptions are internal errors."""
    for cls in type(err).__mro__:
        if cls in ERROR_TABLE:
            return ERROR_TABLE[cls]
    return INTERNAL


def openai_error_body(
    message: str, error_type: str, *, param: str | None = None, code: str | int | None = None
) -> dict[str, dict[str, object]]:
    """The OpenAI error shape every 4xx/5xx of the HTTP API uses."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_headers(err: BaseException) -> dict[str, str]:
    """HTTP headers of the error response: Retry-After for the retry-later errors."""
    retry_after = mapping_of(err).retry_after_s
    return {} if retry_after is None else {"retry-after": str(retry_after)}


def error_body(err: BaseException) -> tuple[int, dict[str, dict[str, object]]]:
    """HTTP status and OpenAI error body for any exception (internals are not leaked)."""
    m = mapping_of(err)
    if isinstance(err, GatewayError):
        return m.http_status, openai_error_body(
            err.message, m.openai_type, param=err.param, code=err.code
        )
    return m.http_status, openai_error_body("internal server error", m.openai_type)


# Upstream gRPC status -> the gateway error a client sees (worker and cache service calls).
# Only WorkerUnavailable (UNAVAILABLE: the channel could not reach the worker, or it is shutting
# down) marks a worker unhealthy; see gateway.dispatcher.
FROM_GRPC: dict[grpc.StatusCode, type[GatewayError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.OUT_OF_RANGE: InvalidRequest,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.UNAUTHENTICATED: Unauthorized,
    grpc.StatusCode.PERMISSION_DENIED: Unauthorized,
    grpc.StatusCode.RESOURCE_EXHAUSTED: WorkersBusy,
    grpc.StatusCode.UNAVAILABLE: WorkerUnavailable,
    grpc.StatusCode.ABORTED: RequestAborted,
    grpc.StatusCode.FAILED_PRECONDITION: UpstreamError,
    grpc.StatusCode.INTERNAL: UpstreamInternalError,
}


def from_rpc_error(err: grpc.aio.AioRpcError, what: str) -> GatewayError:
    """The gateway error for a failed upstream call; ``what`` names the callee for messages."""
    return from_status(err.code(), err.details() or "", what)


# A worker's refusals, told apart by their text (the status code is one for each kind; the
# worker's messages: worker.engine.intake, worker.engine.lease_sync). A gateway in front of
# another (its gRPC edge is a Worker service) says the same words, passed on.
POOL_TOO_SMALL = re.compile(r"the request needs \d+ KV blocks; this worker's pool has (\d+)")
# The cache service's refusals of a lease no eviction could ever grant in that pool, passed on
# by the worker (``kvcache_service.budget.Budget.beyond_reach``): pinned blocks keep the rest of
# the pool, or the namespace's quota there is spent. Another pool may hold the request.
BEYOND_REACH = (
    re.compile(r"the request needs \d+ KV blocks; this pool can give at most (\d+) of its \d+"),
    re.compile(r"the request needs \d+ KV blocks in namespace .*, over its quota of (\d+)"),
)
NOT_ADMITTED = "not admitted within"
PENDING_LIMIT = "--max-pending-requests"


def from_status(code: grpc.StatusCode, details: str, what: str) -> GatewayError:
    """The gateway error for an upstream status (a failed call, or one request's error inside
    a worker's ``GenerateMany`` call)."""
    details = details or code.name
    cls = FROM_GRPC.get(code, UpstreamError)
    if cls is InvalidRequest:
        for pattern in (POOL_TOO_SMALL, *BEYOND_REACH):
            said = pattern.search(details)
            if said:
                held_back = pattern is not POOL_TOO_SMALL
                return PoolTooSmall(details, pool_blocks=int(said[1]), held_back=held_back)
    if cls in (InvalidRequest, NotFound, Unauthorized):
        return cls(details)
    if cls is WorkersBusy:
        busy = (
            PoolFull
            if NOT_ADMITTED in details
            else AtPendingLimit
            if PENDING_LIMIT in details
            else WorkersBusy
        )
        return busy(f"{what}: {code.name}: {details}", said=details)
    if cls is UpstreamInternalError:
        log.warning("%s: INTERNAL: %s", what, details)
        return cls("The server had an internal error while processing the request.")
    return cls(f"{what}: {code.name}: {details}")
