"""WatchEvents over real gRPC (an in-process grpc.aio server on 127.0.0.1:0): a watcher's
replay of the stream equals the authority's index (and InspectTree's blocks) after every
operation; a cursor resumes with exactly the batches missed; a cursor the service cannot
resume gets a reset and a snapshot; the token is required; a watcher that stops reading is
ended with RESOURCE_EXHAUSTED while the service's memory stays bounded."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator

import grpc
import pytest

from kvcache_service.config import ServiceConfig
from kvcache_service.server import RunningService, running
from kvcache_service.tier_index import Medium
from kvserve_proto.block_keys import namespace_key
from kvserve_proto.kvcache.v1 import kvcache_pb2 as pb
from kvserve_proto.kvcache.v1 import kvcache_pb2_grpc as pb_grpc
from tests.kvcache.event_replay import Replica
from tests.kvcache.test_pool_model import real_index_view

SERVICE_TOKEN = "svc-token"
ADMIN_TOKEN = "admin-token"
SERVICE = [("authorization", f"Bearer {SERVICE_TOKEN}")]
ADMIN = [("authorization", f"Bearer {ADMIN_TOKEN}")]
BS = 4


class Watch:
    """One WatchEvents stream, read in the background into a Replica."""

    def __init__(
        self,
        kv: pb_grpc.KVCacheServiceStub,
        pool_id: str = "",
        after: pb.EventCursor | None = None,
        metadata: list[tuple[str, str]] = SERVICE,
    ) -> None:
        request = pb.WatchEventsRequest(pool_id=pool_id, after=after)
        self.call = kv.WatchEvents(request, metadata=metadata)
        self.replica = Replica()
        self.state: dict[str, object] = {
            "pool_id": pool_id,
            "phase": "resuming" if after is not None else None,
        }
        self.messages: list[pb.WatchEventsResponse] = []
        self.task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for m in self.call:
            self.messages.append(m)
            self.replica.apply_message(m, self.state)

    async def until(self, seq: int, timeout: float = 10.0) -> None:
        """Waits until the replica has applied everything through ``seq`` and is live."""
        async with asyncio.timeout(timeout):
            while self.replica.seq < seq or self.state["phase"] != "live":
                if self.task.done():
                    self.task.result()  # raises what ended the stream
                    raise AssertionError("the stream ended")
                await asyncio.sleep(0.005)

    @property
    def cursor(self) -> pb.EventCursor:
        for m in reversed(self.messages):
            kind = m.WhichOneof("message")
            if kind == "batch":
                return m.batch.cursor
            if kind in ("synced", "reset"):
                return m.synced if kind == "synced" else m.reset.cursor
        raise AssertionError("no message yet")

    async def close(self) -> None:
        self.call.cancel()
        with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
            await self.task


class Driver:
    """Leases and admin calls over gRPC, as workers and an operator make them."""

    def __init__(self, svc: RunningService, channel: grpc.aio.Channel) -> None:
        self.svc = svc
        self.kv = pb_grpc.KVCacheServiceStub(channel)
        self.admin = pb_grpc.KVCacheAdminStub(channel)
        self.pools: dict[str, pb.PoolRef] = {}

    async def register(self, pool_id: str, num_blocks: int = 24) -> None:
        old = self.pools.get(pool_id)
        resp = await self.kv.RegisterPool(
            pb.RegisterPoolRequest(
                pool_id=pool_id,
                num_blocks=num_blocks,
                block_size=BS,
                model="tiny",
                worker_address=f"{pool_id}:1",
                incarnation=old.incarnation if old else 0,
            ),
            metadata=SERVICE,
        )
        self.pools[pool_id] = pb.PoolRef(pool_id=pool_id, incarnation=resp.incarnation)

    async def request(self, pool_id: str, prompt: list[int], answer: list[int], ns: str = ""):
        """Acquire, commit the prompt's full blocks, release with the answer (a tail)."""
        pool = self.pools[pool_id]
        resp = await self.kv.AcquireLease(
            pb.AcquireLeaseRequest(
                pool=pool, namespace=ns, prompt_token_ids=prompt, reserve_tokens=len(answer)
            ),
            metadata=SERVICE,
        )
        lease = resp.lease
        await self.kv.CommitLeases(
            pb.CommitLeasesRequest(
                pool=pool, items=[pb.CommitItem(lease_id=lease.lease_id, token_ids=prompt)]
            ),
            metadata=SERVICE,
        )
        await self.kv.ReleaseLease(
            pb.ReleaseLeaseRequest(
                pool=pool, lease_id=lease.lease_id, token_ids=[*prompt, *answer]
            ),
            metadata=SERVICE,
        )

    async def random_op(self, rng: random.Random) -> str:
        pool_id = rng.choice(sorted(self.pools))
        r = rng.random()
        if r < 0.6:
            stem = [rng.choice([1, 2, 3])] * rng.randint(0, 12)
            prompt = stem + [rng.randint(0, 9) for _ in range(rng.randint(1, 10))]
            answer = [rng.randint(0, 9) for _ in range(rng.randint(0, 5))]
            try:
                await self.request(pool_id, prompt, answer, rng.choice(["", "t1"]))
            except grpc.aio.AioRpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            return "request"
        if r < 0.7:
            await self.admin.Evict(
                pb.EvictRequest(pool_id=pool_id, num_blocks=rng.randint(1, 4)), metadata=ADMIN
            )
            return "evict"
        if r < 0.75:
            await self.admin.Flush(pb.FlushRequest(pool_id=pool_id), metadata=ADMIN)
            return "flush"
        if r < 0.8:
            prefix = pb.PrefixRef(token_ids=[rng.choice([1, 2, 3])] * 4)
            with contextlib.suppress(grpc.aio.AioRpcError):
                await self.admin.Pin(pb.PinRequest(pool_id=pool_id, prefix=prefix), metadata=ADMIN)
            return "pin"
        if r < 0.85:
            await self.register(pool_id)
            return "register"
        prefix = pb.PrefixRef(token_ids=[rng.choice([1, 2, 3])] * rng.randint(1, 6))
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self.admin.Evict(pb.EvictRequest(pool_id=pool_id, prefix=prefix), metadata=ADMIN)
        return "evict prefix"

    def end(self) -> int:
        """The log's last batch (sealing what the last call recorded)."""
        return self.svc.authority.events.cursor().seq

    async def compare(self, replica: Replica, only: str | None = None) -> None:
        """The replica equals the authority's index, and InspectTree's blocks and tokens."""
        pools = {p: s for p, s in self.svc.authority.pools.items() if only in (None, p)}
        assert set(replica.pools) == set(pools)
        for pool_id, pool in pools.items():
            copy = replica.pools[pool_id]
            assert copy.incarnation == pool.incarnation
            assert copy.view() == real_index_view(pool), pool_id
            tree = await self.admin.InspectTree(
                pb.InspectTreeRequest(pool_id=pool_id), metadata=ADMIN
            )
            assert sorted(b for n in tree.nodes for b in n.blocks) == sorted(copy.blocks)
            assert sum(n.num_tokens for n in tree.nodes) == sum(
                len(toks) for _, _, toks in copy.blocks.values()
            )


@contextlib.asynccontextmanager
async def service(**overrides: object) -> AsyncIterator[Driver]:
    settings: dict[str, object] = {
        "host": "127.0.0.1",
        "port": 0,
        "admin_token": ADMIN_TOKEN,
        "service_token": SERVICE_TOKEN,
        "sweep_interval_s": 0.05,
    }
    config = ServiceConfig(**(settings | overrides))  # type: ignore[arg-type]
    async with running(config) as svc, grpc.aio.insecure_channel(svc.address) as channel:
        yield Driver(svc, channel)
        check = await Driver(svc, channel).admin.CheckIntegrity(
            pb.CheckIntegrityRequest(), metadata=ADMIN
        )
        assert check.ok, list(check.problems)


@pytest.fixture
async def driver() -> AsyncIterator[Driver]:
    async with service() as d:
        yield d


async def test_the_stream_replays_into_the_authority_index(driver: Driver) -> None:
    await driver.register("w1", 16)  # before anyone watches: the first snapshot holds it
    await driver.request("w1", [1, 2, 3, 4, 5, 6, 7, 8, 9], [10, 11])
    watch = Watch(driver.kv)
    await watch.until(driver.end())
    assert watch.messages[0].reset.reason == pb.EventsReset.REASON_NO_CURSOR
    await driver.compare(watch.replica)
    await driver.register("w2", 24)
    rng = random.Random(7)
    done: dict[str, int] = {}
    for _ in range(150):
        op = await driver.random_op(rng)
        done[op] = done.get(op, 0) + 1
        await watch.until(driver.end())
        await driver.compare(watch.replica)
    assert all(done.get(op, 0) >= 3 for op in ("request", "evict", "flush", "register")), done
    evicted = sum(p.counters.evicted_blocks for p in driver.svc.authority.pools.values())
    assert evicted > 0
    await watch.close()


async def test_a_cursor_resumes_with_exactly_the_missed_batches(driver: Driver) -> None:
    await driver.register("w1")
    steady = Watch(driver.kv)  # never disconnects: what was sent meanwhile
    leaving = Watch(driver.kv)
    await leaving.until(driver.end())
    await steady.until(driver.end())
    cursor = leaving.cursor
    await leaving.close()
    rng = random.Random(3)
    for _ in range(30):
        await driver.random_op(rng)
    end = driver.end()
    await steady.until(end)
    back = Watch(driver.kv, after=cursor)
    back.replica = leaving.replica  # the copy it had when it left
    await back.until(end)
    missed = [m.batch for m in steady.messages if m.HasField("batch")]
    missed = [b for b in missed if b.cursor.seq > cursor.seq]
    assert len(missed) >= 10
    got = [m for m in back.messages]
    assert [m.WhichOneof("message") for m in got] == ["batch"] * len(missed) + ["synced"]
    assert [m.batch for m in got[:-1]] == missed
    assert got[-1].synced.seq == end
    await driver.compare(back.replica)
    for w in (steady, back):
        await w.close()


@pytest.mark.parametrize("which", ["too old", "other log", "ahead"])
async def test_a_cursor_that_cannot_resume_gets_a_reset_and_a_snapshot(
    driver: Driver, which: str
) -> None:
    await driver.register("w1")
    first = Watch(driver.kv)
    await first.until(driver.end())
    cursor = first.cursor
    await first.close()
    driver.svc.authority.events.max_bytes = 1  # the buffer holds the last batch only
    rng = random.Random(5)
    for _ in range(20):
        await driver.random_op(rng)
    if which == "other log":
        cursor = pb.EventCursor(log_id=cursor.log_id + 1, seq=cursor.seq)
    if which == "ahead":
        cursor = pb.EventCursor(log_id=cursor.log_id, seq=driver.end() + 5)
    again = Watch(driver.kv, after=cursor)
    again.replica = first.replica
    await again.until(driver.end())
    reason = {
        "too old": pb.EventsReset.REASON_TOO_OLD,
        "other log": pb.EventsReset.REASON_OTHER_LOG,
        "ahead": pb.EventsReset.REASON_AHEAD,
    }[which]
    assert again.messages[0].reset.reason == reason
    assert again.messages[0].reset.cursor.seq == driver.end()
    await driver.compare(again.replica)
    await again.close()


async def test_one_pool_only(driver: Driver) -> None:
    for p in ("w1", "w2"):
        await driver.register(p)
    watch = Watch(driver.kv, pool_id="w2")
    rng = random.Random(11)
    for _ in range(40):
        await driver.random_op(rng)
    await driver.request("w2", [5, 5, 5, 5, 6], [7])  # the last batch is w2's
    await watch.until(driver.end())
    batches = [m.batch for m in watch.messages if m.HasField("batch")]
    assert {b.pool_id for b in batches} == {"w2"}
    await driver.compare(watch.replica, only="w2")
    await watch.close()


async def test_watching_takes_the_service_or_the_admin_token(driver: Driver) -> None:
    for metadata in ([], [("authorization", "Bearer wrong")], [("authorization", "x")]):
        call = driver.kv.WatchEvents(pb.WatchEventsRequest(), metadata=metadata)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call.read()
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, info.value.details()
    for metadata in (SERVICE, ADMIN):
        call = driver.kv.WatchEvents(pb.WatchEventsRequest(), metadata=metadata)
        assert (await call.read()).HasField("reset")
        call.cancel()


async def test_without_a_service_token_only_the_admin_token_watches() -> None:
    async with service(service_token="") as driver:
        await driver.kv.Route(pb.RouteRequest(prompt_token_ids=[1]))  # the data plane is open
        call = driver.kv.WatchEvents(pb.WatchEventsRequest())
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call.read()
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        call = driver.kv.WatchEvents(pb.WatchEventsRequest(), metadata=ADMIN)
        assert (await call.read()).HasField("reset")
        call.cancel()


async def test_a_watcher_that_stops_reading_is_ended_and_memory_stays_bounded() -> None:
    async with service(events_buffer_mb=1) as driver:
        await driver.register("w1", num_blocks=40_000)
        call = driver.kv.WatchEvents(pb.WatchEventsRequest(), metadata=SERVICE)
        assert (await call.read()).HasField("reset")
        assert (await call.read()).HasField("batch")  # the snapshot: one empty pool
        assert (await call.read()).HasField("synced")
        log = driver.svc.authority.events
        # ~40 MB of events (64k-token prompts, each evicting the one before) while the
        # watcher reads nothing: far past gRPC's flow-control windows and the 1 MiB buffer.
        for k in range(120):
            await driver.request("w1", list(range(k * 60_000, (k + 1) * 60_000)), [])
            assert log.held_bytes <= (1 << 20) + (2 << 20)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            while True:
                await asyncio.wait_for(call.read(), 10)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "replay buffer" in (info.value.details() or "")
        assert log.watchers == 0


async def test_too_many_watchers() -> None:
    async with service(events_max_watchers=1) as driver:
        first = Watch(driver.kv)
        await first.until(driver.end())
        call = driver.kv.WatchEvents(pb.WatchEventsRequest(), metadata=SERVICE)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call.read()
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        await first.close()


async def test_recording_stops_after_the_last_watcher_leaves() -> None:
    async with service(events_retain_s=0.0) as driver:
        await driver.register("w1")
        watch = Watch(driver.kv)
        await watch.until(driver.end())
        cursor = watch.cursor
        assert driver.svc.authority.pools["w1"].index.listener is not None  # type: ignore[index]
        await watch.close()
        async with asyncio.timeout(5):
            while driver.svc.authority.events.recording:
                await asyncio.sleep(0.02)
        assert driver.svc.authority.pools["w1"].index.listener is None  # type: ignore[index]
        back = Watch(driver.kv, after=cursor)
        await back.until(driver.end())
        assert back.messages[0].reset.reason == pb.EventsReset.REASON_OTHER_LOG
        await back.close()


async def test_the_admin_cli_follows_the_events(
    driver: Driver, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvcache_service import admin_cli

    await driver.register("w1")
    await driver.request("w1", [1, 2, 3, 4, 5, 6, 7, 8, 9], [10])
    args = ["--address", driver.svc.address, "--token", ADMIN_TOKEN, "watch", "--ids"]
    assert await asyncio.to_thread(admin_cli.main, [*args, "--count", "3"]) == 0
    out = capsys.readouterr().out
    assert "reset (no_cursor)" in out and "synced at batch" in out
    assert "stored [0, 1] at the root, 8 tokens: [1, 2, 3, 4, 5, 6, 7, 8]" in out
    assert "stored [2] after 1, 2 tokens: [9, 10]" in out


async def test_tier_blocks_reach_a_watcher_by_key(driver: Driver) -> None:
    """A worker's tier reports (and the capacity evictions they cause) over the wire: the
    watcher holds what the tier index holds, by key and medium; a late watcher's snapshot
    too."""
    resp = await driver.kv.RegisterPool(
        pb.RegisterPoolRequest(
            pool_id="w1",
            num_blocks=8,
            block_size=BS,
            tiers=[pb.TierSpec(medium=pb.MEDIUM_DISK, capacity_blocks=4)],
        ),
        metadata=SERVICE,
    )
    pool = pb.PoolRef(pool_id="w1", incarnation=resp.incarnation)
    watch = Watch(driver.kv)
    await watch.until(driver.end())
    chain = [1000 + i for i in range(6)]  # a chain of 6 into a tier of 4: two go
    parents = [namespace_key("t"), *chain[:-1]]  # the first block's parent: its namespace's key
    stored = [
        pb.TierBlock(key=k, parent_key=p, namespace="t", medium=pb.MEDIUM_DISK)
        for k, p in zip(chain, parents, strict=True)
    ]
    await driver.kv.UpdateTiers(pb.UpdateTiersRequest(pool=pool, stored=stored), metadata=SERVICE)
    await watch.until(driver.end())
    held = set(driver.svc.authority.pools["w1"].tiers.keys(Medium.DISK))
    assert set(watch.replica.pools["w1"].tiers[pb.MEDIUM_DISK]) == held and len(held) == 4
    late = Watch(driver.kv)
    await late.until(driver.end())
    assert set(late.replica.pools["w1"].tiers[pb.MEDIUM_DISK]) == held
    for w in (watch, late):
        await w.close()
