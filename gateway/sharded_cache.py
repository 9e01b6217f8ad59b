"""The cache service sharded by pool id: one :class:`CacheApi` over several cache services.

A pool's index, budget, leases and liveness live on the one shard its worker registered with
(the worker's own ``--cache-service``), and shards share nothing, so the gateway is the only
part that sees more than one (docs/sharding.md):

- ``route`` asks every shard at once and concatenates their answers. Each call carries the one
  ``ROUTE_TIMEOUT_S`` deadline and they run side by side, so the fan-out waits no longer than
  one call would. A shard that fails or times out only drops its own pools from that answer
  (its workers cannot lease while it is away; the other pools keep their cache affinity);
  only when every shard fails does the caller get the error, as from one cache service.
- A shard whose last call failed is left out of ``route`` at once, without waiting on it,
  and probed off the request path (one discovery Route at a time, at most one a second)
  until it answers: a shard that hangs would otherwise cost every request ROUTE_TIMEOUT_S.
- Admin calls over every pool (``GetStats``, ``Flush`` and ``Lookup`` without a pool,
  ``CheckIntegrity``) fan out and merge. Calls naming a pool go to the shard that owns it,
  learned from the last ``Route`` or ``GetStats`` that listed it, else found by asking every
  shard which one knows it. A caller's mistake (a wrong admin token, a bad request) is
  answered as the shards answer it, never dropped as a shard failure.

Two shards listing one pool id is a misconfiguration (two workers with one ``--worker-id``
on different shards): it is logged, and the live one's entry kept.

One class a little over 300 lines on purpose: the fan-out, the shards left out and probed,
and the merging of answers share one table (which shard owns which pool).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, TypeVar

from google.protobuf.message import Message

from gateway.cache_client import CacheClient, PoolBlocks, PoolRoute, pool_blocks_of
from gateway.errors import GatewayError, InvalidRequest, NotFound, Unauthorized
from gateway.worker_client import Connect
from kvserve_proto.kvcache.v1 import kvcache_pb2 as pb

log = logging.getLogger(__name__)

# A shard that keeps failing is logged at most this often (the count of the calls in between
# goes in the next message); every failure is counted in the metrics.
LOG_INTERVAL_S = 30.0

# Errors that the request causes, not the shard: every shard would answer the same, so they
# are the answer (a wrong admin token stays a 401), never a shard to leave out.
CALLER_ERRORS = (InvalidRequest, Unauthorized)

# A shard left out of Route is probed at most this often, with a one-token discovery Route.
PROBE_INTERVAL_S = 1.0
PROBE = pb.RouteRequest(prompt_token_ids=[0])

# Admin methods that, without a pool id, ask about every pool: fanned out and merged.
OVER_EVERY_POOL = frozenset({"GetStats", "Flush", "Lookup", "CheckIntegrity"})

T = TypeVar("T")
ShardError = Callable[[str, str], None]  # (shard address, call) of a failed call


class ShardedCache:
    def __init__(self, shards: Sequence[CacheClient], on_shard_error: ShardError | None = None):
        """``on_shard_error`` counts each failed shard call (``GatewayMetrics``)."""
        if not shards:
            raise ValueError("no cache shards")
        self.shards = list(shards)
        self.address = ",".join(s.address for s in self.shards)
        # Pool id -> the shard that listed it last.
        self.owners: dict[str, CacheClient] = {}
        self._on_shard_error = on_shard_error
        # Addresses of shards whose last call failed, and the probes asking them again.
        self._down: set[str] = set()
        self._probes: dict[str, asyncio.Task[None]] = {}
        self._last_logged: dict[str, float] = {}
        self._unlogged: Counter[str] = Counter()

    # -- data plane ----------------------------------------------------------------------------

    async def route(
        self, namespace: str, prompt_token_ids: Sequence[int], model: str
    ) -> list[PoolRoute]:
        """Every shard's pools serving ``model`` with their cached prefix of the prompt."""
        req = pb.RouteRequest(namespace=namespace, prompt_token_ids=prompt_token_ids, model=model)
        # Every shard down: ask them all anyway (the unsharded gateway's failure, or an answer).
        up = [s for s in self.shards if s.address not in self._down] or self.shards
        for shard in self.shards:
            if shard not in up:
                self._probe(shard)
        answers, _ = await self._fan_out("Route", lambda s: s.route_request(req), up)
        return self._merge(answers, lambda r: r.pool_id, lambda r: r.alive)

    def _probe(self, shard: CacheClient) -> None:
        if shard.address not in self._probes:
            self._probes[shard.address] = asyncio.create_task(self._run_probe(shard))

    async def _run_probe(self, shard: CacheClient) -> None:
        """Asks a shard left out of Route whether it answers again (``_fan_out`` takes it
        back, or counts and logs the failure); the next probe waits PROBE_INTERVAL_S."""
        try:
            answers, _ = await self._fan_out("Route", lambda s: s.route_request(PROBE), [shard])
            self._merge(answers, lambda r: r.pool_id, lambda r: r.alive)
        except GatewayError:
            await asyncio.sleep(PROBE_INTERVAL_S)
        finally:
            del self._probes[shard.address]

    async def pool_blocks(self, admin_token: str) -> list[PoolBlocks]:
        resp = await self.call_admin("GetStats", pb.StatsRequest(), f"Bearer {admin_token}")
        assert isinstance(resp, pb.StatsResponse)
        return pool_blocks_of(resp)

    # -- admin ---------------------------------------------------------------------------------

    async def call_admin(self, method: str, request: Message, authorization: str) -> Message:
        """One ``KVCacheAdmin`` RPC on the shards it concerns, their answers merged."""
        pool: str = getattr(request, "pool_id", "")
        if pool or method not in OVER_EVERY_POOL:
            # Without a pool id, a per-pool call finds no shard and gets the shards' NOT_FOUND.
            return await self._on_owner(pool, method, request, authorization)

        def call(s: CacheClient) -> Awaitable[Any]:
            return s.call_admin(method, request, authorization)

        answers, failed = await self._fan_out(method, call)
        if method == "GetStats":
            stats: list[tuple[CacheClient, list[pb.PoolStats]]] = [
                (s, list(r.pools)) for s, r in answers
            ]
            merged = self._merge(stats, lambda p: p.pool_id, lambda p: p.alive)
            return pb.StatsResponse(pools=merged)
        if method == "Flush":
            return pb.EvictResponse(evicted_blocks=sum(r.evicted_blocks for _, r in answers))
        if method == "Lookup":
            return pb.LookupResponse(pools=self._merge_lookups(answers))
        return _merge_integrity(answers, failed)

    async def _on_owner(
        self, pool: str, method: str, request: Message, authorization: str
    ) -> Message:
        """The call on the shard owning ``pool``. A known owner that answers NOT_FOUND may have
        lost the pool to another shard (its worker moved): the shards are asked again, and
        the call retried once where the pool is now; the same shard: the NOT_FOUND stands
        (an unknown prefix of a known pool)."""
        shard = self.owners.get(pool)
        if shard is None:
            shard = await self._find(pool, authorization)
            return await shard.call_admin(method, request, authorization)
        try:
            return await shard.call_admin(method, request, authorization)
        except NotFound:
            now = await self._find(pool, authorization)
            if now is shard:
                raise
        return await now.call_admin(method, request, authorization)

    async def _find(self, pool: str, authorization: str) -> CacheClient:
        """The shard that knows ``pool`` (``GetStats`` of it on every shard). Raises NotFound
        when none does; when some shard did not answer, its error instead (the pool may be
        there); a caller error (401) as it came."""
        req = pb.StatsRequest(pool_id=pool)
        results = await asyncio.gather(
            *(s.call_admin("GetStats", req, authorization) for s in self.shards),
            return_exceptions=True,
        )
        found: list[tuple[CacheClient, list[Any]]] = []
        errors: list[GatewayError] = []
        for shard, r in zip(self.shards, results, strict=True):
            if isinstance(r, GatewayError):
                errors.append(r)
            elif isinstance(r, BaseException):
                raise r
            else:
                assert isinstance(r, pb.StatsResponse)
                found.append((shard, list(r.pools)))
        for e in errors:
            if isinstance(e, CALLER_ERRORS):
                raise e
        if found:
            self._merge(found, lambda p: p.pool_id, lambda p: p.alive, complete=False)
            return self.owners[pool]
        raise next((e for e in errors if not isinstance(e, NotFound)), errors[0])

    # -- fan-out and merging ---------------------------------------------------------------

    async def _fan_out(
        self,
        call: str,
        fn: Callable[[CacheClient], Awaitable[T]],
        shards: Sequence[CacheClient] | None = None,
    ) -> tuple[list[tuple[CacheClient, T]], list[tuple[CacheClient, GatewayError]]]:
        """``fn`` on every shard (of ``shards``) at once: (shard, answer) of those that
        answered, and (shard, error) of those that failed. A caller error is raised as it came;
        when every shard failed, the first shard's error is raised."""
        shards = self.shards if shards is None else shards
        results = await asyncio.gather(*(fn(s) for s in shards), return_exceptions=True)
        answers: list[tuple[CacheClient, T]] = []
        failed: list[tuple[CacheClient, GatewayError]] = []
        for shard, r in zip(shards, results, strict=True):
            if isinstance(r, CALLER_ERRORS):
                raise r
            if isinstance(r, GatewayError):
                failed.append((shard, r))
            elif isinstance(r, BaseException):
                raise r  # a bug, not a shard's answer
            else:
                answers.append((shard, r))
        for shard, _ in answers:
            if shard.address in self._down:
                self._down.discard(shard.address)
                log.info("cache shard %s answers again", shard.address)
        for shard, err in failed:
            self._shard_failed(shard.address, call, err)
        if not answers:
            raise failed[0][1]
        return answers, failed

    def _shard_failed(self, address: str, call: str, err: GatewayError) -> None:
        if self._on_shard_error is not None:
            self._on_shard_error(address, call)
        self._down.add(address)
        now = time.monotonic()
        if now - self._last_logged.get(address, -LOG_INTERVAL_S) < LOG_INTERVAL_S:
            self._unlogged[address] += 1
            return
        self._last_logged[address] = now
        more = self._unlogged.pop(address, 0)
        log.warning(
            "cache shard %s failed %s; its pools are left out of the answer%s: %s",
            address,
            call,
            f" ({more} more failed calls since the last message)" if more else "",
            err,
        )

    def _merge(
        self,
        answers: Iterable[tuple[CacheClient, Iterable[T]]],
        pool_of: Callable[[T], str],
        alive: Callable[[T], bool],
        complete: bool = True,
    ) -> list[T]:
        """The shards' per-pool entries, one per pool id: on a clash the live one, else the
        first shard's. Learns each pool's owner; ``complete``: each answer lists every pool
        of its shard, so pools it no longer lists are forgotten there."""
        kept: dict[str, tuple[CacheClient, T]] = {}
        for shard, items in answers:
            if complete:
                for pool in [p for p, s in self.owners.items() if s is shard]:
                    del self.owners[pool]
            for item in items:
                pool = pool_of(item)
                first = kept.get(pool)
                if first is None:
                    kept[pool] = (shard, item)
                    continue
                self._log_clash(pool, first[0], shard)
                if alive(item) and not alive(first[1]):
                    kept[pool] = (shard, item)
        for pool, (shard, _) in kept.items():
            self.owners[pool] = shard
        return [item for _, item in kept.values()]

    def _merge_lookups(self, answers: list[tuple[CacheClient, Any]]) -> list[pb.PoolLookup]:
        """Lookup entries carry no liveness: on a clash, the owner's (see ``_merge``)."""
        out: dict[str, pb.PoolLookup] = {}
        for shard, resp in answers:
            for p in resp.pools:
                if p.pool_id not in out or self.owners.get(p.pool_id) is shard:
                    out[p.pool_id] = p
        return list(out.values())

    def _log_clash(self, pool: str, a: CacheClient, b: CacheClient) -> None:
        key = f"clash:{pool}"
        now = time.monotonic()
        if now - self._last_logged.get(key, -LOG_INTERVAL_S) >= LOG_INTERVAL_S:
            self._last_logged[key] = now
            log.error(
                "pool %r is registered on two cache shards, %s and %s (two workers with one "
                "--worker-id?); routing uses the live one",
                pool,
                a.address,
                b.address,
            )

    async def close(self) -> None:
        for task in list(self._probes.values()):
            task.cancel()
        await asyncio.gather(*self._probes.values(), return_exceptions=True)
        await asyncio.gather(*(s.close() for s in self.shards))


def _merge_integrity(
    answers: list[tuple[CacheClient, Any]], failed: list[tuple[CacheClient, GatewayError]]
) -> pb.CheckIntegrityResponse:
    """OK only if every shard checked and found nothing; a shard that did not answer is a
    problem too (its pools went unchecked)."""
    problems = [f"shard {s.address}: {p}" for s, r in answers for p in r.problems]
    problems += [f"shard {s.address}: not checked: {e}" for s, e in failed]
    return pb.CheckIntegrityResponse(
        ok=not problems,
        problems=problems,
        pools_checked=sum(r.pools_checked for _, r in answers),
    )


def connect_cache(
    addresses: Sequence[str],
    token: str,
    connect: Connect | None = None,
    on_shard_error: ShardError | None = None,
) -> CacheClient | ShardedCache:
    """The gateway's cache: one :class:`CacheClient` for one address (exactly the unsharded
    gateway), a :class:`ShardedCache` over one client per address for several."""
    clients = [CacheClient(a, token, connect) for a in addresses]
    if len(clients) == 1:
        return clients[0]
    return ShardedCache(clients, on_shard_error)
