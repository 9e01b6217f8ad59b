"""KV events: the radix index's changes as a log of numbered batches, which a router replays
into its own copy of every pool's index instead of calling Route per request (WatchEvents,
docs/kv-events.md). vLLM's and SGLang's KV-event publishers carry the same information.

Where they come from: the index itself. ``RadixIndex`` calls its listener (a
:class:`PoolRecorder`, one per pool incarnation) in the only three places a block enters or
leaves it: ``insert`` (a commit's new blocks), ``insert_tail`` (a release's partial last block)
and ``remove_leaves`` (every eviction, flush, admin eviction, and a tail an acquire takes over);
splits and merges move no block from one path to another, so they say nothing. The authority
adds the whole-pool changes: a registration (a new, empty incarnation) and a forgotten pool.
No path that changes the index can miss its event, and pins, references and expiries, which
change no index, make none.

Cost: nothing is recorded until the first watcher (the listener is None: one attribute test
per insert or removal). While recording, an event is a small object and a slice of tokens
the index already holds; the events of one service step (one call) are sealed into one batch
per pool, numbered when sealed.

Memory: batches are held in one replay buffer, bounded in bytes (oldest dropped first), which
every watcher reads from at its own position. A watcher that falls behind the buffer's start
is ended (:class:`FellBehind`), so a slow consumer never holds more than the buffer does; with
its cursor it resumes if the buffer still holds the batches after it, or gets a snapshot.

The events themselves are values in event_types.py. This file is one log over 300 lines on
purpose: recording, sealing, reading and the watchers all move one replay buffer and its byte
bound, which stays correct only if they are read together.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from kvcache_service.errors import FellBehind
from kvcache_service.event_types import (
    Batch,
    Cleared,
    Cursor,
    Event,
    PoolKey,
    Removed,
    ResetReason,
    Stored,
    TierRemoved,
    TierStored,
)
from kvcache_service.ids import BlockId, Namespace, PoolId
from kvcache_service.tokens import TOKEN_BYTES

# A batch is sealed early once it holds this much (a flush of a large pool, a long prompt's
# commit), and a run of stored blocks is split to fit: every message stays far below gRPC's
# 4 MiB default receive limit.
MAX_BATCH_BYTES = 1 << 20
# What an event costs beyond its tokens and block ids (object headers, the batch's share).
EVENT_OVERHEAD = 96
BLOCK_ID_BYTES = 8
TIER_KEY_BYTES = 8


@dataclass(slots=True)
class _Open:
    """A pool's batch while the step that writes it runs. Removals accumulate in one list
    (a flush removes blocks one call at a time) and become one event when something else
    comes or the batch is sealed; so do a tier's changes (a worker's report stores blocks one
    at a time), one event per run of one medium (and namespace)."""

    key: PoolKey
    events: list[Event] = field(default_factory=list)
    removing: list[BlockId] = field(default_factory=list)
    cost: int = 0
    # The tier run being gathered: ("stored", medium, namespace) or ("removed", medium, "").
    tier_run: tuple[str, int, Namespace] | None = None
    tier_keys: list[int] = field(default_factory=list)
    tier_parents: list[int] = field(default_factory=list)

    def close_removals(self) -> None:
        self.close_tier_run()
        if self.removing:
            self.events.append(Removed(tuple(self.removing)))
            self.removing = []

    def close_tier_run(self) -> None:
        run = self.tier_run
        if run is None:
            return
        kind, medium, ns = run
        keys = tuple(self.tier_keys)
        if kind == "stored":
            self.events.append(TierStored(medium, ns, keys, tuple(self.tier_parents)))
        else:
            self.events.append(TierRemoved(medium, keys))
        self.tier_run, self.tier_keys, self.tier_parents = None, [], []


class PoolRecorder:
    """The index's listener for one pool incarnation (``RadixIndex.listener``)."""

    __slots__ = ("_chunk_bytes", "_key", "_log", "_run_blocks")

    def __init__(self, log: EventLog, key: PoolKey) -> None:
        self._log = log
        self._key = key
        self._chunk_bytes = key.block_size * TOKEN_BYTES
        self._run_blocks = _run_blocks(self._chunk_bytes)

    def stored(
        self, ns: Namespace, parent: BlockId | None, blocks: list[BlockId], tokens: bytes
    ) -> None:
        if len(blocks) <= self._run_blocks:  # the common case, without a generator
            event = Stored(ns, parent, tuple(blocks), tokens)
            cost = EVENT_OVERHEAD + len(tokens) + BLOCK_ID_BYTES * len(blocks)
            self._log.record(self._key, event, cost)
            return
        for run in _runs(ns, parent, blocks, tokens, self._chunk_bytes):
            self._log.record(self._key, run, event_cost(run))

    def removed(self, blocks: list[BlockId]) -> None:
        self._log.record_removed(self._key, blocks)

    def tier_stored(self, medium: int, ns: Namespace, key: int, parent: int) -> None:
        """A block entered a tier (``TierIndex.listener``)."""
        self._log.record_tier(self._key, ("stored", medium, ns), key, parent)

    def tier_removed(self, medium: int, keys: list[int]) -> None:
        """Blocks left a tier (``TierIndex.listener``)."""
        for key in keys:
            self._log.record_tier(self._key, ("removed", medium, Namespace("")), key, 0)


def _runs(
    ns: Namespace, parent: BlockId | None, blocks: list[BlockId], tokens: bytes, cb: int
) -> Iterator[Stored]:
    """``Stored`` events for a run, split where it would not fit a batch."""
    step = _run_blocks(cb)
    for i in range(0, len(blocks), step):
        part = tuple(blocks[i : i + step])
        yield Stored(ns, parent, part, tokens[i * cb : (i + step) * cb])
        parent = part[-1]


def _run_blocks(chunk_bytes: int) -> int:
    """The most blocks one stored event holds: half a batch."""
    return max(1, MAX_BATCH_BYTES // 2 // (chunk_bytes + BLOCK_ID_BYTES))


def event_cost(event: Event) -> int:
    if isinstance(event, Stored):
        return EVENT_OVERHEAD + len(event.tokens) + BLOCK_ID_BYTES * len(event.blocks)
    if isinstance(event, Removed):
        return EVENT_OVERHEAD + BLOCK_ID_BYTES * len(event.blocks)
    if isinstance(event, TierStored):
        return EVENT_OVERHEAD + 2 * TIER_KEY_BYTES * len(event.keys)
    if isinstance(event, TierRemoved):
        return EVENT_OVERHEAD + TIER_KEY_BYTES * len(event.keys)
    return EVENT_OVERHEAD


class EventLog:
    """The service's one log of index changes, and its replay buffer.

    Recording is off (log_id 0) until the first watcher comes; :meth:`start` begins a new log
    (a new random ``log_id``, seq from 1): the authority attaches a recorder to every pool's
    index then. ``seal`` numbers the step's open batches and wakes the watchers; it runs soon
    after any event (``on_pending``, which the server points at its event loop) and before any
    read, so a reader always sees everything recorded before it. Single-threaded, like the
    authority.
    """

    def __init__(self, clock: Callable[[], float], max_bytes: int) -> None:
        self.clock = clock
        self.max_bytes = max_bytes
        self.log_id = 0  # 0: not recording
        self.seq = 0  # the last sealed batch's
        # Held batches are _batches[_head:], seqs consecutive; a list with a moving head (not
        # a deque) so a watcher's position is found by arithmetic, in O(1).
        self._batches: list[Batch] = []
        self._head = 0
        self._bytes = 0
        self._open: dict[PoolId, _Open] = {}
        self._pool_seq: dict[PoolId, int] = {}
        self._wakers: set[Callable[[], None]] = set()
        self._woken_at = 0  # the seq the watchers were last woken for
        # Set by the server: schedules a seal right after the current step (the call that is
        # recording events) ends.
        self.on_pending: Callable[[], None] | None = None
        self.idle_since: float | None = None

    # -- recording ----------------------------------------------------------------------------

    @property
    def recording(self) -> bool:
        return self.log_id != 0

    def start(self) -> None:
        self.log_id = secrets.randbits(62) + 1
        self.seq = 0
        self._drop_all()

    def stop(self) -> None:
        self.log_id = 0
        self._drop_all()

    def _drop_all(self) -> None:
        self._batches, self._head, self._bytes, self._woken_at = [], 0, 0, 0
        self._open.clear()
        self._pool_seq.clear()

    def record(self, key: PoolKey, event: Stored | Cleared, cost: int) -> None:
        batch = self._batch(key)
        pending = batch.events or batch.removing or batch.tier_run is not None
        if batch.cost + cost > MAX_BATCH_BYTES and pending:
            self._seal_one(key.pool_id)
            batch = self._batch(key)
        batch.close_removals()
        batch.events.append(event)
        batch.cost += cost

    def record_tier(
        self, key: PoolKey, run: tuple[str, int, Namespace], block: int, parent: int
    ) -> None:
        """One block of a tier's change: gathered into the run of its kind, medium and
        namespace (a new run closes the last one)."""
        batch = self._batch(key)
        if batch.tier_run != run:
            batch.close_tier_run()
            batch.tier_run = run
        batch.tier_keys.append(block)
        if run[0] == "stored":
            batch.tier_parents.append(parent)
        batch.cost += 2 * TIER_KEY_BYTES
        if batch.cost >= MAX_BATCH_BYTES:
            self._seal_one(key.pool_id)

    def record_removed(self, key: PoolKey, blocks: list[BlockId]) -> None:
        batch = self._batch(key)
        batch.close_tier_run()
        batch.removing += blocks
        batch.cost += BLOCK_ID_BYTES * len(blocks)
        if batch.cost >= MAX_BATCH_BYTES:
            self._seal_one(key.pool_id)

    def _batch(self, key: PoolKey) -> _Open:
        batch = self._open.get(key.pool_id)
        if batch is not None and batch.key == key:
            return batch
        if batch is not None:  # another incarnation's: its events come first
            self._seal_one(key.pool_id)
        if not self._open and self.on_pending is not None:
            self.on_pending()
        batch = self._open[key.pool_id] = _Open(key, cost=EVENT_OVERHEAD)
        return batch

    def seal(self) -> None:
        """Numbers the open batches, holds them, trims the buffer; wakes the watchers when
        there is anything new (a batch sealed early, when it filled, included)."""
        for pool_id in list(self._open):
            self._seal_one(pool_id)
        if self._woken_at != self.seq:
            self._woken_at = self.seq
            for wake in list(self._wakers):
                wake()

    def _seal_one(self, pool_id: PoolId) -> None:
        batch = self._open.pop(pool_id)
        batch.close_removals()
        self.seq += 1
        pool_seq = self._pool_seq[pool_id] = self._pool_seq.get(pool_id, 0) + 1
        sealed = Batch(self.seq, batch.key, pool_seq, self.clock(), tuple(batch.events), batch.cost)
        self._batches.append(sealed)
        self._bytes += sealed.cost
        while self._bytes > self.max_bytes and len(self._batches) - self._head > 1:
            self._bytes -= self._batches[self._head].cost
            self._head += 1
        if self._head > 1024 and self._head * 2 > len(self._batches):
            del self._batches[: self._head]
            self._head = 0

    # -- reading ------------------------------------------------------------------------------

    @property
    def first_seq(self) -> int:
        """The oldest held batch's seq (the next one's, when none is held)."""
        if self._head < len(self._batches):
            return self._batches[self._head].seq
        return self.seq + 1

    def cursor(self) -> Cursor:
        """The log's end: after its last sealed batch."""
        self.seal()
        return Cursor(self.log_id, self.seq)

    def pool_seq(self, pool_id: PoolId) -> int:
        """The number of the pool's last sealed batch (0: none yet)."""
        return self._pool_seq.get(pool_id, 0)

    def resume(self, cursor: Cursor | None) -> int | ResetReason:
        """Where a watcher holding ``cursor`` continues (the seq it has applied), or why it
        cannot: then it starts from a snapshot."""
        self.seal()
        if cursor is None:
            return ResetReason.NO_CURSOR
        if cursor.log_id != self.log_id:
            return ResetReason.OTHER_LOG
        if cursor.seq > self.seq:
            return ResetReason.AHEAD
        if cursor.seq < self.first_seq - 1:
            return ResetReason.TOO_OLD
        return cursor.seq

    def after(self, seq: int, limit: int, max_bytes: int | None = None) -> list[Batch]:
        """The held batches after ``seq``, oldest first: at most ``limit``, and no more than
        ``max_bytes`` of them past the first. FellBehind when the buffer no longer holds the
        one right after it."""
        self.seal()
        first = self.first_seq
        if seq < first - 1:
            raise FellBehind(
                f"the watcher applied batch {seq}; the replay buffer starts at {first}"
            )
        i = self._head + (seq + 1 - first)
        out = self._batches[i : i + limit]
        if max_bytes is not None:
            total = 0
            for k, b in enumerate(out):
                total += b.cost
                if total > max_bytes and k:
                    return out[:k]
        return out

    # -- watchers -----------------------------------------------------------------------------

    def add_waker(self, wake: Callable[[], None]) -> None:
        self._wakers.add(wake)
        self.idle_since = None

    def remove_waker(self, wake: Callable[[], None]) -> None:
        self._wakers.discard(wake)
        if not self._wakers:
            self.idle_since = self.clock()

    @property
    def watchers(self) -> int:
        return len(self._wakers)

    def held(self) -> Iterable[Batch]:
        """The held batches, oldest first (tests, stats)."""
        return self._batches[self._head :]

    @property
    def held_bytes(self) -> int:
        return self._bytes


def snapshot(
    key: PoolKey,
    runs: Iterable[tuple[Namespace, BlockId | None, list[BlockId], bytes]],
    seq: int,
    pool_seq: int,
    now: float,
    tiers: Iterable[tuple[int, Namespace, int, int]] = (),
) -> list[Batch]:
    """A pool's index as batches of stored events (``runs`` parents first, as
    ``RadixIndex.runs`` gives them), then its tiers' blocks (``tiers``: medium, namespace,
    key, parent key), each batch at the snapshot's position ``seq``; at least one batch,
    which an empty index leaves without events."""
    cb = key.block_size * TOKEN_BYTES
    out: list[Batch] = []
    events: list[Event] = []
    cost = EVENT_OVERHEAD

    def add(event: Event) -> None:
        nonlocal events, cost
        events.append(event)
        cost += event_cost(event)
        if cost >= MAX_BATCH_BYTES:
            out.append(Batch(seq, key, pool_seq, now, tuple(events), cost))
            events, cost = [], EVENT_OVERHEAD

    for ns, parent, blocks, tokens in runs:
        for run in _runs(ns, parent, blocks, tokens, cb):
            add(run)
    step = MAX_BATCH_BYTES // 4 // (2 * TIER_KEY_BYTES)
    group: tuple[int, Namespace] | None = None
    keys: list[int] = []
    parents: list[int] = []
    for medium, tier_ns, k, parent_key in tiers:
        if (medium, tier_ns) != group or len(keys) >= step:
            if group is not None:
                add(TierStored(group[0], group[1], tuple(keys), tuple(parents)))
            group, keys, parents = (medium, tier_ns), [], []
        keys.append(k)
        parents.append(parent_key)
    if group is not None:
        add(TierStored(group[0], group[1], tuple(keys), tuple(parents)))
    if events or not out:
        out.append(Batch(seq, key, pool_seq, now, tuple(events), cost))
    return out
