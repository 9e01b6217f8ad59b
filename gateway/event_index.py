"""Routing from the cache service's KV events (``--route-from-events``): a copy of every pool's
radix index, kept by following ``WatchEvents`` (docs/kv-events.md), answers the router's
question (how many leading tokens of this prompt does each pool hold) here, instead of a
``Route`` call per request.

- ``PoolCopy`` (gateway/pool_copy.py): one pool's index, block by block. A prompt walks it the
  way the cache service's ``RadixIndex.match`` walks its tree, so the answer is the one
  ``Route`` gives, as of the last event received.
- :class:`EventIndex`: the copies of every pool, and whether each source (the cache service,
  or each shard of it) is in sync: from its ``synced`` message until its stream ends or
  something in it does not fit (a gap in the numbers, a block that is not there).
- :class:`EventWatcher`: one source's stream, followed in a task that reconnects with its
  cursor (the service replays what it missed, or sends a snapshot).

While a pool's source is not in sync, or a discovered pool has no copy, ``routes`` answers
None and the dispatcher calls ``Route`` as without this mode. The load figures (live leases,
free blocks) come from the poller's last discovery, up to ``--poll-interval-s`` old, where
``Route`` gave them fresh; the gateway's own in-flight count and the workers' polled queue
still count (gateway/worker_directory.py).

Only the event loop touches these objects (no locks).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

import grpc

from gateway.background import Background
from gateway.cache_client import CacheClient, PoolRoute
from gateway.pool_copy import Desync, PoolCopy
from kvserve_proto import packed_tokens
from kvserve_proto.kvcache.v1 import kvcache_pb2 as pb

log = logging.getLogger(__name__)

# Reconnection backoff after a stream fails (doubling), and how often failures are logged.
RETRY_MIN_S = 0.2
RETRY_MAX_S = 5.0
LOG_INTERVAL_S = 30.0


@dataclass
class Source:
    """One cache service (or shard) whose events feed the index."""

    address: str
    cursor: pb.EventCursor | None = None
    phase: str = "down"  # down, snapshot (after a reset), catching up, live
    pools: set[str] = field(default_factory=set)


class EventIndex:
    """Copies of every pool's index, fed by one or more sources' events."""

    def __init__(self) -> None:
        self.pools: dict[str, PoolCopy] = {}
        self.sources: dict[str, Source] = {}
        # Where each pool's events come from (a pool registers with one shard).
        self._source_of: dict[str, str] = {}
        self.answered = 0  # routing questions answered here
        self.fell_back = 0  # ... and sent to Route instead

    def source(self, address: str) -> Source:
        return self.sources.setdefault(address, Source(address))

    # -- applying a stream --------------------------------------------------------------------

    def connecting(self, address: str) -> pb.WatchEventsRequest:
        """The request that (re)opens ``address``'s stream: from its cursor, if any."""
        src = self.source(address)
        src.phase = "catching up" if src.cursor is not None else "down"
        return pb.WatchEventsRequest(after=src.cursor)

    def down(self, address: str, forget_cursor: bool = False) -> None:
        """The source's stream ended: its pools are not answered here until it syncs again."""
        src = self.source(address)
        src.phase = "down"
        if forget_cursor:
            src.cursor = None

    def apply(self, address: str, m: pb.WatchEventsResponse) -> None:
        src = self.source(address)
        kind = m.WhichOneof("message")
        if kind == "reset":
            for pool_id in src.pools:
                self.pools.pop(pool_id, None)
                self._source_of.pop(pool_id, None)
            src.pools = set()
            src.cursor, src.phase = m.reset.cursor, "snapshot"
        elif kind == "synced":
            if src.phase not in ("snapshot", "catching up"):
                raise Desync("synced outside a snapshot or a catch-up")
            src.cursor, src.phase = m.synced, "live"
        elif kind == "batch":
            self._apply_batch(src, m.batch)

    def _apply_batch(self, src: Source, b: pb.KVEventBatch) -> None:
        snapshot = src.phase == "snapshot"
        if not snapshot:
            if src.cursor is None or b.cursor.log_id != src.cursor.log_id:
                raise Desync("a batch of another log")
            if b.cursor.seq != src.cursor.seq + 1:
                raise Desync(f"batch {b.cursor.seq} after {src.cursor.seq}: a gap")
            src.cursor = b.cursor
        copy = self.pools.get(b.pool_id)
        if snapshot and (copy is None or copy.incarnation != b.incarnation):
            copy = self._new_copy(src, b)
        for e in b.events:
            kind = e.WhichOneof("event")
            if kind == "cleared":
                if e.cleared.reason == pb.PoolCleared.REASON_FORGOTTEN:
                    self.pools.pop(b.pool_id, None)
                    self._source_of.pop(b.pool_id, None)
                    src.pools.discard(b.pool_id)
                    copy = None
                else:
                    copy = self._new_copy(src, b)
                continue
            if copy is None or copy.incarnation != b.incarnation:
                raise Desync(f"events of pool {b.pool_id!r} incarnation {b.incarnation}")
            if kind == "stored":
                s = e.stored
                parent = s.parent_block if s.HasField("parent_block") else None
                copy.store(s.namespace, parent, s.blocks, s.tokens)
            elif kind == "removed":
                copy.remove(e.removed.blocks)
            elif kind == "tier_stored":
                copy.tier_store(e.tier_stored.medium, e.tier_stored.keys)
            elif kind == "tier_removed":
                copy.tier_remove(e.tier_removed.medium, e.tier_removed.keys)

    def _new_copy(self, src: Source, b: pb.KVEventBatch) -> PoolCopy:
        copy = self.pools[b.pool_id] = PoolCopy(b.incarnation, b.block_size)
        self._source_of[b.pool_id] = src.address
        src.pools.add(b.pool_id)
        return copy

    # -- answering ----------------------------------------------------------------------------

    def cached_tokens(self, pool_id: str, ns: str, prompt: bytes) -> int | None:
        """The prompt tokens the pool would not compute (its cached prefix, and what its
        tiers would load after it), as Route's ``cached_tokens + tier_tokens``; None when its
        copy is missing or its source is not in sync (ask Route)."""
        copy = self.pools.get(pool_id)
        address = self._source_of.get(pool_id)
        if copy is None or address is None or self.sources[address].phase != "live":
            return None
        return sum(copy.route_tokens(ns, prompt))

    def routes(
        self, namespace: str, prompt_token_ids: Sequence[int], known: Iterable[PoolRoute]
    ) -> list[PoolRoute] | None:
        """``known`` (the poller's last discovery: address, load, liveness) with each pool's
        cached prefix of the prompt from its copy; None when any is not answerable here (or
        none is known), so the caller asks Route."""
        known = list(known)
        prompt = packed_tokens.pack(prompt_token_ids)
        out = []
        for r in known:
            cached = self.cached_tokens(r.pool_id, namespace, prompt)
            if cached is None:
                self.fell_back += 1
                return None
            out.append(replace(r, cached_tokens=cached))
        if not out:
            self.fell_back += 1
            return None
        self.answered += 1
        return out


class EventWatcher(Background):
    """Follows one source's WatchEvents in a task, reconnecting with its cursor."""

    def __init__(self, index: EventIndex, client: CacheClient, token: str) -> None:
        self.index = index
        self.client = client
        self.address = client.address
        self._metadata = (("authorization", f"Bearer {token}"),)
        self._last_logged = 0.0

    async def stop(self) -> None:
        await super().stop()
        self.index.down(self.address)

    async def _run(self) -> None:
        backoff = RETRY_MIN_S
        while True:
            forget = False
            try:
                await self._follow()
                problem = "the stream ended"
            except grpc.aio.AioRpcError as e:
                problem = f"{e.code().name}: {e.details()}"
            except Desync as e:
                problem, forget = f"out of step ({e}); starting over from a snapshot", True
            if self.index.source(self.address).phase == "live":
                backoff = RETRY_MIN_S  # it was in sync: retry at once, not after a long wait
            self.index.down(self.address, forget_cursor=forget)
            self._log(problem)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, RETRY_MAX_S)

    async def _follow(self) -> None:
        request = self.index.connecting(self.address)
        call = self.client.stub.WatchEvents(request, metadata=self._metadata)
        try:
            async for message in call:
                self.index.apply(self.address, message)
                if message.HasField("synced"):
                    log.info("KV events from %s: in sync at %d", self.address, message.synced.seq)
        finally:
            call.cancel()

    def _log(self, problem: str) -> None:
        now = time.monotonic()
        if now - self._last_logged >= LOG_INTERVAL_S:
            self._last_logged = now
            log.warning(
                "KV events from %s: %s; routing asks Route until it is back", self.address, problem
            )


class EventFeeds:
    """The index and one watcher per cache service shard: what ``--route-from-events`` adds."""

    def __init__(self, clients: Sequence[CacheClient], token: str) -> None:
        self.index = EventIndex()
        self.watchers = [EventWatcher(self.index, c, token) for c in clients]

    def start(self) -> None:
        for w in self.watchers:
            w.start()

    async def stop(self) -> None:
        for w in self.watchers:
            await w.stop()
