"""The facade the gRPC servicers call: pools by id, incarnations, liveness and expiry.

Over 300 lines on purpose: one class every RPC goes through, each method a few lines that find
the pool, fence a stale incarnation, renew liveness and hand over to the pool (pool.py,
lease_book.py); kept whole so that those rules, and the KV events' whole-pool changes, are read
in one place.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvcache_service.errors import (
    CacheError,
    FencedIncarnation,
    InvalidArgument,
    NeverFits,
    OutOfBlocks,
    PoolInUse,
    RegistrationLimit,
    TooManyWatchers,
    UnknownLease,
    UnknownPool,
    UnregisteredPool,
)
from kvcache_service.event_types import Batch, Cleared, ClearReason, Cursor, PoolKey
from kvcache_service.events import EventLog, PoolRecorder, event_cost, snapshot
from kvcache_service.ids import BlockId, LeaseId, Namespace, PoolId, Tokens
from kvcache_service.leases import AcquireRequest, Deferral, Grant, SequenceUpdate
from kvcache_service.names import MAX_NAME_CHARS, check_name
from kvcache_service.pool import PoolSpec, PoolState
from kvcache_service.pool_admin import Lookup
from kvcache_service.tier_index import Medium, TierBlock, tier_capacities
from kvcache_service.tokens import pack

MAX_BLOCKS = 1 << 24
MAX_BLOCK_SIZE = 4096
# Items in one batched call (AcquireLeases, ExtendLeases, CommitLeases, ReleaseLeases): a
# worker's batch is at most its running requests; each item is O(its tokens) of work.
MAX_BATCH_ITEMS = 1024
# Blocks one UpdateTiers may report (stored and dropped together; a worker sends its manifest
# in chunks), and blocks to delete one answer (UpdateTiers, Heartbeat) may carry (the rest
# wait for the next): each bounds the service's work a call (~1-2 us a block) and the message
# (~25 bytes a block).
MAX_TIER_ITEMS = 65_536
MAX_TIER_EVICT = 65_536


@dataclass(frozen=True, slots=True)
class AuthorityConfig:
    lease_ttl_s: float = 30.0
    # None: any block size; otherwise every pool must register with this one.
    block_size: int | None = None
    # Blocks one namespace may hold in a pool (None: no quota).
    namespace_quota_blocks: int | None = None
    # Registration bounds: each pool costs ~14 bytes of metadata per block, built while the
    # service is blocked (16M blocks: 229 MB, 1-1.5 s), so neither is left to the caller.
    max_pool_blocks: int = 1 << 22
    max_pools: int = 64
    # Namespaces are stored in the index and printed by the admin tools: bounded, printable.
    max_namespace_chars: int = MAX_NAME_CHARS
    # A pool silent for this many TTLs (its leases long expired) is forgotten.
    forget_after_ttls: float = 4.0
    # KV events (events.py): the replay buffer's bound, and how many watchers at once.
    events_buffer_bytes: int = 64 << 20
    max_watchers: int = 64


@dataclass(frozen=True, slots=True)
class Registration:
    incarnation: int
    lease_ttl_s: float
    heartbeat_interval_s: float
    max_namespace_chars: int


@dataclass(frozen=True, slots=True)
class PoolRoute:
    """One pool's answer to ``Route`` as the authority computes it (convert.py puts it on the
    wire). Kept apart from the gateway's ``PoolRoute`` (gateway/cache_client.py) on purpose:
    the two sides of the wire, and neither package may import the other."""

    pool_id: PoolId
    worker_address: str
    model: str
    cached_tokens: int
    free_blocks: int
    evictable_blocks: int
    live_leases: int
    alive: bool
    tier_tokens: int = 0  # past cached_tokens, those the pool's tiers hold


@dataclass(slots=True)
class _Liveness:
    deadline: float
    alive: bool = True
    # Expired lease ids not yet reported to the worker.
    unreported: list[LeaseId] = field(default_factory=list)


def as_tokens(values: Sequence[int], what: str, allow_empty: bool = False) -> Tokens:
    """`values` checked (ids in [0, MAX_TOKEN_ID]) and packed: what the domain carries."""
    return pack(values, what, allow_empty)


class CacheAuthority:
    """All pools of one service. Single-threaded: the asyncio servicer calls it from one loop.

    Liveness: every call from a pool renews its deadline (now + TTL). A pool past its
    deadline is dead: all its leases expire (blocks return to the budget; committed blocks
    stay cached) and their ids are reported on the pool's next Heartbeat or AcquireLease.
    """

    def __init__(self, config: AuthorityConfig, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.clock = clock
        self.pools: dict[PoolId, PoolState] = {}
        self._live: dict[PoolId, _Liveness] = {}
        # Time-based, so incarnations stay unique across restarts of this service.
        self._next_incarnation = time.time_ns() // 1000
        self._next_lease = 1
        # No pool can fall due before this (expire_due): a lower bound, never too late.
        self._quiet_until = -math.inf
        # The index's changes, recorded while anyone watches (events.py).
        self.events = EventLog(clock, config.events_buffer_bytes)

    # -- workers ------------------------------------------------------------------------------

    def register_pool(self, spec: PoolSpec, incarnation: int | None = None) -> Registration:
        """Registers (or re-registers) a pool: a new incarnation with an empty index.

        A live pool (heartbeating within its TTL) is only re-registered by a caller that
        presents its current `incarnation` (a worker recovering its own pool); anyone else,
        a caller holding none (None) included, gets PoolInUse until the pool's TTL lapses, so
        a second registrant cannot wipe its index. A restarted worker that lost its
        incarnation waits at most one TTL.
        """
        if not spec.pool_id:
            raise InvalidArgument("pool_id is empty")
        if not 1 <= spec.block_size <= MAX_BLOCK_SIZE:
            raise InvalidArgument(f"block_size must be in [1, {MAX_BLOCK_SIZE}]")
        if self.config.block_size is not None and spec.block_size != self.config.block_size:
            raise InvalidArgument(
                f"block_size mismatch: pool has {spec.block_size}, "
                f"this service requires {self.config.block_size}"
            )
        if not 1 <= spec.num_blocks <= MAX_BLOCKS:
            raise InvalidArgument(f"num_blocks must be in [1, {MAX_BLOCKS}]")
        if spec.num_blocks > self.config.max_pool_blocks:
            raise RegistrationLimit(
                f"num_blocks {spec.num_blocks} is over this service's limit of "
                f"{self.config.max_pool_blocks} per pool"
            )
        for medium, capacity in tier_capacities(spec.tiers).items():
            # The index costs ~0.3 KB a block a tier holds: bounded as the pool is.
            if capacity > self.config.max_pool_blocks:
                raise RegistrationLimit(
                    f"the {medium.name} tier's capacity of {capacity} blocks is over this "
                    f"service's limit of {self.config.max_pool_blocks} per tier"
                )
        self.expire_due()
        old = self.pools.get(spec.pool_id)
        if old is not None and self._live[spec.pool_id].alive and incarnation != old.incarnation:
            raise PoolInUse(f"pool {spec.pool_id!r} is live; register it after its TTL lapses")
        if old is None and len(self.pools) >= self.config.max_pools:
            raise RegistrationLimit(
                f"this service holds its limit of {self.config.max_pools} pools"
            )
        self._next_incarnation += 1
        ttl = self.config.lease_ttl_s
        pool = PoolState(spec, self._next_incarnation, self.config.namespace_quota_blocks)
        self.pools[spec.pool_id] = pool
        self._record_pool(pool, ClearReason.REGISTERED)
        self._live[spec.pool_id] = _Liveness(self.clock() + ttl)
        self._quiet_until = min(self._quiet_until, self._live[spec.pool_id].deadline)
        return Registration(self._next_incarnation, ttl, ttl / 4, self.config.max_namespace_chars)

    def heartbeat(
        self, pool_id: PoolId, incarnation: int
    ) -> tuple[list[LeaseId], int, list[tuple[int, Medium]]]:
        """The pool's leases that expired since it last heard, how many it holds, and tier
        blocks the service dropped since it last said (a flush, capacity): delete them."""
        pool = self._pool(pool_id, incarnation)
        evict = pool.tiers.take_evicted(MAX_TIER_EVICT)
        return self._take_expired(pool_id), len(pool.leases), evict

    def update_tiers(
        self,
        pool_id: PoolId,
        incarnation: int,
        stored: Sequence[TierBlock],
        dropped: Sequence[tuple[int, Medium]],
    ) -> list[tuple[int, Medium]]:
        """What the pool's tiers now hold (``stored``: spilled, or found at start) and no
        longer hold (``dropped``: key, medium); all or nothing. Answers the tier blocks the
        service dropped since it last said (capacity, a flush), at most MAX_TIER_EVICT of
        them: the worker deletes them."""
        if len(stored) + len(dropped) > MAX_TIER_ITEMS:
            raise InvalidArgument(f"UpdateTiers reports at most {MAX_TIER_ITEMS} blocks a call")
        pool = self._pool(pool_id, incarnation)
        if not pool.tiers.media:
            raise InvalidArgument(f"pool {pool_id!r} registered no tiers")
        for ns in {b.namespace for b in stored}:
            self.namespace(ns)
        pool.tiers.update(stored, dropped)
        return pool.tiers.take_evicted(MAX_TIER_EVICT)

    def acquire(self, req: AcquireRequest) -> tuple[Grant | Deferral, list[LeaseId]]:
        """A lease (or a Deferral), and the caller's leases that expired since it last heard."""
        # Checked before the pool is looked up (which renews it): a malformed call changes nothing.
        self._check(req)
        pool = self._pool(req.pool_id, req.incarnation)
        return self._acquire_on(pool, req), self._take_expired(req.pool_id)

    def acquire_many(
        self, pool_id: PoolId, incarnation: int, items: Sequence[AcquireRequest | CacheError]
    ) -> tuple[list[Grant | Deferral | CacheError], list[LeaseId]]:
        """Acquires for several prompts of one pool, in order: per item a Grant, a Deferral
        or the error that item met (an item the edge already refused comes in as its error).
        The first OutOfBlocks ends the batch: later items answer it untried, so a prompt the
        pool cannot hold yet is not overtaken by the ones behind it (the worker's order)."""
        self._check_batch(items)
        pool = self._pool(pool_id, incarnation)
        out: list[Grant | Deferral | CacheError] = []
        for i, item in enumerate(items):
            if isinstance(item, CacheError):
                out.append(item)
                continue
            try:
                if (item.pool_id, item.incarnation) != (pool_id, incarnation):
                    raise InvalidArgument("a batch's items are for the batch's pool")
                self._check(item)
                out.append(self._acquire_on(pool, item))
            except (InvalidArgument, NeverFits) as err:  # this item's own fault: go on
                out.append(err)
            except OutOfBlocks as err:
                untried = OutOfBlocks("not tried: an earlier item of the batch found no room")
                out += [err] + [untried] * (len(items) - i - 1)
                break
        return out, self._take_expired(pool_id)

    def _check(self, req: AcquireRequest) -> None:
        self.namespace(req.namespace)
        if not req.prompt:
            raise InvalidArgument("prompt is empty")

    def _acquire_on(self, pool: PoolState, req: AcquireRequest) -> Grant | Deferral:
        lease_id = LeaseId(self._next_lease)
        deadline = self._live[req.pool_id].deadline
        result = pool.leases.acquire(lease_id, req, req.prompt, self.clock(), deadline)
        if isinstance(result, Grant):
            self._next_lease += 1
        return result

    def extend(
        self, pool_id: PoolId, incarnation: int, items: Sequence[tuple[int, int]]
    ) -> list[tuple[LeaseId, list[BlockId]]]:
        self._check_batch(items)
        pool = self._pool(pool_id, incarnation)
        return pool.leases.extend([(LeaseId(lease), n) for lease, n in items])

    def commit(
        self, pool_id: PoolId, incarnation: int, items: Sequence[tuple[int, SequenceUpdate]]
    ) -> list[int]:
        """Applies each item's update (leases.SequenceUpdate) and indexes its written full
        blocks; every lease must be live before any is touched."""
        self._check_batch(items)
        pool = self._pool(pool_id, incarnation)
        for lease, _ in items:
            pool.leases.get(LeaseId(lease))  # all known before any commits
        now = self.clock()
        return [pool.leases.commit(LeaseId(lease), update, now) for lease, update in items]

    def release(
        self,
        pool_id: PoolId,
        incarnation: int,
        lease_id: int,
        update: SequenceUpdate | None = None,
    ) -> int:
        """Applies ``update`` (None: commits nothing more) and ends the lease."""
        pool = self._pool(pool_id, incarnation)
        return pool.leases.release(LeaseId(lease_id), update, self.clock())

    def release_many(
        self,
        pool_id: PoolId,
        incarnation: int,
        items: Sequence[tuple[int, SequenceUpdate | CacheError | None]],
    ) -> list[int | CacheError]:
        """Releases several leases of one pool: per item the tokens indexed, or the error
        that item met (an unknown lease, a refused update: that item changed nothing)."""
        self._check_batch(items)
        pool = self._pool(pool_id, incarnation)
        now = self.clock()
        out: list[int | CacheError] = []
        for lease_id, update in items:
            try:
                if isinstance(update, CacheError):
                    raise update
                out.append(pool.leases.release(LeaseId(lease_id), update, now))
            except (InvalidArgument, UnknownLease) as err:
                out.append(err)
        return out

    @staticmethod
    def _check_batch(items: Sequence[object]) -> None:
        if len(items) > MAX_BATCH_ITEMS:
            raise InvalidArgument(f"a batch holds at most {MAX_BATCH_ITEMS} items")

    def route(self, ns: Namespace, tokens: Tokens, model: str | None = None) -> list[PoolRoute]:
        """Every pool's cached prefix of ``tokens`` (checked and packed at the edge); only
        pools serving ``model``, when given (a pool that registered no model name serves
        any)."""
        ns = self.namespace(ns)
        if not tokens:
            raise InvalidArgument("prompt is empty")
        self.expire_due()
        out = []
        for pool_id, pool in self.pools.items():
            if model is not None and pool.spec.model and pool.spec.model != model:
                continue
            cached, tier_tokens = pool.match_tokens(ns, tokens)
            out.append(
                PoolRoute(
                    pool_id,
                    pool.spec.worker_address,
                    pool.spec.model,
                    cached,
                    pool.blocks.num_free,
                    len(pool.order),
                    len(pool.leases),
                    self._live[pool_id].alive,
                    tier_tokens,
                )
            )
        return out

    # -- liveness -----------------------------------------------------------------------------

    def expire_due(self) -> int:
        """Expires the leases of every pool past its deadline; returns how many. Forgets a
        pool silent for `forget_after_ttls` TTLs: it holds no lease by then, and a worker that
        comes back is told to register (UnregisteredPool), which it would have to do anyway."""
        now = self.clock()
        # Every call of a pool runs this; until the earliest moment the last sweep saw
        # anything fall due (deadlines only move later), there is nothing to look at.
        if now <= self._quiet_until:
            return 0
        forget_at = (self.config.forget_after_ttls - 1) * self.config.lease_ttl_s
        n = 0
        for pool_id, live in list(self._live.items()):
            pool = self.pools.get(pool_id)
            if pool is None:
                del self._live[pool_id]
                continue
            if live.alive and live.deadline < now:
                live.alive = False
                expired = pool.leases.expire_all()
                live.unreported.extend(expired)
                n += len(expired)
            if not live.alive and not pool.leases and now - live.deadline > forget_at:
                self._record_pool(pool, ClearReason.FORGOTTEN)
                del self.pools[pool_id], self._live[pool_id]
        self._quiet_until = min(
            (v.deadline if v.alive else v.deadline + forget_at for v in self._live.values()),
            default=math.inf,
        )
        return n

    def _pool(self, pool_id: PoolId, incarnation: int) -> PoolState:
        """The caller's pool, fenced by incarnation; the call renews its liveness."""
        self.expire_due()
        pool = self.pools.get(pool_id)
        if pool is None:
            raise UnregisteredPool(f"pool {pool_id!r} is not registered; register it")
        if incarnation != pool.incarnation:
            # Never name the current incarnation: it is what a call needs to act as the pool.
            raise FencedIncarnation(
                f"pool {pool_id!r} incarnation {incarnation} is not current; register again"
            )
        live = self._live[pool_id]
        live.alive = True
        live.deadline = self.clock() + self.config.lease_ttl_s
        self._quiet_until = min(self._quiet_until, live.deadline)
        return pool

    def _take_expired(self, pool_id: PoolId) -> list[LeaseId]:
        live = self._live[pool_id]
        expired, live.unreported = live.unreported, []
        return expired

    def is_alive(self, pool_id: PoolId) -> bool:
        return self._live[pool_id].alive

    def namespace(self, ns: str) -> Namespace:
        """``ns`` checked: at most ``max_namespace_chars`` characters, printable (checked
        before any work proportional to the request, so a 3 MB namespace costs one len())."""
        return Namespace(check_name(ns, "namespace", self.config.max_namespace_chars))

    # -- KV events ----------------------------------------------------------------------------

    def watch_events(self, wake: Callable[[], None]) -> None:
        """Adds a watcher (``wake``: called when batches are sealed), recording from now on
        if nobody watched: a new log, a recorder on every pool's index."""
        if self.events.watchers >= self.config.max_watchers:
            raise TooManyWatchers(
                f"this service serves its limit of {self.config.max_watchers} event watchers"
            )
        if not self.events.recording:
            self.events.start()
            for pool in self.pools.values():
                self._attach(pool)
        self.events.add_waker(wake)

    def unwatch_events(self, wake: Callable[[], None]) -> None:
        self.events.remove_waker(wake)

    def stop_events_if_idle(self, retain_s: float) -> bool:
        """Stops recording once nobody has watched for ``retain_s`` (a watcher that comes back
        later starts from a snapshot): the log's memory and cost go with it."""
        ev = self.events
        if not ev.recording or ev.idle_since is None or self.clock() - ev.idle_since < retain_s:
            return False
        ev.stop()
        for pool in self.pools.values():
            pool.index.listener = None
            pool.tiers.listener = None
        return True

    def events_snapshot(self, pool_id: PoolId | None) -> tuple[Cursor, list[Batch]]:
        """The index of every pool (or of ``pool_id``) as stored events, as of the log's end
        (the cursor returned): what a watcher that cannot resume rebuilds from."""
        cursor = self.events.cursor()
        now = self.clock()
        out: list[Batch] = []
        for pool in self.pools.values():
            if pool_id is None or pool.spec.pool_id == pool_id:
                key = _pool_key(pool)
                seq = self.events.pool_seq(key.pool_id)
                tiers = pool.tiers.entries_for_events()
                out += snapshot(key, pool.index.runs(), cursor.seq, seq, now, tiers)
        return cursor, out

    def _record_pool(self, pool: PoolState, reason: ClearReason) -> None:
        """A whole-pool change: every block of the pool left the index (a new incarnation
        starts empty; a forgotten pool is gone)."""
        if self.events.recording:
            event = Cleared(reason)
            self.events.record(_pool_key(pool), event, event_cost(event))
            if reason is ClearReason.REGISTERED:
                self._attach(pool)

    def _attach(self, pool: PoolState) -> None:
        recorder = PoolRecorder(self.events, _pool_key(pool))
        pool.index.listener = recorder
        pool.tiers.listener = recorder

    # -- admin --------------------------------------------------------------------------------

    def get_pool(self, pool_id: str) -> PoolState:
        pool = self.pools.get(PoolId(pool_id))
        if pool is None:
            raise UnknownPool(f"unknown pool {pool_id!r}")
        return pool

    def select(self, pool_id: str | None) -> list[PoolState]:
        """One pool by id, or every pool for None."""
        self.expire_due()
        return [self.get_pool(pool_id)] if pool_id is not None else list(self.pools.values())

    def lookup(
        self, pool_id: str | None, ns: Namespace, prompt: Sequence[int]
    ) -> list[tuple[str, Lookup]]:
        ns = self.namespace(ns)
        tokens = as_tokens(prompt, "prompt")
        return [(p.spec.pool_id, p.admin.lookup(ns, tokens)) for p in self.select(pool_id)]

    def flush(self, pool_id: str | None, medium: Medium | None = None) -> int:
        """Evicts every unreferenced, unpinned block of the pool (None: of every pool); or,
        ``medium`` given, drops every block of that tier (of every pool that has one, or of the
        pool named, which must), which its worker is told to delete. Returns how many."""
        pools = self.select(pool_id)
        if medium is None:
            return sum(pool.admin.flush() for pool in pools)
        if pool_id is None:
            pools = [p for p in pools if medium in p.tiers.media]
        return sum(pool.admin.flush_tier(medium) for pool in pools)

    def check_integrity(self) -> list[str]:
        problems = []
        for pool in self.pools.values():
            problems += pool.check_integrity()
        return problems


def _pool_key(pool: PoolState) -> PoolKey:
    return PoolKey(pool.spec.pool_id, pool.incarnation, pool.block_size)
