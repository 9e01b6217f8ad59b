"""The data plane on an untrusted network: the service token, incarnation fencing, who may
re-register a live pool, and bounded registration."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from gateway.cache_client import CacheClient
from kvcache_service.authority import AuthorityConfig, CacheAuthority
from kvcache_service.config import ServiceConfig
from kvcache_service.errors import PoolInUse, RegistrationLimit, UnregisteredPool
from kvcache_service.ids import Namespace, PoolId
from kvcache_service.leases import AcquireRequest
from kvcache_service.pool import PoolSpec
from kvcache_service.server import RunningService, running
from kvcache_service.tokens import pack
from kvserve_proto.kvcache.v1 import kvcache_pb2 as pb
from kvserve_proto.kvcache.v1 import kvcache_pb2_grpc as pb_grpc
from worker.engine.lease import CacheUnavailable, PoolRegistration
from worker.lease_client import LeaseClient

SERVICE_TOKEN = "test-service-token"
AUTH = [("authorization", f"Bearer {SERVICE_TOKEN}")]
BS = 4


def registration(pool_id: str = "w1", num_blocks: int = 32, **kw) -> pb.RegisterPoolRequest:
    return pb.RegisterPoolRequest(
        pool_id=pool_id, num_blocks=num_blocks, block_size=BS, model="tiny", **kw
    )


@pytest.fixture
async def svc() -> AsyncIterator[RunningService]:
    config = ServiceConfig(
        port=0, admin_token="admin", service_token=SERVICE_TOKEN, max_pool_blocks=1000, max_pools=2
    )
    async with running(config) as s:
        yield s


@pytest.fixture
async def kv(svc: RunningService) -> AsyncIterator[pb_grpc.KVCacheServiceStub]:
    async with grpc.aio.insecure_channel(svc.address) as channel:
        yield pb_grpc.KVCacheServiceStub(channel)


async def expect_code(code: grpc.StatusCode, call) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.code() == code, info.value.details()
    return info.value.details() or ""


async def test_every_data_plane_call_needs_the_service_token(
    kv: pb_grpc.KVCacheServiceStub,
) -> None:
    reg = await kv.RegisterPool(registration(), metadata=AUTH)
    ref = pb.PoolRef(pool_id="w1", incarnation=reg.incarnation)
    calls = {
        "RegisterPool": lambda md: kv.RegisterPool(registration("w2"), metadata=md),
        "Heartbeat": lambda md: kv.Heartbeat(pb.HeartbeatRequest(pool=ref), metadata=md),
        "AcquireLease": lambda md: kv.AcquireLease(
            pb.AcquireLeaseRequest(pool=ref, prompt_token_ids=[1, 2, 3]), metadata=md
        ),
        "ExtendLeases": lambda md: kv.ExtendLeases(
            pb.ExtendLeasesRequest(pool=ref, items=[pb.ExtendItem(lease_id=1, num_tokens=4)]),
            metadata=md,
        ),
        "CommitLeases": lambda md: kv.CommitLeases(
            pb.CommitLeasesRequest(pool=ref, items=[pb.CommitItem(lease_id=1, token_ids=[1])]),
            metadata=md,
        ),
        "ReleaseLease": lambda md: kv.ReleaseLease(
            pb.ReleaseLeaseRequest(pool=ref, lease_id=1), metadata=md
        ),
        "Route": lambda md: kv.Route(pb.RouteRequest(prompt_token_ids=[1, 2, 3]), metadata=md),
        "UpdateTiers": lambda md: kv.UpdateTiers(
            pb.UpdateTiersRequest(pool=ref, dropped=[pb.TierBlock(key=1, medium=pb.MEDIUM_DISK)]),
            metadata=md,
        ),
    }
    wrong = [("authorization", "Bearer nope")]
    for call in calls.values():
        for md, says in (
            (None, "none was sent"),
            (wrong, "not this service's"),
            ([("authorization", SERVICE_TOKEN)], "not a Bearer token"),
        ):
            details = await expect_code(grpc.StatusCode.UNAUTHENTICATED, call(md))
            assert says in details and SERVICE_TOKEN not in details, details
    # Nothing got through: w2 was never registered, and the right token still works.
    routes = await kv.Route(pb.RouteRequest(prompt_token_ids=[1, 2, 3]), metadata=AUTH)
    assert [p.pool_id for p in routes.pools] == ["w1"]
    await kv.Heartbeat(pb.HeartbeatRequest(pool=ref), metadata=AUTH)


async def test_the_clients_send_the_token(svc: RunningService) -> None:
    reg = PoolRegistration("w1", 32, BS, "tiny", "fp", "w1:1", 2, 2, 8, "float32")
    anonymous = LeaseClient(svc.address)
    with pytest.raises(CacheUnavailable, match="UNAUTHENTICATED"):
        await anonymous.register(reg)
    await anonymous.close()
    client = LeaseClient(svc.address, SERVICE_TOKEN)
    assert await client.register(reg) > 0
    assert await client.heartbeat() == []
    await client.close()
    gateway = CacheClient(svc.address, SERVICE_TOKEN)
    assert [r.pool_id for r in await gateway.route("", [1, 2, 3], "tiny")] == ["w1"]
    await gateway.channel.close()


async def test_a_made_up_incarnation_learns_nothing(kv: pb_grpc.KVCacheServiceStub) -> None:
    inc = (await kv.RegisterPool(registration(), metadata=AUTH)).incarnation
    for guess in (0, 1, inc - 1, inc + 1):
        ref = pb.PoolRef(pool_id="w1", incarnation=guess)
        details = await expect_code(
            grpc.StatusCode.FAILED_PRECONDITION,
            kv.Heartbeat(pb.HeartbeatRequest(pool=ref), metadata=AUTH),
        )
        assert str(inc) not in details and "register again" in details
        details = await expect_code(
            grpc.StatusCode.FAILED_PRECONDITION,
            kv.AcquireLease(
                pb.AcquireLeaseRequest(pool=ref, prompt_token_ids=[1, 2, 3]), metadata=AUTH
            ),
        )
        assert str(inc) not in details


async def test_a_live_pool_is_not_wiped_by_another_registrant(
    kv: pb_grpc.KVCacheServiceStub,
) -> None:
    inc = (await kv.RegisterPool(registration(), metadata=AUTH)).incarnation
    ref = pb.PoolRef(pool_id="w1", incarnation=inc)
    prompt = list(range(1, 10))
    lease = (
        await kv.AcquireLease(
            pb.AcquireLeaseRequest(pool=ref, prompt_token_ids=prompt), metadata=AUTH
        )
    ).lease
    await kv.ReleaseLease(
        pb.ReleaseLeaseRequest(pool=ref, lease_id=lease.lease_id, token_ids=prompt), metadata=AUTH
    )
    for presented in (0, inc + 1):
        await expect_code(
            grpc.StatusCode.FAILED_PRECONDITION,
            kv.RegisterPool(registration(incarnation=presented), metadata=AUTH),
        )
    # The pool, its incarnation and its index are intact.
    again = await kv.AcquireLease(
        pb.AcquireLeaseRequest(pool=ref, prompt_token_ids=prompt), metadata=AUTH
    )
    assert again.lease.cached_tokens == 8
    await kv.ReleaseLease(
        pb.ReleaseLeaseRequest(pool=ref, lease_id=again.lease.lease_id), metadata=AUTH
    )
    # The pool itself (holding its incarnation) may register again: its recovery path.
    new = await kv.RegisterPool(registration(incarnation=inc), metadata=AUTH)
    assert new.incarnation != inc


async def test_registration_is_bounded(kv: pb_grpc.KVCacheServiceStub) -> None:
    await expect_code(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        kv.RegisterPool(registration(num_blocks=1001), metadata=AUTH),
    )
    await expect_code(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        kv.RegisterPool(registration(num_blocks=1 << 24), metadata=AUTH),
    )
    await kv.RegisterPool(registration("w1", num_blocks=1000), metadata=AUTH)
    await kv.RegisterPool(registration("w2"), metadata=AUTH)
    await expect_code(
        grpc.StatusCode.RESOURCE_EXHAUSTED, kv.RegisterPool(registration("w3"), metadata=AUTH)
    )


def test_a_dead_pool_is_forgotten_after_its_grace() -> None:
    now = [1000.0]
    auth = CacheAuthority(
        AuthorityConfig(lease_ttl_s=10.0, max_pools=1, forget_after_ttls=4), clock=lambda: now[0]
    )
    spec = PoolSpec(PoolId("w1"), num_blocks=8, block_size=BS)
    inc = auth.register_pool(spec).incarnation
    auth.acquire(AcquireRequest(PoolId("w1"), inc, Namespace(""), pack([1, 2, 3], "p")))
    other = PoolSpec(PoolId("w2"), num_blocks=8, block_size=BS)
    with pytest.raises(RegistrationLimit):
        auth.register_pool(other)
    with pytest.raises(PoolInUse):
        auth.register_pool(spec)  # live: only its own incarnation may re-register
    now[0] += 11  # one TTL of silence: dead, leases expired, still known
    assert auth.expire_due() == 1
    assert "w1" in auth.pools and not auth.is_alive(PoolId("w1"))
    now[0] += 25  # 3.6 TTLs
    auth.expire_due()
    assert "w1" in auth.pools
    now[0] += 5  # past 4 TTLs of silence: forgotten
    auth.expire_due()
    assert "w1" not in auth.pools
    with pytest.raises(UnregisteredPool):
        auth.heartbeat(PoolId("w1"), inc)
    auth.register_pool(other)  # its slot is free again
    assert auth.check_integrity() == []


def test_a_lapsed_pool_may_be_registered_by_anyone() -> None:
    now = [0.0]
    auth = CacheAuthority(AuthorityConfig(lease_ttl_s=10.0), clock=lambda: now[0])
    spec = PoolSpec(PoolId("w1"), num_blocks=8, block_size=BS)
    inc = auth.register_pool(spec).incarnation
    now[0] += 11
    assert auth.register_pool(spec).incarnation != inc  # a restarted worker, after one TTL


async def test_a_restarted_worker_takes_its_live_pool_back_at_once(svc: RunningService, tmp_path):
    """A worker that died (its claim's lock dropped by the kernel, modelled here by closing
    the claim) is restarted within its pool's TTL: the restart presents the incarnation its
    last run recorded and re-registers at once, where it waited out the TTL (30 s). A second
    live worker with the same pool id finds the claim held, presents nothing, and is refused
    as before; the pool's own worker is not disturbed."""
    from worker.engine.lease import LeaseError
    from worker.pool_claim import PoolClaim

    reg = PoolRegistration("w1", 32, BS, "tiny", "fp", "w1:1", 2, 2, 8, "float32")
    first = LeaseClient(svc.address, SERVICE_TOKEN, claim=PoolClaim(svc.address, "w1", tmp_path))
    inc = await first.register(reg)
    assert await first.heartbeat() == []  # live

    twin = LeaseClient(svc.address, SERVICE_TOKEN, claim=PoolClaim(svc.address, "w1", tmp_path))
    with pytest.raises(LeaseError, match="live"):
        await twin.register(reg)
    await twin.close()
    assert await first.heartbeat() == []  # the live pool kept its incarnation

    await first.close()  # the process died: its lock is gone, its heartbeats not lapsed yet
    restarted = LeaseClient(
        svc.address, SERVICE_TOKEN, claim=PoolClaim(svc.address, "w1", tmp_path)
    )
    new = await restarted.register(reg)
    assert new != inc and await restarted.heartbeat() == []
    # Another pool id, or another cache service, is another claim.
    other = PoolClaim(svc.address, "w2", tmp_path)
    elsewhere = PoolClaim("10.0.0.9:50051", "w1", tmp_path)
    assert other.held and elsewhere.held and other.incarnation() == elsewhere.incarnation() == 0
    for c in (other, elsewhere):
        c.close()
    await restarted.close()
