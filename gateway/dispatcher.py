"""Sends one sequence to a worker and streams its chunks back: route, fail over, measure.

Both edges (OpenAI HTTP and gRPC Generate) go through :meth:`Dispatcher.generate`, so routing,
fail-over, health marks and metrics behave the same whichever way a request came in.

Fail-over is only safe before the first chunk: once tokens reached the client, a retry on
another worker would produce a second, different continuation. So a worker that cannot be
reached (UNAVAILABLE), has no room (RESOURCE_EXHAUSTED) or whose KV pool is too small for the
request (``PoolTooSmall``: its size, or what its pinned prefixes or a namespace's quota there
leave of it) before its first chunk is skipped for the next candidate of the
route decision; after the first chunk its error ends the sequence. Once every candidate
refused, the client is told why, in the workers' words where they said it.

Only UNAVAILABLE marks a worker unhealthy here: the channel could not reach it (or it is
shutting down); the poller also marks one whose health polls go unanswered (hung or stalled),
and a request still waiting for its first chunk there then fails over. A worker that answers
is up, whatever it answers: INTERNAL (a bug hit one request), INVALID_ARGUMENT or
RESOURCE_EXHAUSTED end or redirect that request, never the worker's turn in the rotation. INTERNAL does not fail over either: the same model on another worker would
most likely fail the same way.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from dataclasses import replace

from gateway.cache_client import CacheApi, PoolRoute
from gateway.cache_status import CacheStatus
from gateway.errors import (
    AtPendingLimit,
    CacheServiceDown,
    ContextLengthExceeded,
    GatewayError,
    NoWorkerAvailable,
    NoWorkerYet,
    PoolFull,
    PoolTooSmall,
    UpstreamError,
    WorkersBusy,
    WorkerUnavailable,
)
from gateway.event_index import EventIndex
from gateway.generation import Chunk, GenerationRequest
from gateway.metrics import GatewayMetrics
from gateway.router import Candidate, RouteDecision, RoutingPolicy, choose_worker
from gateway.streams import settle
from gateway.worker_client import WorkerClients
from gateway.worker_directory import WorkerDirectory

log = logging.getLogger(__name__)


class Dispatcher:
    def __init__(
        self,
        *,
        model: str,
        cache: CacheApi,
        clients: WorkerClients,
        directory: WorkerDirectory,
        metrics: GatewayMetrics,
        policy: RoutingPolicy,
        events: EventIndex | None = None,
        cache_status: CacheStatus | None = None,
    ) -> None:
        self.model = model
        self.cache = cache
        self.clients = clients
        self.directory = directory
        self.metrics = metrics
        self.policy = policy
        # --route-from-events: copies of the pools' indexes answer instead of Route.
        self.events = events
        # What every call to the cache service said of it (the poller's too).
        self.cache_status = cache_status or CacheStatus(grace_s=float("inf"))

    async def route(self, request: GenerationRequest) -> RouteDecision:
        """Ask the cache service (or, with --route-from-events, its KV events' copy) who
        holds the prompt's prefix; rank the workers. Refused at once (CacheServiceDown) while
        the cache service is down: no worker could admit it."""
        routes: list[PoolRoute] | None = None
        if self.cache_status.down:  # ask once more: the poller may not have seen it come back
            if not self.cache_status.probe_due():
                raise CacheServiceDown(self.cache_status.describe())
            try:
                routes = await self.cache.route(
                    request.namespace, request.prompt_token_ids, self.model
                )
            except (WorkerUnavailable, UpstreamError) as e:
                self.cache_status.failed(e)
                raise CacheServiceDown(self.cache_status.describe()) from None
            self.cache_status.ok()
            self.metrics.route_source.labels("route").inc()
        if routes is None and self.events is not None:
            known = self.directory.routes.values()
            routes = self.events.routes(request.namespace, request.prompt_token_ids, known)
            if routes is not None:
                self.metrics.route_source.labels("events").inc()
        if routes is None:
            routes = await self._ask_route(request)
        decision = choose_worker(
            self.directory.candidates(routes), len(request.prompt_token_ids), self.policy
        )
        if decision is None:
            raise NoWorkerYet(
                f"no worker serving model {self.model!r} is ready yet (starting, or all gone): "
                "retry shortly"
            )
        return decision

    async def _ask_route(self, request: GenerationRequest) -> list[PoolRoute]:
        try:
            routes = await self.cache.route(request.namespace, request.prompt_token_ids, self.model)
        except (WorkerUnavailable, UpstreamError) as e:
            # Without the cache service no worker can lease blocks either, but a brief
            # outage should cost cache affinity, not requests (past its grace: route()).
            self.cache_status.failed(e)
            log.warning("Route failed (%s); routing by load over known workers", e)
            self.metrics.route_source.labels("known_workers").inc()
            return self.directory.known_routes()
        self.cache_status.ok()
        self.metrics.route_source.labels("route").inc()
        return routes

    async def generate(
        self, request: GenerationRequest, arrival: float | None = None
    ) -> AsyncGenerator[Chunk, None]:
        """The sequence's chunks, tagged with the serving worker's id. ``arrival`` (a
        ``time.perf_counter()`` value) is when the request reached the gateway, for TTFT."""
        arrival = time.perf_counter() if arrival is None else arrival
        decision = await self.route(request)
        reason = str(decision.reason)
        # Each candidate's refusal (its address, the error), in the order they were tried.
        refusals: list[tuple[str, GatewayError]] = []
        for k, candidate in enumerate(decision.order):
            address = candidate.address
            started = False
            self.directory.in_flight[address] += 1
            try:
                client = self.clients.get(address)
                marked = self.directory.next_mark(address)
                async with aclosing(client.generate(request)) as stream:
                    last_token_at: float | None = None
                    later = decision.order[k + 1 :]
                    chunk = await first_chunk(stream, marked, self.directory, address, later)
                    while chunk is not None:
                        if not started:
                            started = True
                            self.metrics.routed.labels(candidate.pool_id, reason).inc()
                            if self.directory.mark_healthy(address):
                                log.info("worker %s answers again", candidate.pool_id)
                        if chunk.token_ids:
                            now = time.perf_counter()
                            self._observe_latency(len(chunk.token_ids), now, last_token_at, arrival)
                            last_token_at = now
                        if chunk.usage is not None:
                            self.metrics.record_usage(candidate.pool_id, chunk.usage)
                        if chunk.worker_id != candidate.pool_id:  # replace: ~2 us a token
                            chunk = replace(chunk, worker_id=candidate.pool_id)
                        yield chunk
                        chunk = await anext(stream, None)
                return
            except (WorkerUnavailable, WorkersBusy, PoolTooSmall) as e:
                if isinstance(e, WorkerUnavailable) and self.directory.mark_unhealthy(
                    address, e.message
                ):
                    log.warning("worker %s marked unhealthy: %s", candidate.pool_id, e)
                if started:
                    raise
                refusals.append((address, e))
                reason = "failover"
                self.metrics.failovers.labels(candidate.pool_id, type(e).__name__).inc()
            finally:
                self.directory.in_flight[address] -= 1
        raise self._refused(refusals, request)

    def _refused(
        self, refusals: list[tuple[str, GatewayError]], request: GenerationRequest
    ) -> GatewayError:
        """What the client is told once every candidate refused the request (``refusals``, in
        the order they were tried). Every pool too small for it: the limit (400
        context_length_exceeded). Otherwise, as before, the last of the others decides
        between busy (429) and unreachable (503); a busy answer says what the workers said:
        held at their --max-pending-requests, or no room in their KV pools within the
        admission timeout (the request waited that long there: blaming the pending limit
        sent operators to the wrong setting)."""
        too_small = [(a, e) for a, e in refusals if isinstance(e, PoolTooSmall)]
        if refusals and len(too_small) == len(refusals):
            return self._too_long(request, too_small)
        others = [e for _, e in refusals if not isinstance(e, PoolTooSmall)]
        last = others[-1] if others else None
        if isinstance(last, WorkersBusy):
            busy = [e for e in others if isinstance(e, WorkersBusy)]
            full = [e for e in busy if isinstance(e, PoolFull)]
            if full:
                return PoolFull(
                    "no worker admitted the request: its KV pool had no room for it within "
                    f"its --admission-timeout-s (the worker: {full[-1].said}); retry later",
                    code="kv_pool_full",
                )
            if all(isinstance(e, AtPendingLimit) for e in busy):
                return WorkersBusy(
                    "every worker is busy: each one reached holds as many requests as its "
                    "--max-pending-requests allows; retry later",
                    code="workers_busy",
                )
            return WorkersBusy(
                f"every worker refused the request for lack of room (the worker: {last.said}); "
                "retry later",
                code="workers_busy",
            )
        return NoWorkerAvailable(f"no worker could be reached (last error: {last})")

    def _too_long(
        self, request: GenerationRequest, refusals: list[tuple[str, PoolTooSmall]]
    ) -> GatewayError:
        """Every worker tried refused the request as longer than its KV pool holds: the
        largest of their pools in tokens (blocks, as each said, times its block size, as it
        was polled) and the request's tokens; the worker's own words while no block size is
        known."""
        limits = []
        for address, e in refusals:
            load = self.directory.loads.get(address)
            if load is not None and load.block_size:
                limits.append(e.pool_blocks * load.block_size)
        if not limits:
            return ContextLengthExceeded(refusals[-1][1].message)
        prompt = len(request.prompt_token_ids)
        completion = max(1, request.sampling.max_tokens)  # unset (0): at least one token
        held_back = [e for _, e in refusals if e.held_back]
        if held_back:  # a pool larger than that, part of it pinned or past a namespace quota
            return ContextLengthExceeded(
                f"No worker's KV cache can hold this request now: at most {max(limits)} tokens "
                f"(the worker: {held_back[-1].message}). You requested {prompt + completion} "
                f"tokens ({prompt} in the prompt, {completion} for the completion)."
            )
        return ContextLengthExceeded(
            f"This model's maximum context length is {max(limits)} tokens (the most a "
            f"worker's KV cache holds). However, you requested {prompt + completion} tokens "
            f"({prompt} in the prompt, {completion} for the completion). Please reduce the "
            "length of the prompt or the completion."
        )

    def _observe_latency(self, n: int, now: float, last: float | None, arrival: float) -> None:
        """A chunk of ``n`` tokens arrived at ``now``; the previous one at ``last``."""
        if last is None:
            self.metrics.ttft.observe(now - arrival)
            return  # tokens batched with the first one have no gap of their own
        for _ in range(n):
            self.metrics.itl.observe((now - last) / n)


async def first_chunk(
    stream: AsyncGenerator[Chunk, None],
    marked: asyncio.Event,
    directory: WorkerDirectory,
    address: str,
    later: Sequence[Candidate],
) -> Chunk | None:
    """The stream's first chunk (None: it ended without one). When the worker is marked
    unhealthy before it came (its health polls went unanswered: a hung or stalled worker
    still holds its connections) and a later candidate is healthy, the call is cancelled
    and WorkerUnavailable raised, so the request fails over instead of waiting on it.

    The wait for the first chunk runs as a task of its own; whatever ends this call (the
    chunk, the mark, the client going away) the task is settled (``streams.settle``): a
    client that hung up in the same loop turn as the worker refused the call (a worker at its
    --max-pending-requests, under a flood of requests that time out) left the refusal
    unretrieved, and asyncio logged "Task exception was never retrieved" for each.
    """
    first = asyncio.ensure_future(anext(stream, None))
    watch = asyncio.ensure_future(marked.wait())
    try:
        await asyncio.wait((first, watch), return_when=asyncio.FIRST_COMPLETED)
        if first.done() or not any(directory.is_healthy(c.address) for c in later):
            return await first
        mark = directory.unhealthy.get(address)
        raise WorkerUnavailable(
            f"worker at {address} was marked unhealthy before the request's first token "
            f"({mark.reason if mark else 'no answer'}); failing over"
        )
    finally:
        await settle(watch)
        await settle(first)
