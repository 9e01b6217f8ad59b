"""Tiers over real gRPC (the in-process server of test_servicer.py): a registration's tiers,
UpdateTiers and the evictions it answers, a tier flush told in the next Heartbeat, a lease's
tier_blocks, Route's and Lookup's tier_tokens, the stats and the refusals."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvcache_service import admin_cli
from kvserve_proto.block_keys import block_keys, namespace_key
from kvserve_proto.kvcache.v1 import kvcache_pb2 as pb
from tests.kvcache.test_servicer import AUTH, BS, TOKEN, Client, expect_code
from tests.kvcache.test_servicer import client as client  # the fixture

PROMPT = list(range(1, 22))  # 5 full blocks and one token
DISK, HOST = pb.MEDIUM_DISK, pb.MEDIUM_HOST


def keys(prompt: list[int], ns: str = "") -> list[int]:
    packed = b"".join(t.to_bytes(4, "little") for t in prompt)
    return block_keys(namespace_key(ns), packed, 0, BS * 4)


def spilled(prompt: list[int], medium: int = DISK, ns: str = "") -> list[pb.TierBlock]:
    """Every full block of ``prompt``, as a worker reports it stored in ``medium``."""
    ks = keys(prompt, ns)
    parents = [namespace_key(ns), *ks[:-1]]
    return [
        pb.TierBlock(key=k, parent_key=p, namespace=ns, medium=medium)
        for k, p in zip(ks, parents, strict=True)
    ]


def evicted(resp: pb.UpdateTiersResponse | pb.HeartbeatResponse) -> list[tuple[int, int]]:
    blocks = resp.evict if isinstance(resp, pb.UpdateTiersResponse) else resp.tier_evict
    return [(b.key, b.medium) for b in blocks]


async def stats(client: Client, pool_id: str = "w1") -> pb.PoolStats:
    return (await client.admin.GetStats(pb.StatsRequest(pool_id=pool_id), metadata=AUTH)).pools[0]


async def test_a_tier_over_grpc(client: Client) -> None:
    pool = await client.register(tiers=[pb.TierSpec(medium=DISK, capacity_blocks=3)])
    ks = keys(PROMPT)
    # The worker's manifest: a chain of 5 in a tier of 3; the two deepest go (leaves first).
    resp = await client.kv.UpdateTiers(pb.UpdateTiersRequest(pool=pool, stored=spilled(PROMPT)))
    assert evicted(resp) == [(ks[4], DISK), (ks[3], DISK)]

    route = (await client.kv.Route(pb.RouteRequest(prompt_token_ids=PROMPT))).pools[0]
    assert (route.cached_tokens, route.tier_tokens) == (0, 12)
    look = await client.admin.Lookup(pb.LookupRequest(prompt_token_ids=PROMPT), metadata=AUTH)
    assert (look.pools[0].cached_tokens, look.pools[0].tier_tokens) == (0, 12)

    lease = (await client.acquire(pool, PROMPT)).lease
    assert (lease.cached_tokens, lease.tier_blocks, len(lease.block_table)) == (0, 3, 6)
    await client.kv.ReleaseLease(
        pb.ReleaseLeaseRequest(pool=pool, lease_id=lease.lease_id, token_ids=PROMPT)
    )
    s = await stats(client)
    device, disk = s.tiers
    assert (device.medium, device.blocks, device.capacity_blocks) == (pb.MEDIUM_DEVICE, 6, 32)
    assert (disk.medium, disk.blocks, disk.capacity_blocks) == (DISK, 3, 3)
    assert (disk.stored_blocks, disk.loaded_blocks, disk.dropped_blocks) == (5, 3, 2)
    assert s.tier_hit_tokens == 12

    # The worker found block 2's file corrupt: it is no longer granted.
    gone = pb.TierBlock(key=ks[2], medium=DISK)
    resp = await client.kv.UpdateTiers(pb.UpdateTiersRequest(pool=pool, dropped=[gone]))
    assert evicted(resp) == []
    await client.admin.Flush(pb.FlushRequest(), metadata=AUTH)  # the device forgets
    lease = (await client.acquire(pool, PROMPT)).lease
    assert (lease.cached_tokens, lease.tier_blocks) == (0, 2)
    await client.kv.ReleaseLease(pb.ReleaseLeaseRequest(pool=pool, lease_id=lease.lease_id))

    # A tier flush: the blocks go, and the next heartbeat tells the worker, once.
    flush = pb.FlushRequest(pool_id="w1", medium=DISK)
    assert (await client.admin.Flush(flush, metadata=AUTH)).evicted_blocks == 2
    beat = await client.kv.Heartbeat(pb.HeartbeatRequest(pool=pool))
    assert sorted(evicted(beat)) == sorted([(ks[0], DISK), (ks[1], DISK)])
    assert evicted(await client.kv.Heartbeat(pb.HeartbeatRequest(pool=pool))) == []
    assert (await stats(client)).tiers[1].blocks == 0


async def test_two_tiers_and_a_flush_of_every_pool(client: Client) -> None:
    both = [
        pb.TierSpec(medium=HOST, capacity_blocks=2),
        pb.TierSpec(medium=DISK, capacity_blocks=64),
    ]
    pool = await client.register(tiers=both)
    bare = await client.register("w2")
    ks = keys(PROMPT)
    stored = spilled(PROMPT) + spilled(PROMPT[:8], HOST)
    assert (
        evicted(await client.kv.UpdateTiers(pb.UpdateTiersRequest(pool=pool, stored=stored))) == []
    )
    routes = {
        r.pool_id: r
        for r in (await client.kv.Route(pb.RouteRequest(prompt_token_ids=PROMPT))).pools
    }
    assert (routes["w1"].tier_tokens, routes["w2"].tier_tokens) == (20, 0)
    s = await stats(client)
    assert [(t.medium, t.blocks) for t in s.tiers] == [(pb.MEDIUM_DEVICE, 0), (HOST, 2), (DISK, 5)]
    # Every pool (w2 has no tier): only w1's host tier is cleared.
    flushed = await client.admin.Flush(pb.FlushRequest(medium=HOST), metadata=AUTH)
    assert flushed.evicted_blocks == 2
    beat = await client.kv.Heartbeat(pb.HeartbeatRequest(pool=pool))
    assert evicted(beat) == [(ks[0], HOST), (ks[1], HOST)]
    del bare


async def test_refusals(client: Client) -> None:
    bad = grpc.StatusCode.INVALID_ARGUMENT
    disk = [pb.TierSpec(medium=DISK, capacity_blocks=8)]
    for tiers in (
        [pb.TierSpec(medium=pb.MEDIUM_DEVICE, capacity_blocks=8)],
        [pb.TierSpec(medium=pb.MEDIUM_UNSPECIFIED, capacity_blocks=8)],
        [pb.TierSpec(medium=7, capacity_blocks=8)],
        disk * 2,
        disk * 3,
    ):
        await expect_code(bad, client.register(tiers=tiers))
    pool = await client.register(tiers=disk)
    bare = await client.register("w2")
    block = spilled(PROMPT[:4])[0]

    def update(ref: pb.PoolRef, **kw) -> object:
        return client.kv.UpdateTiers(pb.UpdateTiersRequest(pool=ref, **kw))

    details = await expect_code(bad, update(bare, stored=[block]))
    assert "registered no tiers" in details
    host = pb.TierBlock(key=1, parent_key=2, medium=HOST)
    assert "no HOST tier" in await expect_code(bad, update(pool, stored=[block, host]))
    assert "no HOST tier" in await expect_code(bad, update(pool, dropped=[host]))
    for medium in (pb.MEDIUM_UNSPECIFIED, pb.MEDIUM_DEVICE, 9):
        await expect_code(bad, update(pool, stored=[pb.TierBlock(key=1, medium=medium)]))
    many = [pb.TierBlock(key=k, medium=DISK) for k in range(65_537)]
    assert "at most 65536" in await expect_code(bad, update(pool, dropped=many))
    weird = pb.TierBlock(key=1, medium=DISK, namespace="a\x1b[2J")
    await expect_code(bad, update(pool, stored=[weird]))
    assert (await stats(client)).tiers[1].blocks == 0  # nothing got in

    ghost = pb.PoolRef(pool_id="nope", incarnation=pool.incarnation)
    await expect_code(grpc.StatusCode.FAILED_PRECONDITION, update(ghost, stored=[block]))
    new = await client.register(tiers=disk, incarnation=pool.incarnation)
    await expect_code(grpc.StatusCode.FAILED_PRECONDITION, update(pool, stored=[block]))
    assert evicted(await update(new, stored=[block])) == []

    flush = client.admin.Flush(pb.FlushRequest(pool_id="w2", medium=DISK), metadata=AUTH)
    assert "no DISK tier" in await expect_code(bad, flush)
    await expect_code(bad, client.admin.Flush(pb.FlushRequest(medium=12), metadata=AUTH))


async def test_the_cli_shows_the_tiers(client: Client, capsys: pytest.CaptureFixture[str]) -> None:
    pool = await client.register(tiers=[pb.TierSpec(medium=DISK, capacity_blocks=64)])
    await client.kv.UpdateTiers(pb.UpdateTiersRequest(pool=pool, stored=spilled(PROMPT)))
    args = ["--address", client.svc.address, "--token", TOKEN]
    assert await asyncio.to_thread(admin_cli.main, [*args, "stats"]) == 0
    out = capsys.readouterr().out
    assert "tiers" in out and "disk 5/64" in out
    lookup = [*args, "lookup", ",".join(map(str, PROMPT))]
    assert await asyncio.to_thread(admin_cli.main, lookup) == 0
    assert "from tiers" in capsys.readouterr().out
    assert await asyncio.to_thread(admin_cli.main, [*args, "flush", "--tier", "disk"]) == 0
    assert "flushed 5 blocks from the disk tier" in capsys.readouterr().out
