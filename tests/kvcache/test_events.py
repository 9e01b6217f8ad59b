"""KV events, pure domain: randomized operation sequences on the authority (every rule of the
pool model: acquires that share, copy or take over tails, extends, commits, releases that
index tails, expiries, re-registrations, evictions, flushes, pins), with a watcher that
replays the emitted events into a naive index (tests/kvcache/event_replay.py) after every
step; the replay must equal the authority's index, pool by pool. Watchers also look away
(and fall behind a small replay buffer), reconnect with their cursor, or start fresh from a
snapshot; pools are forgotten and come back.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import event
from hypothesis.stateful import initialize, invariant, rule

from kvcache_service.authority import AuthorityConfig, CacheAuthority
from kvcache_service.errors import FellBehind, TooManyWatchers
from kvcache_service.event_types import Cursor, PoolKey, ResetReason
from kvcache_service.events import MAX_BATCH_BYTES, EventLog
from kvcache_service.ids import BlockId, Namespace, PoolId
from kvcache_service.leases import AcquireRequest, Grant, SequenceUpdate
from kvcache_service.pool import PoolSpec
from kvcache_service.tier_index import Medium, TierBlock
from kvcache_service.tokens import pack
from kvserve_proto.block_keys import namespace_key
from tests.kvcache.event_replay import Replica
from tests.kvcache.test_pool_model import (
    POOLS,
    TTL,
    PoolMachine,
    machine_settings,
    real_index_view,
)


class EventsMachine(PoolMachine):
    BUFFER = 64 << 20  # the replay buffer's bound, in bytes

    @initialize()
    def setup(self) -> None:
        super().setup()
        self.auth.events.max_bytes = self.BUFFER
        self.wakes = 0
        self.lagging = 0
        # Pools registered before anyone watched: the first watcher starts from a snapshot.
        self.auth.watch_events(self._wake)
        self.replica = Replica()
        self._resync(ResetReason.NO_CURSOR)

    def _wake(self) -> None:
        self.wakes += 1

    def _resync(self, why: ResetReason) -> None:
        event(f"events: snapshot ({why.value})")
        at, batches = self.auth.events_snapshot(None)
        assert at.log_id == self.auth.events.log_id
        self.replica.reset(at.seq)
        for b in batches:
            self.replica.apply(b, snapshot=True)

    def _catch_up(self) -> None:
        log = self.auth.events
        start = log.resume(Cursor(log.log_id, self.replica.seq))
        if isinstance(start, ResetReason):
            assert start is ResetReason.TOO_OLD
            with pytest.raises(FellBehind):
                log.after(self.replica.seq, 1)
            self._resync(start)
            return
        batches = log.after(start, 1 << 30)
        event(f"events: caught up over {'3+' if len(batches) >= 3 else len(batches)} batches")
        for b in batches:
            self.replica.apply(b)
        assert log.held_bytes <= max(self.BUFFER, MAX_BATCH_BYTES * 2)

    def _compare(self) -> None:
        assert set(self.replica.pools) == set(self.auth.pools)
        for pool_id, pool in self.auth.pools.items():
            copy = self.replica.pools[pool_id]
            assert (copy.incarnation, copy.block_size) == (pool.incarnation, pool.block_size)
            assert copy.view() == real_index_view(pool), pool_id

    @invariant()
    def replay_equals_the_index(self) -> None:
        if not hasattr(self, "replica"):
            return
        if self.lagging:
            self.lagging -= 1
            return
        self._catch_up()
        self._compare()

    # -- watchers -----------------------------------------------------------------------------

    @rule(steps=st.integers(1, 8))
    def look_away(self, steps: int) -> None:
        """The watcher reads nothing for a few steps (a small buffer drops what it missed)."""
        event("events: looked away")
        self.lagging = steps

    @rule()
    def fresh_watcher(self) -> None:
        """A second watcher with no cursor: its snapshot equals the index at once."""
        event("events: a fresh watcher")
        self._catch_up()
        second, self.replica = self.replica, Replica()
        self._resync(ResetReason.NO_CURSOR)
        self._compare()
        assert self.replica.seq == second.seq
        assert {p: r.view() for p, r in self.replica.pools.items()} == {
            p: r.view() for p, r in second.pools.items()
        }

    @rule()
    def forget_every_pool(self) -> None:
        """Every pool goes silent for longer than the service keeps it, then registers again."""
        event("events: every pool forgotten")
        self.now += 5 * TTL + 1
        self.auth.expire_due()
        assert not self.auth.pools
        if not self.lagging:
            self._catch_up()
            assert not self.replica.pools
        for pool_id in POOLS:
            self._register(pool_id)  # new reference pools too: the old ones are gone


EventsMachine.TestCase.settings = machine_settings(400)
TestEvents = EventsMachine.TestCase


class SmallBufferEventsMachine(EventsMachine):
    BUFFER = 1024  # a few batches: a watcher that looks away falls behind


SmallBufferEventsMachine.TestCase.settings = machine_settings(200)
TestEventsSmallBuffer = SmallBufferEventsMachine.TestCase


# -- deterministic cases ----------------------------------------------------------------------


def _authority() -> tuple[CacheAuthority, list[float]]:
    now = [1000.0]
    return CacheAuthority(AuthorityConfig(lease_ttl_s=TTL), clock=lambda: now[0]), now


def _request(auth: CacheAuthority, prompt: list[int], pool: str = "a", seal: bool = True) -> Grant:
    """Acquire, then release committing the prompt; then the step ends (``seal``), as a call
    to the server does."""
    inc = auth.pools[PoolId(pool)].incarnation
    req = AcquireRequest(PoolId(pool), inc, Namespace(""), pack(prompt, "p"), 0)
    grant, _ = auth.acquire(req)
    assert isinstance(grant, Grant)
    update = SequenceUpdate.whole(pack(prompt, "p"))
    auth.release(PoolId(pool), inc, grant.lease_id, update)
    if seal:
        auth.events.seal()
    return grant


def _replica_of(auth: CacheAuthority) -> Replica:
    """A watcher's copy, from a snapshot."""
    replica = Replica()
    at, batches = auth.events_snapshot(None)
    replica.reset(at.seq)
    for b in batches:
        replica.apply(b, snapshot=True)
    return replica


def _caught_up(auth: CacheAuthority, replica: Replica) -> None:
    for b in auth.events.after(replica.seq, 1 << 30):
        replica.apply(b)
    for pool_id, pool in auth.pools.items():
        assert replica.pools[pool_id].view() == real_index_view(pool)


def test_a_tail_taken_over_leaves_and_comes_back_longer() -> None:
    """A chat's next turn takes its tail over (the tail leaves the index as a removal), then
    its release indexes the longer sequence: the rarest path of the state machines."""
    auth, _ = _authority()
    auth.register_pool(PoolSpec(PoolId("a"), 16, 4))
    auth.watch_events(lambda: None)
    replica = _replica_of(auth)
    first = list(range(1, 12))  # two full blocks and a tail of three tokens
    _request(auth, first)
    _caught_up(auth, replica)
    tail = replica.pools["a"].view()[("", tuple(first))]
    inc = auth.pools[PoolId("a")].incarnation
    turn = [*first, 12, 13, 14]
    req = AcquireRequest(PoolId("a"), inc, Namespace(""), pack(turn, "p"), 0)
    grant, _ = auth.acquire(req)
    assert isinstance(grant, Grant) and grant.block_table[2] == tail and not grant.copy_on_write
    auth.events.seal()
    (batch,) = auth.events.after(replica.seq, 10)
    assert [type(e).__name__ for e in batch.events] == ["Removed"]
    _caught_up(auth, replica)
    assert tail not in replica.pools["a"].blocks
    auth.release(PoolId("a"), inc, grant.lease_id, SequenceUpdate.whole(pack(turn, "p")))
    _caught_up(auth, replica)
    assert replica.pools["a"].view()[("", tuple(turn[:12]))] == tail  # a full block now


def test_nothing_is_recorded_until_someone_watches() -> None:
    auth, _ = _authority()
    auth.register_pool(PoolSpec(PoolId("a"), 16, 4))
    _request(auth, list(range(1, 12)))
    assert auth.pools[PoolId("a")].index.listener is None
    assert not auth.events.recording and auth.events.seq == 0
    auth.watch_events(lambda: None)
    assert auth.pools[PoolId("a")].index.listener is not None
    _request(auth, list(range(20, 31)))
    assert auth.events.cursor().seq == 1


def test_recording_stops_when_nobody_watched_for_a_while() -> None:
    auth, now = _authority()
    auth.register_pool(PoolSpec(PoolId("a"), 16, 4))
    wake = lambda: None  # noqa: E731
    auth.watch_events(wake)
    _request(auth, list(range(1, 12)))
    old = auth.events.cursor()
    assert not auth.stop_events_if_idle(0.0)  # someone watches
    auth.unwatch_events(wake)
    now[0] += 5
    assert not auth.stop_events_if_idle(10.0)
    now[0] += 6
    assert auth.stop_events_if_idle(10.0)
    assert not auth.events.recording and auth.pools[PoolId("a")].index.listener is None
    auth.watch_events(wake)  # a new log: the old cursor cannot resume
    assert auth.events.resume(old) is ResetReason.OTHER_LOG


def test_cursors_resume_or_reset() -> None:
    auth, _ = _authority()
    auth.register_pool(PoolSpec(PoolId("a"), 64, 4))
    auth.watch_events(lambda: None)
    log = auth.events
    _request(auth, list(range(1, 12)))
    _request(auth, list(range(20, 31)))
    end = log.cursor()
    assert end.seq == 2
    assert log.resume(None) is ResetReason.NO_CURSOR
    assert log.resume(Cursor(end.log_id + 1, 1)) is ResetReason.OTHER_LOG
    assert log.resume(Cursor(end.log_id, 3)) is ResetReason.AHEAD
    assert log.resume(Cursor(end.log_id, 0)) == 0
    assert [b.seq for b in log.after(0, 10)] == [1, 2]
    assert [b.seq for b in log.after(1, 10)] == [2]
    assert [b.seq for b in log.after(0, 1)] == [1]
    assert [b.seq for b in log.after(0, 10, max_bytes=1)] == [1]  # at least one
    log.max_bytes = 1  # only the last batch is held
    _request(auth, list(range(40, 51)))
    assert [b.seq for b in log.held()] == [3]
    assert log.resume(Cursor(end.log_id, 1)) is ResetReason.TOO_OLD
    assert log.resume(Cursor(end.log_id, 2)) == 2
    with pytest.raises(FellBehind):
        log.after(1, 10)


def test_one_step_is_one_batch_per_pool_and_numbers_are_consecutive() -> None:
    auth, _ = _authority()
    for p in ("a", "b"):
        auth.register_pool(PoolSpec(PoolId(p), 16, 4))
    woken: list[int] = []
    auth.watch_events(lambda: woken.append(auth.events.seq))
    _request(auth, list(range(1, 12)), "a", seal=False)  # nothing sealed between: one step
    _request(auth, list(range(1, 12)), "b", seal=False)
    assert auth.get_pool("a").admin.pin(Namespace(""), pack([1, 2, 3, 4], "p")) == 1
    auth.route(Namespace(""), pack([1, 2, 3, 4, 5], "p"))  # neither changes the index
    batches = list(auth.events.after(0, 10))
    assert [(b.seq, b.pool.pool_id, b.pool_seq) for b in batches] == [(1, "a", 1), (2, "b", 1)]
    assert woken == [2]  # one wake for what one seal found
    # Re-registering within a step: the old incarnation's batch is sealed before the new one.
    inc = auth.pools[PoolId("a")].incarnation
    auth.get_pool("a").admin.flush()
    auth.register_pool(PoolSpec(PoolId("a"), 16, 4), inc)
    tail = list(auth.events.after(2, 10))
    assert [(b.pool.incarnation == inc, b.pool_seq) for b in tail] == [(True, 2), (False, 3)]


def test_a_big_flush_is_split_into_batches_that_fit_a_message() -> None:
    auth, _ = _authority()
    auth.register_pool(PoolSpec(PoolId("a"), 1 << 18, 1))
    auth.watch_events(lambda: None)
    replica = Replica()
    at, snap = auth.events_snapshot(None)
    replica.reset(at.seq)
    for b in snap:
        replica.apply(b, snapshot=True)
    inc = auth.pools[PoolId("a")].incarnation
    prompt = list(range(200_000))
    req = AcquireRequest(PoolId("a"), inc, Namespace(""), pack(prompt, "p"), 0)
    grant, _ = auth.acquire(req)
    assert isinstance(grant, Grant)
    auth.release(PoolId("a"), inc, grant.lease_id, SequenceUpdate.whole(pack(prompt, "p")))
    assert auth.get_pool("a").admin.flush() == 200_000
    batches = list(auth.events.after(0, 1000))
    assert len(batches) > 2 and all(b.cost <= MAX_BATCH_BYTES * 2 for b in batches)
    for b in batches:
        replica.apply(b)
    assert replica.pools["a"].blocks == {} and replica.seq == batches[-1].seq


def test_too_many_watchers() -> None:
    now = [0.0]
    auth = CacheAuthority(AuthorityConfig(max_watchers=1), clock=lambda: now[0])
    auth.watch_events(lambda: None)
    with pytest.raises(TooManyWatchers):
        auth.watch_events(lambda: None)


def test_the_replay_fails_when_an_event_is_lost() -> None:
    """Negative control: a recorder that drops the tails' events is caught by the same
    comparison the state machines make."""
    auth, _ = _authority()
    auth.register_pool(PoolSpec(PoolId("a"), 16, 4))
    auth.watch_events(lambda: None)
    index = auth.pools[PoolId("a")].index
    recorder = index.listener
    assert recorder is not None

    class DropsTails:
        def stored(self, ns, parent, blocks, tokens) -> None:  # type: ignore[no-untyped-def]
            if len(tokens) == index.chunk_bytes * len(blocks):
                recorder.stored(ns, parent, blocks, tokens)

        def removed(self, blocks: list[BlockId]) -> None:
            recorder.removed(blocks)

    index.listener = DropsTails()
    _request(auth, list(range(1, 12)))  # 2 full blocks and a tail of 3 tokens
    replica = Replica()
    replica.reset(0)
    replica.begin("a", auth.pools[PoolId("a")].incarnation, 4)
    for b in auth.events.after(0, 10):
        replica.apply(b)
    assert replica.pools["a"].view() != real_index_view(auth.pools[PoolId("a")])


def test_pool_key_and_log_are_plain_values() -> None:
    log = EventLog(lambda: 0.0, 1 << 20)
    assert not log.recording and log.first_seq == 1 and list(log.held()) == []
    assert PoolKey(PoolId("a"), 1, 4) == PoolKey(PoolId("a"), 1, 4)


def test_tier_blocks_are_events_by_key_and_in_snapshots() -> None:
    """A worker's tier reports, the capacity evictions they cause and a tier flush reach a
    watcher as tier events (by block key and medium); a snapshot carries the tiers too."""
    auth, _ = _authority()
    auth.register_pool(PoolSpec(PoolId("a"), 16, 4, tiers=((Medium.DISK, 3),)))
    inc = auth.pools[PoolId("a")].incarnation
    auth.watch_events(lambda: None)
    replica = _replica_of(auth)

    root = namespace_key("t")  # a chain's first block's parent key: 11 and 21 are first blocks

    def blocks(keys: list[int]) -> list[TierBlock]:
        return [
            TierBlock(k, root if k % 10 == 1 else k - 1, Namespace("t"), Medium.DISK) for k in keys
        ]

    def held() -> dict[int, tuple[str, int]]:
        for b in auth.events.after(replica.seq, 1 << 30):
            replica.apply(b)
        return replica.pools["a"].tiers.get(int(Medium.DISK), {})

    auth.update_tiers(PoolId("a"), inc, blocks([11, 12, 13]), [])
    auth.events.seal()
    assert held() == {11: ("t", root), 12: ("t", 11), 13: ("t", 12)}
    auth.update_tiers(PoolId("a"), inc, blocks([21, 22]), [(12, Medium.DISK)])
    auth.events.seal()
    tier = auth.pools[PoolId("a")].tiers
    assert set(held()) == set(tier.keys(Medium.DISK)) and len(held()) == 3
    assert set(_replica_of(auth).pools["a"].tiers[int(Medium.DISK)]) == set(held())
    auth.flush("a", Medium.DISK)
    auth.events.seal()
    assert held() == {}
