"""--route-from-events: the gateway's copy of every pool's index, fed by the cache service's KV
events, answers what Route answers.

Pure: randomized operations on the real cache authority, its events converted to the wire as
the servicer does and fed to an EventIndex; after every operation, for many prompts (those
served, their prefixes and continuations, and strangers), each pool's cached prefix from the
copy equals the authority's Route. The copy refuses streams that do not fit (gaps, unknown
blocks). Then the real gateway with the flag over a real cache service and fake workers: it
routes by prefix without one Route call per request, and falls back to Route while its
stream is down.
"""

from __future__ import annotations

import random

import pytest

from gateway.cache_client import PoolRoute
from gateway.event_index import EventIndex
from gateway.pool_copy import Desync
from kvcache_service import convert
from kvcache_service.authority import AuthorityConfig, CacheAuthority
from kvcache_service.errors import OutOfBlocks
from kvcache_service.event_types import Cursor, ResetReason
from kvcache_service.ids import Namespace, PoolId
from kvcache_service.leases import AcquireRequest, Grant, SequenceUpdate
from kvcache_service.pool import PoolSpec
from kvcache_service.tier_index import Medium, TierBlock
from kvcache_service.tokens import pack as pack_domain
from kvserve_proto.block_keys import block_keys, namespace_key
from kvserve_proto.kvcache.v1 import kvcache_pb2 as pb
from kvserve_proto.packed_tokens import pack
from tests.gateway.conftest import Stack, released, started_stack, wait_for, worker_of
from tests.gateway.test_gateway import SYSTEM_A, SYSTEM_B, chat

SOURCE = "cache:1"
TTL = 10.0


class Feed:
    """The authority's events, as a WatchEvents stream would carry them, into an index."""

    def __init__(self, auth: CacheAuthority, index: EventIndex) -> None:
        self.auth = auth
        self.index = index
        auth.watch_events(lambda: None)
        self.snapshot(ResetReason.NO_CURSOR)

    def snapshot(self, why: ResetReason) -> None:
        at, batches = self.auth.events_snapshot(None)
        self.index.connecting(SOURCE)
        self.index.apply(SOURCE, convert.events_reset(why, at))
        for b in batches:
            self.index.apply(SOURCE, convert.event_batch(b, at.log_id))
        self.index.apply(SOURCE, convert.events_synced(at))
        self.seq = at.seq

    def catch_up(self) -> None:
        log = self.auth.events
        for b in log.after(self.seq, 1 << 30):
            self.index.apply(SOURCE, convert.event_batch(b, log.log_id))
            self.seq = b.seq


class World:
    """Pools on a real authority, driven like workers drive them."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.now = 1000.0
        self.auth = CacheAuthority(AuthorityConfig(lease_ttl_s=TTL), clock=lambda: self.now)
        self.sizes = {"a": (20, 4), "b": (30, 3)}
        # Pool a's worker spills to host memory and disk (small tiers: they evict).
        self.tiers = {"a": ((Medium.HOST, 8), (Medium.DISK, 40)), "b": ()}
        self.inc: dict[str, int] = {}
        for p in self.sizes:
            self.register(p)
        self.served: list[tuple[str, list[int]]] = []

    def register(self, pool_id: str) -> None:
        n, bs = self.sizes[pool_id]
        spec = PoolSpec(PoolId(pool_id), n, bs, tiers=self.tiers[pool_id])
        reg = self.auth.register_pool(spec, self.inc.get(pool_id))
        self.inc[pool_id] = reg.incarnation

    def prompt(self) -> list[int]:
        rng = self.rng
        if self.served and rng.random() < 0.5:
            _, past = rng.choice(self.served)
            cut = rng.randint(1, len(past))
            return past[:cut] + [rng.randint(0, 3) for _ in range(rng.randint(0, 6))]
        stem = [rng.choice([1, 2, 3])] * rng.randint(0, 10)
        return stem + [rng.randint(0, 3) for _ in range(rng.randint(1, 8))]

    def spill(self, pool_id: str, ns: str, tokens: list[int]) -> None:
        """What the worker's write-through reports: the full blocks, by key, in a tier."""
        bs = self.sizes[pool_id][1]
        keys = block_keys(namespace_key(ns), pack(tokens), 0, 4 * bs)
        parents = [namespace_key(ns), *keys][: len(keys)]
        medium = self.rng.choice([Medium.HOST, Medium.DISK])
        blocks = [
            TierBlock(k, p, Namespace(ns), medium) for k, p in zip(keys, parents, strict=True)
        ]
        self.auth.update_tiers(PoolId(pool_id), self.inc[pool_id], blocks, [])

    def step(self) -> None:
        rng = self.rng
        pool_id = rng.choice(sorted(self.sizes))
        r = rng.random()
        pool = self.auth.pools[PoolId(pool_id)]
        if r < 0.8:
            ns = Namespace(rng.choice(["", "t"]))
            prompt = self.prompt()
            req = AcquireRequest(
                PoolId(pool_id), self.inc[pool_id], ns, pack_domain(prompt, "p"), 3
            )
            try:
                grant, _ = self.auth.acquire(req)
            except OutOfBlocks:
                return
            assert isinstance(grant, Grant)
            final = prompt + [rng.randint(0, 3) for _ in range(rng.randint(0, 3))]
            written = rng.randint(0, len(final))
            update = SequenceUpdate(written, pack_domain(final, "f", True), 0)
            self.auth.release(PoolId(pool_id), self.inc[pool_id], grant.lease_id, update)
            if written:
                self.served.append((ns, final[:written]))
                if self.tiers[pool_id]:
                    self.spill(pool_id, ns, final[:written])
        elif r < 0.84 and pool.tiers.media:  # the worker lost a block, or a tier was flushed
            medium = rng.choice(sorted(pool.tiers.media))
            held = list(pool.tiers.keys(medium))
            if rng.random() < 0.3:
                self.auth.flush(pool_id, medium)
            elif held:
                gone = [(k, medium) for k in rng.sample(held, min(len(held), 3))]
                self.auth.update_tiers(PoolId(pool_id), self.inc[pool_id], [], gone)
        elif r < 0.88:
            pool.admin.evict_lru(rng.randint(1, 5))
        elif r < 0.92:
            pool.admin.flush()
        elif r < 0.96:
            self.register(pool_id)
        else:
            self.now += 5 * TTL + 1  # every pool forgotten, then back
            self.auth.expire_due()
            for p in self.sizes:
                self.register(p)


@pytest.mark.parametrize("seed", range(4))
def test_the_copy_answers_what_route_answers(seed: int) -> None:
    world = World(seed)
    index = EventIndex()
    feed = Feed(world.auth, index)
    compared = from_tiers = 0
    for _ in range(250):
        world.step()
        feed.catch_up()
        prompts = list(world.served[-6:])
        prompts += [("", world.prompt()) for _ in range(6)]
        for ns, prompt in prompts:
            routes = world.auth.route(Namespace(ns), pack_domain(prompt, "p"))
            for r in routes:
                # the tokens the pool would not compute: cached, then loaded from its tiers
                expected = r.cached_tokens + r.tier_tokens
                got = index.cached_tokens(r.pool_id, ns, pack(prompt))
                assert got == expected, (r.pool_id, ns, prompt, r.tier_tokens)
                compared += expected > 0
                from_tiers += r.tier_tokens > 0
        assert set(index.pools) == set(world.auth.pools)
    assert compared > 100  # most answers were not trivially 0
    assert from_tiers > 20  # and some came from the tiers


def test_a_reconnect_from_a_cursor_or_a_snapshot_keeps_the_copy_right() -> None:
    world = World(9)
    index = EventIndex()
    feed = Feed(world.auth, index)
    for _ in range(40):
        world.step()
    index.down(SOURCE)
    assert index.cached_tokens("a", "", pack([1, 2, 3])) is None  # not in sync: ask Route
    # Resume: the missed batches, then synced.
    request = index.connecting(SOURCE)
    assert request.after.seq == feed.seq
    start = world.auth.events.resume(Cursor(request.after.log_id, request.after.seq))
    assert start == feed.seq
    feed.catch_up()
    index.apply(SOURCE, convert.events_synced(world.auth.events.cursor()))
    for _ in range(40):
        world.step()
    feed.snapshot(ResetReason.TOO_OLD)  # a reset drops everything first
    for ns, prompt in world.served[-20:]:
        for r in world.auth.route(Namespace(ns), pack_domain(prompt, "p")):
            assert index.cached_tokens(r.pool_id, ns, pack(prompt)) == r.cached_tokens


def _batch(seq: int, log_id: int = 7, **kw) -> pb.WatchEventsResponse:
    return pb.WatchEventsResponse(
        batch=pb.KVEventBatch(
            cursor=pb.EventCursor(log_id=log_id, seq=seq),
            pool_id="p",
            incarnation=1,
            block_size=2,
            **kw,
        )
    )


def _stored(blocks: list[int], tokens: list[int], parent: int | None = None) -> pb.KVEvent:
    s = pb.BlocksStored(namespace="", blocks=blocks, tokens=pack(tokens))
    if parent is not None:
        s.parent_block = parent
    return pb.KVEvent(stored=s)


def _live_index() -> EventIndex:
    index = EventIndex()
    index.connecting(SOURCE)
    index.apply(SOURCE, pb.WatchEventsResponse(reset=pb.EventsReset(cursor={"log_id": 7})))
    index.apply(SOURCE, _batch(0))  # the snapshot: pool p, empty
    index.apply(SOURCE, pb.WatchEventsResponse(synced=pb.EventCursor(log_id=7, seq=0)))
    return index


def test_a_stream_that_does_not_fit_is_refused() -> None:
    index = _live_index()
    index.apply(SOURCE, _batch(1, events=[_stored([5, 6], [1, 2, 3, 4])]))
    assert index.cached_tokens("p", "", pack([1, 2, 3, 4, 9])) == 4
    assert index.cached_tokens("p", "", pack([1, 2, 3])) == 2  # at least one computed
    with pytest.raises(Desync, match="gap"):
        index.apply(SOURCE, _batch(3))
    with pytest.raises(Desync, match="another log"):
        index.apply(SOURCE, _batch(2, log_id=8))
    with pytest.raises(Desync, match="not held"):
        index.apply(SOURCE, _batch(2, events=[_stored([7], [9, 9], parent=99)]))
    index = _live_index()
    with pytest.raises(Desync, match="removed but not held"):
        index.apply(SOURCE, _batch(1, events=[pb.KVEvent(removed=pb.BlocksRemoved(blocks=[1]))]))


def test_routes_fall_back_unless_every_known_pool_is_answered() -> None:
    index = _live_index()
    index.apply(SOURCE, _batch(1, events=[_stored([5, 6], [1, 2, 3, 4])]))
    known = [PoolRoute("p", "p:1", "m", 0, 10, 0, 0, True)]
    routes = index.routes("", [1, 2, 3, 4, 5], known)
    assert routes is not None and routes[0].cached_tokens == 4 and routes[0].free_blocks == 10
    assert index.routes("", [1, 2], [*known, PoolRoute("q", "q:1", "m", 0, 1, 0, 0, True)]) is None
    assert index.routes("", [1, 2], []) is None
    index.down(SOURCE)
    assert index.routes("", [1, 2], known) is None
    assert (index.answered, index.fell_back) == (1, 3)


# -- the gateway with --route-from-events ------------------------------------------------------


def _count_routes(stack: Stack) -> list[tuple]:
    """Records every Route the gateway sends that is not the poller's discovery."""
    cache = stack.gateway.gateway.cache
    calls: list[tuple] = []
    inner = cache.route

    async def route(namespace, prompt_token_ids, model):  # type: ignore[no-untyped-def]
        if tuple(prompt_token_ids) != (0,):
            calls.append((namespace, tuple(prompt_token_ids)))
        return await inner(namespace, prompt_token_ids, model)

    cache.route = route  # type: ignore[method-assign]
    return calls


async def test_the_gateway_routes_from_events_without_route_calls(cache, tokenizer) -> None:
    async with started_stack(cache, tokenizer, route_from_events=True) as stack:
        gw = stack.gateway.gateway
        assert gw.events is not None
        index = gw.events.index
        source = index.source(cache.address)
        await wait_for(lambda: source.phase == "live" and len(index.pools) == 2)
        calls = _count_routes(stack)

        a = await worker_of(stack, chat(SYSTEM_A, "first"))
        await released(stack)
        await stack.poll()
        b = await worker_of(stack, chat(SYSTEM_B, "first"))
        assert a != b
        await released(stack)
        await stack.poll()
        await wait_for(lambda: sum(len(p) for p in index.pools.values()) > 0)
        for i in range(3):
            assert await worker_of(stack, chat(SYSTEM_A, f"again {i}")) == a
            assert await worker_of(stack, chat(SYSTEM_B, f"again {i}")) == b
        assert calls == [] and index.answered == 8

        # The stream down: Route answers until it is back, resumed from its cursor.
        await gw.events.stop()
        assert source.phase == "down"
        assert await worker_of(stack, chat(SYSTEM_A, "while down")) == a
        assert len(calls) == 1
        await released(stack)
        gw.events.start()
        await wait_for(lambda: source.phase == "live")
        assert await worker_of(stack, chat(SYSTEM_B, "back")) == b
        assert len(calls) == 1 and index.answered == 9
        metrics = (await stack.http.get("/metrics")).text
        assert 'kvserve_gateway_route_source_total{source="events"} 9.0' in metrics
        assert 'kvserve_gateway_route_source_total{source="route"} 1.0' in metrics


def test_the_flag_needs_a_token() -> None:
    from gateway.config import GatewayConfig, check

    assert check(GatewayConfig(route_from_events=True)) is not None
    assert check(GatewayConfig(route_from_events=True, cache_token="t")) is None
    assert check(GatewayConfig(route_from_events=True, admin_token="t")) is None


async def test_one_stream_per_shard(tokenizer) -> None:
    """Two cache shards: a copy per shard's pools; a shard that restarts comes back with a
    reset (its log is new) and its pools answer here again."""
    import grpc

    from gateway.server import running
    from kvserve_proto.worker.v1 import worker_pb2 as wpb
    from kvserve_proto.worker.v1 import worker_pb2_grpc as wpb_grpc
    from tests.gateway.conftest import gateway_config
    from tests.gateway.fake_worker import FakeWorker
    from tests.gateway.test_shards import PROMPT, Shard, generate_on, reregister

    shards = [await Shard("A").start(), await Shard("B").start()]
    workers = [await FakeWorker(f"{s.name.lower()}0", s.address).start() for s in shards]
    try:
        config = gateway_config(",".join(s.address for s in shards), route_from_events=True)
        async with running(config, tokenizer) as gw:
            feeds = gw.gateway.events
            assert feeds is not None
            index = feeds.index

            def live() -> bool:
                phases = [index.source(s.address).phase for s in shards]
                return phases == ["live", "live"] and set(index.pools) == {"a0", "b0"}

            await wait_for(live)
            await generate_on(workers[1].address, PROMPT)  # b0 holds the prompt now
            await wait_for(lambda: index.cached_tokens("b0", "", pack(PROMPT)) == len(PROMPT) - 1)
            answered = index.answered
            async with grpc.aio.insecure_channel(gw.grpc_address) as channel:
                req = wpb.GenerateRequest(
                    prompt_token_ids=wpb.TokenIds(ids=PROMPT),
                    sampling=wpb.SamplingParams(max_tokens=2),
                )
                msgs = [m async for m in wpb_grpc.WorkerStub(channel).Generate(req)]
            assert msgs[-1].worker_id == "b0" and index.answered == answered + 1

            await shards[1].stop()
            await wait_for(lambda: index.source(shards[1].address).phase == "down")
            assert index.cached_tokens("b0", "", pack(PROMPT)) is None  # Route's turn
            await shards[1].start()
            await reregister(workers[1])
            await wait_for(live, timeout_s=15)
            assert index.cached_tokens("b0", "", pack(PROMPT)) == 0  # a new, empty pool
    finally:
        for w in workers:
            await w.close()
        for s in shards:
            await s.stop()
