"""The cache service over real gRPC: an in-process grpc.aio server on 127.0.0.1:0."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvcache_service import admin_cli
from kvcache_service.config import ServiceConfig
from kvcache_service.server import RunningService, running
from kvserve_proto.kvcache.v1 import kvcache_pb2 as pb
from kvserve_proto.kvcache.v1 import kvcache_pb2_grpc as pb_grpc

TOKEN = "test-admin-token"
AUTH = [("authorization", f"Bearer {TOKEN}")]
BS = 4


class Client:
    def __init__(self, svc: RunningService, channel: grpc.aio.Channel) -> None:
        self.svc = svc
        self.channel = channel
        self.kv = pb_grpc.KVCacheServiceStub(channel)
        self.admin = pb_grpc.KVCacheAdminStub(channel)

    async def register(self, pool_id: str = "w1", num_blocks: int = 32, **kw) -> pb.PoolRef:
        resp = await self.kv.RegisterPool(
            pb.RegisterPoolRequest(
                pool_id=pool_id,
                num_blocks=num_blocks,
                block_size=kw.pop("block_size", BS),
                model_fingerprint="fp",
                model="tiny",
                worker_address=f"{pool_id}:1",
                layout=pb.PoolLayout(
                    num_layers=2,
                    num_kv_heads=2,
                    head_dim=8,
                    dtype="float32",
                    bytes_per_block=kw.pop("bytes_per_block", 2 * 2 * 2 * 8 * 4 * BS),
                ),
                **kw,
            )
        )
        return pb.PoolRef(pool_id=pool_id, incarnation=resp.incarnation)

    async def acquire(self, pool: pb.PoolRef, prompt: list[int], **kw) -> pb.AcquireLeaseResponse:
        return await self.kv.AcquireLease(
            pb.AcquireLeaseRequest(pool=pool, prompt_token_ids=prompt, **kw)
        )

    async def check(self) -> None:
        resp = await self.admin.CheckIntegrity(pb.CheckIntegrityRequest(), metadata=AUTH)
        assert resp.ok, list(resp.problems)


@pytest.fixture
async def client() -> AsyncIterator[Client]:
    config = ServiceConfig(
        host="127.0.0.1", port=0, admin_token=TOKEN, lease_ttl_s=30, sweep_interval_s=0.05
    )
    async with running(config) as svc, grpc.aio.insecure_channel(svc.address) as channel:
        c = Client(svc, channel)
        yield c
        await c.check()  # every test ends with the accounting intact


async def expect_code(code: grpc.StatusCode, call) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.code() == code, info.value.details()
    return info.value.details() or ""


async def test_lease_lifecycle(client: Client) -> None:
    pool = await client.register()
    prompt = list(range(1, 11))  # 10 tokens: 2 full blocks and 2 tokens
    first = (await client.acquire(pool, prompt, reserve_tokens=6)).lease
    assert first.cached_tokens == 0 and len(first.block_table) == 4  # ceil(16 / 4)
    committed = await client.kv.CommitLeases(
        pb.CommitLeasesRequest(
            pool=pool, items=[pb.CommitItem(lease_id=first.lease_id, token_ids=prompt)]
        )
    )
    assert list(committed.indexed_tokens) == [8]
    await client.check()

    # A second request sharing the two committed blocks reads them, no copy, no recompute.
    second = (await client.acquire(pool, [*prompt[:8], 42, 43])).lease
    assert second.cached_tokens == 8
    assert list(second.block_table[:2]) == list(first.block_table[:2])
    assert second.block_table[2] not in first.block_table

    ext = await client.kv.ExtendLeases(
        pb.ExtendLeasesRequest(
            pool=pool,
            items=[
                pb.ExtendItem(lease_id=first.lease_id, num_tokens=24),
                pb.ExtendItem(lease_id=second.lease_id, num_tokens=12),
            ],
        )
    )
    assert [len(e.new_blocks) for e in ext.leases] == [2, 0]
    await client.check()

    final = prompt + [11, 12, 13, 14, 15, 16]
    rel = await client.kv.ReleaseLease(
        pb.ReleaseLeaseRequest(pool=pool, lease_id=first.lease_id, token_ids=final)
    )
    assert rel.indexed_tokens == 16
    await client.kv.ReleaseLease(pb.ReleaseLeaseRequest(pool=pool, lease_id=second.lease_id))
    stats = (await client.admin.GetStats(pb.StatsRequest(), metadata=AUTH)).pools[0]
    assert (stats.referenced_blocks, stats.live_leases, stats.cached_blocks) == (0, 0, 4)
    assert stats.free_blocks == 28 and stats.acquires == 2 and stats.cached_tokens == 8
    assert stats.token_hit_rate == pytest.approx(8 / 20)

    # A multi-turn follow-up reuses the whole committed history.
    third = (await client.acquire(pool, [*final, 99])).lease
    assert third.cached_tokens == 16


async def test_unaligned_prefix_is_copied_on_write(client: Client) -> None:
    pool = await client.register()
    prompt = list(range(1, 9))
    first = (await client.acquire(pool, prompt)).lease
    await client.kv.ReleaseLease(
        pb.ReleaseLeaseRequest(pool=pool, lease_id=first.lease_id, token_ids=prompt)
    )
    # Shares 6 tokens: one full block plus half of the second, which is copied on write.
    second = (await client.acquire(pool, [1, 2, 3, 4, 5, 6, 70, 71])).lease
    assert second.cached_tokens == 6
    (cow,) = second.copy_on_write
    assert cow.src_block == first.block_table[1] and cow.dst_block == second.block_table[1]
    # A fully cached prompt still computes its last token: its last block is copied too.
    third = (await client.acquire(pool, prompt)).lease
    assert third.cached_tokens == 7 and len(third.copy_on_write) == 1


async def test_burst_defers_to_the_lease_filling_the_prefix(client: Client) -> None:
    pool = await client.register()
    prompt = list(range(1, 14))
    first = (await client.acquire(pool, prompt, allow_defer=True)).lease
    resp = await client.acquire(pool, [*prompt, 50], allow_defer=True)
    assert resp.WhichOneof("result") == "deferred"
    assert resp.deferred.waiting_on_lease_id == first.lease_id
    assert resp.deferred.pending_tokens == 12
    await client.kv.CommitLeases(
        pb.CommitLeasesRequest(
            pool=pool, items=[pb.CommitItem(lease_id=first.lease_id, token_ids=prompt)]
        )
    )
    retry = await client.acquire(pool, [*prompt, 50], allow_defer=True)
    assert retry.lease.cached_tokens == 12
    await client.kv.ReleaseLease(pb.ReleaseLeaseRequest(pool=pool, lease_id=first.lease_id))
    await client.kv.ReleaseLease(pb.ReleaseLeaseRequest(pool=pool, lease_id=retry.lease.lease_id))


async def test_a_dead_lease_ends_the_wait(client: Client) -> None:
    pool = await client.register()
    prompt = list(range(1, 14))
    first = (await client.acquire(pool, prompt)).lease
    assert (await client.acquire(pool, prompt, allow_defer=True)).HasField("deferred")
    await client.kv.ReleaseLease(pb.ReleaseLeaseRequest(pool=pool, lease_id=first.lease_id))
    assert (await client.acquire(pool, prompt, allow_defer=True)).HasField("lease")


async def test_error_codes(client: Client) -> None:
    pool = await client.register(num_blocks=8)
    code = grpc.StatusCode
    await expect_code(code.INVALID_ARGUMENT, client.acquire(pool, [1, -2, 3]))
    await expect_code(code.INVALID_ARGUMENT, client.acquire(pool, []))
    # A pool the service does not know (it restarted): register again, a code, not a message.
    ghost = pb.PoolRef(pool_id="nope", incarnation=pool.incarnation)
    await expect_code(code.FAILED_PRECONDITION, client.acquire(ghost, [1]))
    await expect_code(
        code.FAILED_PRECONDITION, client.kv.Heartbeat(pb.HeartbeatRequest(pool=ghost))
    )
    # An admin call naming an unknown pool: its target is not there.
    await expect_code(
        code.NOT_FOUND, client.admin.GetStats(pb.StatsRequest(pool_id="nope"), metadata=AUTH)
    )
    await expect_code(code.INVALID_ARGUMENT, client.register("bad", num_blocks=0))
    await expect_code(code.INVALID_ARGUMENT, client.register("bad", block_size=0))
    release = pb.ReleaseLeaseRequest(pool=pool, lease_id=12345)
    await expect_code(code.NOT_FOUND, client.kv.ReleaseLease(release))
    # 8 blocks of 4 tokens can never hold 40 tokens: refused, not queued.
    await expect_code(code.OUT_OF_RANGE, client.acquire(pool, list(range(40))))
    lease = (await client.acquire(pool, [1, 2, 3])).lease
    # 32 tokens fit the pool, but not beside that lease: queue and retry, not a failure.
    await expect_code(code.RESOURCE_EXHAUSTED, client.acquire(pool, list(range(100, 132))))
    too_many = pb.ExtendLeasesRequest(
        pool=pool, items=[pb.ExtendItem(lease_id=lease.lease_id, num_tokens=400)]
    )
    await expect_code(code.RESOURCE_EXHAUSTED, client.kv.ExtendLeases(too_many))
    wrong = pb.CommitLeasesRequest(
        pool=pool, items=[pb.CommitItem(lease_id=lease.lease_id, token_ids=[9, 9, 9])]
    )
    await expect_code(code.INVALID_ARGUMENT, client.kv.CommitLeases(wrong))
    # Registering again (the live pool itself, with its incarnation) fences the old
    # incarnation off; its leases are gone.
    new_pool = await client.register(num_blocks=8, incarnation=pool.incarnation)
    assert new_pool.incarnation > pool.incarnation
    await expect_code(code.FAILED_PRECONDITION, client.acquire(pool, [1, 2]))
    await expect_code(code.FAILED_PRECONDITION, client.kv.Heartbeat(pb.HeartbeatRequest(pool=pool)))
    stats = (await client.admin.GetStats(pb.StatsRequest(pool_id="w1"), metadata=AUTH)).pools[0]
    assert stats.free_blocks == 8 and stats.live_leases == 0
    # The service is still serving.
    assert (await client.acquire(new_pool, [1, 2])).HasField("lease")


async def test_block_size_mismatch() -> None:
    config = ServiceConfig(port=0, admin_token=TOKEN, block_size=16)
    async with running(config) as svc, grpc.aio.insecure_channel(svc.address) as channel:
        c = Client(svc, channel)
        details = await expect_code(grpc.StatusCode.INVALID_ARGUMENT, c.register(block_size=32))
        assert "block_size mismatch" in details
        await c.register(block_size=16)


async def test_admin_needs_the_token(client: Client) -> None:
    """Missing, not a bearer token, and wrong each say so (an operator fixes each one
    differently); none says what the token is."""
    req = pb.StatsRequest()
    missing = await expect_code(grpc.StatusCode.UNAUTHENTICATED, client.admin.GetStats(req))
    assert "none was sent" in missing
    bad = [("authorization", "Bearer wrong")]
    wrong = await expect_code(
        grpc.StatusCode.UNAUTHENTICATED, client.admin.GetStats(req, metadata=bad)
    )
    assert "not this service's" in wrong and TOKEN not in wrong
    basic = [("authorization", f"Basic {TOKEN}")]
    scheme = await expect_code(
        grpc.StatusCode.UNAUTHENTICATED, client.admin.GetStats(req, metadata=basic)
    )
    assert "not a Bearer token" in scheme
    await expect_code(
        grpc.StatusCode.UNAUTHENTICATED, client.admin.Flush(pb.FlushRequest(), metadata=bad)
    )
    assert (await client.admin.GetStats(req, metadata=AUTH)).pools == []


async def test_leases_of_a_silent_pool_expire() -> None:
    config = ServiceConfig(port=0, admin_token=TOKEN, lease_ttl_s=0.3, sweep_interval_s=0.05)
    async with running(config) as svc, grpc.aio.insecure_channel(svc.address) as channel:
        c = Client(svc, channel)
        pool = await c.register(num_blocks=8)
        lease = (await c.acquire(pool, [1, 2, 3, 4, 5])).lease
        await asyncio.sleep(0.6)  # no heartbeat: the sweep expires the lease
        stats = (await c.admin.GetStats(pb.StatsRequest(), metadata=AUTH)).pools[0]
        assert (stats.alive, stats.live_leases, stats.free_blocks) == (False, 0, 8)
        beat = await c.kv.Heartbeat(pb.HeartbeatRequest(pool=pool))
        assert list(beat.expired_lease_ids) == [lease.lease_id]
        release = pb.ReleaseLeaseRequest(pool=pool, lease_id=lease.lease_id)
        await expect_code(grpc.StatusCode.NOT_FOUND, c.kv.ReleaseLease(release))
        await c.check()


async def test_route_reports_each_pool(client: Client) -> None:
    a = await client.register("a")
    b = await client.register("b")
    prompt = list(range(1, 13))
    lease = (await client.acquire(b, prompt)).lease
    await client.kv.ReleaseLease(
        pb.ReleaseLeaseRequest(pool=b, lease_id=lease.lease_id, token_ids=prompt)
    )
    routes = await client.kv.Route(pb.RouteRequest(prompt_token_ids=[*prompt, 1]))
    by_pool = {r.pool_id: r for r in routes.pools}
    assert by_pool["a"].cached_tokens == 0 and by_pool["b"].cached_tokens == 12
    assert by_pool["b"].worker_address == "b:1" and by_pool["b"].alive
    other_ns = await client.kv.Route(pb.RouteRequest(namespace="t2", prompt_token_ids=prompt))
    assert all(r.cached_tokens == 0 for r in other_ns.pools)  # no match across namespaces
    assert (await client.kv.Route(pb.RouteRequest(prompt_token_ids=[1], model="x"))).pools == []
    del a


async def test_admin_operations(client: Client) -> None:
    pool = await client.register()
    prompts = [list(range(1, 13)), [*range(1, 9), 50, 51, 52, 53], [7] * 8]
    for ns, prompt in [("", prompts[0]), ("", prompts[1]), ("t2", prompts[2])]:
        lease = (await client.acquire(pool, prompt, namespace=ns)).lease
        await client.kv.ReleaseLease(
            pb.ReleaseLeaseRequest(pool=pool, lease_id=lease.lease_id, token_ids=prompt)
        )
    tree = await client.admin.InspectTree(pb.InspectTreeRequest(pool_id="w1"), metadata=AUTH)
    # Two prompts sharing 2 blocks: the shared node was split, under it two 1-block leaves.
    shapes = sorted((n.namespace, n.depth, n.num_tokens) for n in tree.nodes)
    assert shapes == [("", 1, 8), ("", 2, 4), ("", 2, 4), ("t2", 1, 8)]
    assert not tree.truncated

    look = await client.admin.Lookup(
        pb.LookupRequest(prompt_token_ids=[*range(1, 11), 99]), metadata=AUTH
    )
    assert look.pools[0].cached_tokens == 10 and len(look.pools[0].matched_blocks) == 2

    pin = pb.PinRequest(pool_id="w1", prefix=pb.PrefixRef(token_ids=prompts[0]))
    assert (await client.admin.Pin(pin, metadata=AUTH)).blocks == 3
    flushed = await client.admin.Flush(pb.FlushRequest(), metadata=AUTH)
    assert flushed.evicted_blocks == 3  # prompt 1's own leaf and t2's two blocks
    assert (await client.admin.Unpin(pin, metadata=AUTH)).blocks == 3
    await expect_code(grpc.StatusCode.NOT_FOUND, client.admin.Unpin(pin, metadata=AUTH))
    evict = pb.EvictRequest(pool_id="w1", prefix=pb.PrefixRef(token_ids=prompts[0][:10]))
    assert (await client.admin.Evict(evict, metadata=AUTH)).evicted_blocks == 1
    evict_n = pb.EvictRequest(pool_id="w1", num_blocks=10)
    assert (await client.admin.Evict(evict_n, metadata=AUTH)).evicted_blocks == 2
    stats = (await client.admin.GetStats(pb.StatsRequest(), metadata=AUTH)).pools[0]
    assert stats.free_blocks == 32 and stats.evicted_blocks == 6
    await expect_code(
        grpc.StatusCode.NOT_FOUND,
        client.admin.InspectTree(pb.InspectTreeRequest(pool_id="nope"), metadata=AUTH),
    )


async def test_health_and_reflection(client: Client) -> None:
    health = health_pb2_grpc.HealthStub(client.channel)
    for service in ("", "kvcache.v1.KVCacheService", "kvcache.v1.KVCacheAdmin"):
        resp = await health.Check(health_pb2.HealthCheckRequest(service=service))
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    stub = reflection_pb2_grpc.ServerReflectionStub(client.channel)
    call = stub.ServerReflectionInfo()
    await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
    resp = await call.read()
    await call.done_writing()
    names = {s.name for s in resp.list_services_response.service}
    assert {"kvcache.v1.KVCacheService", "kvcache.v1.KVCacheAdmin"} <= names


async def test_admin_cli(client: Client, capsys: pytest.CaptureFixture[str]) -> None:
    pool = await client.register()
    lease = (await client.acquire(pool, list(range(1, 10)))).lease
    args = ["--address", client.svc.address, "--token", TOKEN]
    assert await asyncio.to_thread(admin_cli.main, [*args, "stats"]) == 0
    out = capsys.readouterr().out
    assert "referenced" in out and "w1" in out
    stats = (await client.admin.GetStats(pb.StatsRequest(), metadata=AUTH)).pools[0]
    assert stats.bytes_per_block == 2 * 2 * 2 * 8 * 4 * BS  # what the worker registered
    assert f"{32 * stats.bytes_per_block / 2**20:.0f} MiB" in out
    assert await asyncio.to_thread(admin_cli.main, [*args, "lookup", "1,2,3,4,5"]) == 0
    assert "cached tokens" in capsys.readouterr().out
    assert await asyncio.to_thread(admin_cli.main, [*args, "check"]) == 0
    assert "ok: 1 pools checked" in capsys.readouterr().out
    bad = ["--address", client.svc.address, "--token", "nope", "flush"]
    assert await asyncio.to_thread(admin_cli.main, bad) == 1
    err = capsys.readouterr().err
    assert "UNAUTHENTICATED" in err and "not this service's" in err
    none = ["--address", client.svc.address, "--token", "", "flush"]
    assert await asyncio.to_thread(admin_cli.main, none) == 1
    assert "no admin token" in capsys.readouterr().err  # said before any call
    await client.kv.ReleaseLease(
        pb.ReleaseLeaseRequest(pool=pool, lease_id=lease.lease_id, token_ids=list(range(1, 10)))
    )
    assert await asyncio.to_thread(admin_cli.main, [*args, "tree", "--pool", "w1"]) == 0
    assert "8 tokens" in capsys.readouterr().out


# -- wire revision 2: packed token ids, sequence updates, batched acquire and release ----------


def wire(ids: list[int]) -> bytes:
    return b"".join(i.to_bytes(4, "little") for i in ids)


def update(written: int, appended: list[int] = (), start: int = 0) -> pb.SequenceUpdate:  # type: ignore[assignment]
    return pb.SequenceUpdate(
        written_tokens=written, appended_tokens=wire(list(appended)), appended_from=start
    )


async def test_a_batch_of_acquires_and_releases_in_the_compact_form(client: Client) -> None:
    reg = await client.kv.RegisterPool(
        pb.RegisterPoolRequest(pool_id="w1", num_blocks=32, block_size=BS, model="tiny")
    )
    assert reg.wire_revision == 2
    pool = pb.PoolRef(pool_id="w1", incarnation=reg.incarnation)
    prompt = list(range(1, 11))  # 2 full blocks and 2 tokens
    resp = await client.kv.AcquireLeases(
        pb.AcquireLeasesRequest(
            pool=pool,
            items=[
                pb.AcquireItem(prompt_tokens=wire(prompt), reserve_tokens=6, allow_defer=True),
                # Same prefix, still being filled by the first item's lease: deferred.
                pb.AcquireItem(prompt_tokens=wire([*prompt, 77]), allow_defer=True),
                pb.AcquireItem(prompt_tokens=wire(prompt)[:-1]),  # not whole 4-byte ids
                pb.AcquireItem(prompt_token_ids=[500, 501], prompt_tokens=wire([500])),  # both
                pb.AcquireItem(prompt_token_ids=[500, 501, 502]),  # the readable form
            ],
        )
    )
    first, deferred, torn, both, other = resp.results
    assert first.lease.cached_tokens == 0 and len(first.lease.block_table) == 4
    assert deferred.deferred.waiting_on_lease_id == first.lease.lease_id
    assert torn.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "whole number" in torn.error.message
    assert both.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert other.lease.lease_id > first.lease.lease_id
    await client.check()

    # The prompt's blocks are committed without sending a token of them.
    commit = pb.CommitItem(lease_id=first.lease.lease_id, update=update(8))
    indexed = await client.kv.CommitLeases(pb.CommitLeasesRequest(pool=pool, items=[commit]))
    assert list(indexed.indexed_tokens) == [8]

    generated = [11, 12, 13, 14, 15, 16]
    released = await client.kv.ReleaseLeases(
        pb.ReleaseLeasesRequest(
            pool=pool,
            items=[
                # Only the generated tokens travel.
                pb.ReleaseItem(lease_id=first.lease.lease_id, update=update(16, generated, 10)),
                pb.ReleaseItem(lease_id=12345),  # unknown
                pb.ReleaseItem(lease_id=other.lease.lease_id),  # nothing to commit
            ],
        )
    )
    done, unknown, aborted = released.results
    assert done.indexed_tokens == 16 and not done.HasField("error")
    assert unknown.error.code == grpc.StatusCode.NOT_FOUND.value[0]
    assert aborted.indexed_tokens == 0 and not aborted.HasField("error")
    stats = (await client.admin.GetStats(pb.StatsRequest(), metadata=AUTH)).pools[0]
    assert (stats.live_leases, stats.referenced_blocks, stats.cached_blocks) == (0, 0, 4)

    # A follow-up reuses the whole history, generated tokens included.
    again = await client.kv.AcquireLease(
        pb.AcquireLeaseRequest(pool=pool, prompt_tokens=wire([*prompt, *generated, 99]))
    )
    assert again.lease.cached_tokens == 16


async def test_the_first_item_without_room_ends_the_batch(client: Client) -> None:
    """An item with no room now ends the batch (the worker's order stands); one that could
    never fit is refused and the batch goes on."""
    pool = await client.register(num_blocks=8)
    resp = await client.kv.AcquireLeases(
        pb.AcquireLeasesRequest(
            pool=pool,
            items=[
                pb.AcquireItem(prompt_tokens=wire([1, 2, 3])),
                pb.AcquireItem(prompt_tokens=wire(list(range(100, 140)))),  # 10 blocks of 4
                pb.AcquireItem(prompt_tokens=wire(list(range(32)))),  # 8: not beside the first
                pb.AcquireItem(prompt_tokens=wire([4, 5])),  # would fit: not tried
            ],
        )
    )
    fits, never, too_big, behind = resp.results
    exhausted = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert fits.HasField("lease")
    assert never.error.code == grpc.StatusCode.OUT_OF_RANGE.value[0]
    assert "can give at most 8 of its 8" in never.error.message
    assert too_big.error.code == exhausted and behind.error.code == exhausted
    assert "not tried" in behind.error.message
    stats = (await client.admin.GetStats(pb.StatsRequest(), metadata=AUTH)).pools[0]
    assert stats.live_leases == 1
    await client.kv.ReleaseLeases(
        pb.ReleaseLeasesRequest(pool=pool, items=[pb.ReleaseItem(lease_id=fits.lease.lease_id)])
    )


async def test_a_refused_release_keeps_its_lease_until_released_again(client: Client) -> None:
    pool = await client.register()
    lease = (await client.acquire(pool, [1, 2, 3, 4, 5])).lease
    gap = pb.ReleaseItem(lease_id=lease.lease_id, update=update(9, [6, 7], 7))  # 5 known
    (refused,) = (
        await client.kv.ReleaseLeases(pb.ReleaseLeasesRequest(pool=pool, items=[gap]))
    ).results
    assert refused.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    stats = (await client.admin.GetStats(pb.StatsRequest(), metadata=AUTH)).pools[0]
    assert stats.live_leases == 1
    await client.check()
    plain = pb.ReleaseItem(lease_id=lease.lease_id, update=update(0))
    (ok,) = (
        await client.kv.ReleaseLeases(pb.ReleaseLeasesRequest(pool=pool, items=[plain]))
    ).results
    assert not ok.HasField("error")
    # The call-level checks still come first: a fenced pool is the call's status.
    ghost = pb.PoolRef(pool_id="nope", incarnation=1)
    await expect_code(
        grpc.StatusCode.FAILED_PRECONDITION,
        client.kv.AcquireLeases(pb.AcquireLeasesRequest(pool=ghost, items=[pb.AcquireItem()])),
    )
    too_many = [pb.ReleaseItem(lease_id=1)] * 1025
    await expect_code(
        grpc.StatusCode.INVALID_ARGUMENT,
        client.kv.ReleaseLeases(pb.ReleaseLeasesRequest(pool=pool, items=too_many)),
    )
