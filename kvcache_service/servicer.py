"""gRPC servicer of KVCacheService, for workers and gateways (KVCacheAdmin, for operators:
admin_servicer.py), and the guards both use (the bearer tokens, domain errors to status codes).

Thin: validate the shape of the request, call the CacheAuthority, convert the result. Domain
errors become status codes through convert.STATUS_OF, in one place.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from kvcache_service import convert
from kvcache_service.authority import CacheAuthority
from kvcache_service.errors import CacheError
from kvcache_service.event_types import Batch, Cursor, ResetReason
from kvcache_service.ids import Namespace, PoolId
from kvcache_service.names import check_id
from kvserve_proto.kvcache.v1 import kvcache_pb2 as pb
from kvserve_proto.kvcache.v1 import kvcache_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

Req = TypeVar("Req")
Resp = TypeVar("Resp")
Handler = Callable[[Any, Req, grpc.aio.ServicerContext], Awaitable[Resp]]


def domain_errors(fn: Handler[Req, Resp]) -> Handler[Req, Resp]:
    @functools.wraps(fn)
    async def wrapper(self: Any, request: Req, context: grpc.aio.ServicerContext) -> Resp:
        try:
            return await fn(self, request, context)
        except CacheError as err:
            await context.abort(convert.status_of(err), str(err))
            raise  # unreachable: abort raises

    return wrapper


def bearer_problem(context: grpc.aio.ServicerContext, token: str, what: str) -> str | None:
    """Why the call's `authorization: Bearer <token>` is not ``token`` (compared in constant
    time), in words an operator can act on: none sent, not a bearer token, or the wrong one
    (which token it is not, never what it should be); None when it is. ``what`` names it."""
    metadata = dict(context.invocation_metadata() or ())
    header = str(metadata.get("authorization", "")).strip()
    if not header:
        return f"{what} calls need `authorization: Bearer <{what} token>`; none was sent"
    scheme, _, given = header.partition(" ")
    # The scheme is case-insensitive (RFC 9110, 11.1): "bearer x" is as good as "Bearer x".
    same = hmac.compare_digest(given.strip().encode(), token.encode())
    if scheme.lower() != "bearer":
        return f"{what} calls need `authorization: Bearer <{what} token>`; not a Bearer token"
    return None if same else f"the {what} token sent is not this service's"


def service_only(fn: Handler[Req, Resp]) -> Handler[Req, Resp]:
    """Requires `authorization: Bearer <service token>` when the service has one (empty: auth
    off, for development); then maps domain errors. Workers and gateways hold the token."""
    inner = domain_errors(fn)

    @functools.wraps(fn)
    async def wrapper(
        self: KVCacheServicer, request: Req, context: grpc.aio.ServicerContext
    ) -> Resp:
        if self.token and (problem := bearer_problem(context, self.token, "service")):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, problem)
        return await inner(self, request, context)

    return wrapper


# Batches a watcher takes from the event log at a time (at most so many, and so many bytes:
# what a stalled watcher keeps alive past the buffer); each is then written, waiting on the
# watcher's flow control, so a slow watcher holds back only itself.
WATCH_READ_BATCHES = 256
WATCH_READ_BYTES = 4 << 20
# Live batches converted to messages, kept for the other watchers (every gateway watches the
# same batches, mostly at the head): converted once, not once per watcher. Bounded by the
# batches' estimated bytes.
ENCODED_BYTES = 16 << 20


class KVCacheServicer(pb_grpc.KVCacheServiceServicer):
    def __init__(self, authority: CacheAuthority, token: str = "", admin_token: str = "") -> None:
        self.auth = authority
        self.token = token
        # WatchEvents also takes the admin token (an operator watching).
        self.admin_token = admin_token
        self._encoded: OrderedDict[tuple[int, int], tuple[pb.WatchEventsResponse, int]] = (
            OrderedDict()
        )
        self._encoded_bytes = 0

    @service_only
    async def RegisterPool(self, request, context):
        spec = convert.pool_spec(request)
        reg = self.auth.register_pool(spec, convert.incarnation(request))
        log.info(
            "registered pool %r: %d blocks of %d tokens, incarnation %d%s",
            request.pool_id,
            request.num_blocks,
            request.block_size,
            reg.incarnation,
            "".join(f", a {m.name.lower()} tier of {n} blocks" for m, n in spec.tiers),
        )
        return convert.registration(reg)

    @service_only
    async def Heartbeat(self, request, context):
        expired, live, evict = self.auth.heartbeat(
            PoolId(request.pool.pool_id), request.pool.incarnation
        )
        return pb.HeartbeatResponse(
            expired_lease_ids=expired, live_leases=live, tier_evict=convert.tier_evict(evict)
        )

    @service_only
    async def UpdateTiers(self, request, context):
        stored, dropped = convert.tier_update(request)
        evict = self.auth.update_tiers(
            PoolId(request.pool.pool_id), request.pool.incarnation, stored, dropped
        )
        return pb.UpdateTiersResponse(evict=convert.tier_evict(evict))

    @service_only
    async def AcquireLease(self, request, context):
        result, expired = self.auth.acquire(convert.acquire_request(request))
        return convert.acquire_response(result, expired)

    @service_only
    async def ExtendLeases(self, request, context):
        out = self.auth.extend(
            PoolId(request.pool.pool_id),
            request.pool.incarnation,
            [(item.lease_id, item.num_tokens) for item in request.items],
        )
        return pb.ExtendLeasesResponse(
            leases=[pb.ExtendedLease(lease_id=i, new_blocks=blocks) for i, blocks in out]
        )

    @service_only
    async def CommitLeases(self, request, context):
        pool = request.pool
        indexed = self.auth.commit(
            PoolId(pool.pool_id), pool.incarnation, convert.commit_items(request)
        )
        return pb.CommitLeasesResponse(indexed_tokens=indexed)

    @service_only
    async def ReleaseLease(self, request, context):
        update = request.update if request.HasField("update") else None
        indexed = self.auth.release(
            PoolId(request.pool.pool_id),
            request.pool.incarnation,
            request.lease_id,
            convert.sequence_update(request.token_ids, update),
        )
        return pb.ReleaseLeaseResponse(indexed_tokens=indexed)

    @service_only
    async def AcquireLeases(self, request, context):
        pool = request.pool
        results, expired = self.auth.acquire_many(
            PoolId(pool.pool_id), pool.incarnation, convert.acquire_items(request)
        )
        return convert.acquire_results(results, expired)

    @service_only
    async def ReleaseLeases(self, request, context):
        pool = request.pool
        results = self.auth.release_many(
            PoolId(pool.pool_id), pool.incarnation, convert.release_items(request)
        )
        return convert.release_results(results)

    @service_only
    async def Route(self, request, context):
        # proto3 has no absent string: an empty model asks for the pools of every model.
        prompt = convert.tokens(request.prompt_token_ids, request.prompt_tokens, "prompt")
        routes = self.auth.route(Namespace(request.namespace), prompt, request.model or None)
        return pb.RouteResponse(pools=[convert.pool_route(r) for r in routes])

    async def WatchEvents(self, request, context):
        """The KV events (events.py, docs/kv-events.md). Never open: the batches carry every
        tenant's token ids, so without a service token configured only the admin token
        watches (Route, by contrast, only answers about a prompt the caller already has)."""
        if problem := self._watch_problem(context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, problem)
        try:
            async for message in self._watch(request):
                yield message
        except CacheError as err:
            await context.abort(convert.status_of(err), str(err))

    def _encode(self, batch: Batch, log_id: int) -> pb.WatchEventsResponse:
        key = (log_id, batch.seq)
        held = self._encoded.get(key)
        if held is not None:
            return held[0]
        message = convert.event_batch(batch, log_id)
        self._encoded[key] = (message, batch.cost)
        self._encoded_bytes += batch.cost
        while self._encoded_bytes > ENCODED_BYTES and len(self._encoded) > 1:
            self._encoded_bytes -= self._encoded.popitem(last=False)[1][1]
        return message

    def _watch_problem(self, context: grpc.aio.ServicerContext) -> str | None:
        for token, what in ((self.token, "service"), (self.admin_token, "admin")):
            if token and bearer_problem(context, token, what) is None:
                return None
        token, what = (self.token, "service") if self.token else (self.admin_token, "admin")
        why = bearer_problem(context, token, what) if token else "no token is configured"
        return f"WatchEvents takes the service token or the admin token: {why}"

    async def _watch(self, request: pb.WatchEventsRequest) -> AsyncIterator[pb.WatchEventsResponse]:
        """A reset and a snapshot, or the batches after the watcher's cursor; `synced` once
        it has caught up; then live batches, as they are sealed, until the watcher leaves or
        falls behind the replay buffer (FellBehind)."""
        pool_id = PoolId(check_id(request.pool_id, "pool_id")) if request.pool_id else None
        wake = asyncio.Event()
        waker = wake.set
        self.auth.watch_events(waker)
        try:
            log = self.auth.events
            start = log.resume(convert.watch_cursor(request))
            if isinstance(start, ResetReason):
                at, snapshot = self.auth.events_snapshot(pool_id)
                yield convert.events_reset(start, at)
                for batch in snapshot:
                    yield convert.event_batch(batch, at.log_id)
                start = at.seq
            pos, synced = start, False
            while True:
                wake.clear()
                batches = log.after(pos, WATCH_READ_BATCHES, WATCH_READ_BYTES)
                if not batches:
                    if not synced:
                        synced = True
                        yield convert.events_synced(Cursor(log.log_id, pos))
                    else:
                        await wake.wait()
                    continue
                for batch in batches:
                    if pool_id is None or batch.pool.pool_id == pool_id:
                        yield self._encode(batch, log.log_id)
                    pos = batch.seq
        finally:
            self.auth.unwatch_events(waker)
