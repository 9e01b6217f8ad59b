"""The gateway over a cache service sharded by pool id: two real in-process cache services on
loopback, fake workers registered with each (a0, a1 on shard A; b0, b1 on shard B), and the
real gateway with ``--cache-service A,B``.

Route merges both shards' pools (and a prefix cached on shard B routes there); a stopped shard
drops only its own pools, and they come back when it restarts and its workers re-register; a
shard that hangs costs one ROUTE_TIMEOUT_S, then is left out and probed off the request path;
two shards claiming one pool keep the live one; every shard down is the unsharded failure. The
admin pass-through merges stats, flush, lookup and the integrity check, sends per-pool calls
to the owning shard (known, unknown or stale), and a wrong token is still a 401.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import httpx
import pytest

from gateway import cache_client, sharded_cache
from gateway.cache_client import CacheClient
from gateway.config import GatewayConfig
from gateway.errors import NotFound, Unauthorized, WorkerUnavailable
from gateway.generation import GenerationRequest
from gateway.server import RunningGateway, running
from gateway.sharded_cache import ShardedCache
from gateway.tokenizer import Tokenizer
from kvcache_service.config import ServiceConfig
from kvcache_service.server import RunningService
from kvcache_service.server import running as running_cache
from kvserve_model.sampling_params import SamplingParams
from kvserve_proto.kvcache.v1 import kvcache_pb2 as kv
from kvserve_proto.kvcache.v1 import kvcache_pb2_grpc as kv_grpc
from kvserve_proto.worker.v1 import worker_pb2 as pb
from kvserve_proto.worker.v1 import worker_pb2_grpc as pb_grpc
from tests.gateway.conftest import ADMIN_TOKEN, AUTH, gateway_config
from tests.gateway.fake_worker import MODEL, FakeWorker

PROMPT = list(range(40, 80))  # 10 of the fakes' 4-token blocks


@dataclass
class Shard:
    """One cache service that a test can stop and start again on its port."""

    name: str
    port: int = 0
    service: RunningService | None = None
    _stack: contextlib.AsyncExitStack = field(default_factory=contextlib.AsyncExitStack)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self, lease_ttl_s: float = 30.0) -> Shard:
        self._stack = contextlib.AsyncExitStack()
        cfg = ServiceConfig(
            host="127.0.0.1", port=self.port, admin_token=ADMIN_TOKEN, lease_ttl_s=lease_ttl_s
        )
        self.service = await self._stack.enter_async_context(running_cache(cfg))
        self.port = self.service.port
        return self

    async def stop(self) -> None:
        await self._stack.aclose()
        self.service = None

    def pool_ids(self) -> set[str]:
        assert self.service is not None
        return set(self.service.authority.pools)


@dataclass
class Sharded:
    shards: list[Shard]
    workers: dict[str, FakeWorker]
    gateway: RunningGateway
    http: httpx.AsyncClient

    @property
    def cache(self) -> ShardedCache:
        cache = self.gateway.gateway.cache
        assert isinstance(cache, ShardedCache)
        return cache

    async def poll(self) -> None:
        await self.gateway.gateway.poller.poll_once()

    async def route_pools(self) -> set[str]:
        return {r.pool_id for r in await self.cache.route("", PROMPT, MODEL)}


async def reregister(worker: FakeWorker, timeout_s: float = 10.0) -> None:
    """What a worker does when its shard restarted: register again (retrying while its
    channel reconnects)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await worker.register()
            return
        except grpc.aio.AioRpcError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


@pytest.fixture
async def sharded(tokenizer: Tokenizer) -> AsyncIterator[Sharded]:
    shards = [await Shard("A").start(), await Shard("B").start()]
    workers: dict[str, FakeWorker] = {}
    try:
        for shard in shards:
            for i in range(2):
                name = f"{shard.name.lower()}{i}"
                workers[name] = await FakeWorker(name, shard.address).start()
        config = gateway_config(",".join(s.address for s in shards))
        async with (
            running(config, tokenizer) as gw,
            httpx.AsyncClient(base_url=f"http://{gw.http_address}", timeout=10) as http,
        ):
            yield Sharded(shards, workers, gw, http)
    finally:
        for w in workers.values():
            await w.close()
        for shard in shards:
            await shard.stop()


async def generate_on(address: str, prompt: list[int]) -> list[pb.GenerateResponse]:
    async with grpc.aio.insecure_channel(address) as channel:
        req = pb.GenerateRequest(
            prompt_token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(max_tokens=2)
        )
        return [m async for m in pb_grpc.WorkerStub(channel).Generate(req)]


def shard_errors(text: str, shard: Shard) -> float:
    prefix = f'kvserve_gateway_cache_shard_errors_total{{call="Route",shard="{shard.address}"}} '
    return sum(float(line[len(prefix) :]) for line in text.splitlines() if line.startswith(prefix))


# -- configuration ----------------------------------------------------------------------------


def test_cache_service_takes_a_comma_separated_list(monkeypatch, capsys):
    assert GatewayConfig().cache_services == ("127.0.0.1:50051",)
    one = GatewayConfig.from_args(["--cache-service", "10.0.0.1:50051"])
    assert one.cache_services == ("10.0.0.1:50051",)
    monkeypatch.setenv("KVGATEWAY_CACHE_SERVICE", "a:1, b:2,")
    assert GatewayConfig.from_args([]).cache_services == ("a:1", "b:2")
    for bad in ("a:1,a:1", " , "):
        with pytest.raises(SystemExit):
            GatewayConfig.from_args(["--cache-service", bad])
    assert "--cache-service" in capsys.readouterr().err


async def test_one_address_is_the_plain_client(tokenizer: Tokenizer):
    config = ServiceConfig(host="127.0.0.1", port=0, admin_token="t")
    async with (
        running_cache(config) as svc,
        running(gateway_config(svc.address), tokenizer) as gw,
    ):
        assert type(gw.gateway.cache) is CacheClient


# -- Route -------------------------------------------------------------------------------------


async def test_route_merges_both_shards_and_a_prefix_on_b_routes_there(sharded: Sharded):
    assert sharded.shards[0].pool_ids() == {"a0", "a1"}
    assert sharded.shards[1].pool_ids() == {"b0", "b1"}
    assert await sharded.route_pools() == {"a0", "a1", "b0", "b1"}
    health = (await sharded.http.get("/health")).json()
    assert sorted(w["worker"] for w in health["workers"]) == ["a0", "a1", "b0", "b1"]

    # b1 computes the prompt (leasing and committing through shard B) ...
    await generate_on(sharded.workers["b1"].address, PROMPT)
    routes = {r.pool_id: r for r in await sharded.cache.route("", PROMPT, MODEL)}
    assert routes["b1"].cached_tokens > 0 and routes["a0"].cached_tokens == 0
    # ... and the gateway sends that prompt to b1, which serves it from its cache.
    async with grpc.aio.insecure_channel(sharded.gateway.grpc_address) as channel:
        req = pb.GenerateRequest(
            prompt_token_ids=pb.TokenIds(ids=PROMPT), sampling=pb.SamplingParams(max_tokens=2)
        )
        msgs = [m async for m in pb_grpc.WorkerStub(channel).Generate(req)]
    assert msgs[-1].worker_id == "b1" and msgs[-1].usage.cached_tokens > 0
    assert sharded.cache.owners == {
        "a0": sharded.cache.shards[0],
        "a1": sharded.cache.shards[0],
        "b0": sharded.cache.shards[1],
        "b1": sharded.cache.shards[1],
    }


async def test_a_stopped_shard_drops_only_its_pools_until_it_is_back(
    sharded: Sharded, caplog: pytest.LogCaptureFixture
):
    a, b = sharded.shards
    await b.stop()
    caplog.set_level(logging.INFO, "gateway.sharded_cache")
    assert await sharded.route_pools() == {"a0", "a1"}
    for i in range(4):
        resp = await sharded.http.post(
            "/v1/completions", json={"model": MODEL, "prompt": f"q{i}", "max_tokens": 2}
        )
        assert resp.status_code == 200 and resp.headers["x-kvserve-worker"] in ("a0", "a1")
    await sharded.poll()
    health = (await sharded.http.get("/health")).json()
    assert sorted(w["worker"] for w in health["workers"]) == ["a0", "a1"]
    # Counted on every failed call (the first, then the probes), logged once per interval.
    assert shard_errors((await sharded.http.get("/metrics")).text, b) >= 1
    warnings = [
        r for r in caplog.records if r.levelno == logging.WARNING and b.address in r.getMessage()
    ]
    assert len(warnings) == 1 and "left out" in warnings[0].getMessage()
    assert shard_errors((await sharded.http.get("/metrics")).text, a) == 0

    # Restarted on its port: empty, until its workers register again.
    await b.start()
    for name in ("b0", "b1"):
        await reregister(sharded.workers[name])
    deadline = time.monotonic() + 10
    while await sharded.route_pools() != {"a0", "a1", "b0", "b1"}:
        assert time.monotonic() < deadline, "shard B's pools did not come back"
        await asyncio.sleep(0.05)
    await sharded.poll()
    assert len((await sharded.http.get("/health")).json()["workers"]) == 4
    assert any("answers again" in r.getMessage() for r in caplog.records)


async def test_every_shard_down_is_the_unsharded_failure(sharded: Sharded):
    for shard in sharded.shards:
        await shard.stop()
    with pytest.raises(WorkerUnavailable):
        await sharded.cache.route("", PROMPT, MODEL)
    # As with one cache service: the dispatcher routes by load over the workers it knew.
    req = GenerationRequest("r", tuple(PROMPT), SamplingParams(max_tokens=2))
    decision = await sharded.gateway.gateway.dispatcher.route(req)
    assert {c.pool_id for c in decision.order} == {"a0", "a1", "b0", "b1"}


async def test_a_hung_shard_costs_one_route_timeout_then_nothing(
    sharded: Sharded, monkeypatch: pytest.MonkeyPatch
):
    """A shard that accepts connections and never answers (a stuck process, a black hole):
    the first fan-out returns the other shard's pools when the Route deadline passes; after
    that the shard is left out at once, and probed off the request path."""
    monkeypatch.setattr(cache_client, "ROUTE_TIMEOUT_S", 0.5)
    monkeypatch.setattr(sharded_cache, "PROBE_INTERVAL_S", 0.2)
    errors: list[tuple[str, str]] = []
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(8)  # never accepted, never answered: no HTTP/2 handshake
        address = f"127.0.0.1:{hung.getsockname()[1]}"
        cache = ShardedCache(
            [CacheClient(sharded.shards[0].address), CacheClient(address)],
            on_shard_error=lambda shard, call: errors.append((shard, call)),
        )
        try:
            took = []
            for _ in range(20):
                start = time.perf_counter()
                routes = await cache.route("", PROMPT, MODEL)
                took.append(time.perf_counter() - start)
                assert {r.pool_id for r in routes} == {"a0", "a1"}
                await asyncio.sleep(0.05)
            # Relative to the deadline, not latency targets (CI machines are busy): the first
            # call waits out one deadline, not two; no later call waits one out.
            assert 0.5 <= took[0] < 2 * 0.5, took
            assert max(took[1:]) < 0.5, took
            # The first call, then probes: one at a time, each waiting out its deadline.
            assert len(errors) >= 2 and set(errors) == {(address, "Route")}
        finally:
            await cache.close()


async def test_two_shards_claiming_one_pool_keep_the_live_one(
    sharded: Sharded, caplog: pytest.LogCaptureFixture
):
    """A pool id registered on two shards (a misconfiguration): logged, and the entry of the
    shard where it is alive wins, whichever shard comes first."""
    stale = await Shard("C").start(lease_ttl_s=0.3)
    try:
        async with grpc.aio.insecure_channel(stale.address) as channel:
            await kv_grpc.KVCacheServiceStub(channel).RegisterPool(
                kv.RegisterPoolRequest(
                    pool_id="b0", num_blocks=8, block_size=4, worker_address="127.0.0.1:1"
                )
            )
        cache = ShardedCache([CacheClient(stale.address), CacheClient(sharded.shards[1].address)])
        try:
            routes = {r.pool_id: r for r in await cache.route("", PROMPT, MODEL)}
            assert routes["b0"].worker_address == "127.0.0.1:1"  # both alive: the first
            await asyncio.sleep(0.4)  # the stale registration misses its heartbeats
            routes = {r.pool_id: r for r in await cache.route("", PROMPT, MODEL)}
            assert routes["b0"].worker_address == sharded.workers["b0"].address
            assert cache.owners["b0"] is cache.shards[1]
        finally:
            await cache.close()
        assert any("registered on two cache shards" in r.getMessage() for r in caplog.records)
    finally:
        await stale.stop()


# -- admin ---------------------------------------------------------------------------------------


async def test_admin_calls_over_every_pool_merge(sharded: Sharded):
    http = sharded.http
    assert (await http.get("/admin/cache/stats")).status_code == 401
    wrong = await http.get("/admin/cache/stats", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
    for path in ("/admin/cache/check", "/admin/cache/stats?pool=b0"):
        assert (await http.get(path, headers={"Authorization": "Bearer nope"})).status_code == 401

    for name in ("a0", "b1"):  # something cached on each shard
        await generate_on(sharded.workers[name].address, PROMPT)
    stats = (await http.get("/admin/cache/stats", headers=AUTH)).json()
    assert sorted(p["pool_id"] for p in stats["pools"]) == ["a0", "a1", "b0", "b1"]
    cached = {p["pool_id"]: p.get("cached_blocks", 0) for p in stats["pools"]}
    assert cached["a0"] > 0 and cached["b1"] > 0

    body = {"token_ids": PROMPT}
    found = (await http.post("/admin/cache/lookup", json=body, headers=AUTH)).json()
    hits = {p["pool_id"]: p["cached_tokens"] for p in found["pools"]}
    assert set(hits) == {"a0", "a1", "b0", "b1"} and hits["a0"] > 0 and hits["b1"] > 0

    check = (await http.get("/admin/cache/check", headers=AUTH)).json()
    assert check == {"ok": True, "problems": [], "pools_checked": 4}

    flush = (await http.post("/admin/cache/flush", json={}, headers=AUTH)).json()
    assert flush["evicted_blocks"] == cached["a0"] + cached["b1"]
    after = (await http.get("/admin/cache/stats", headers=AUTH)).json()
    assert all(p["cached_blocks"] == 0 for p in after["pools"])

    # A shard that cannot be checked fails the check; the other's pools are still counted.
    await sharded.shards[0].stop()
    check = (await http.get("/admin/cache/check", headers=AUTH)).json()
    assert check["ok"] is False and check["pools_checked"] == 2
    assert check["problems"][0].startswith(f"shard {sharded.shards[0].address}: not checked")
    stats = (await http.get("/admin/cache/stats", headers=AUTH)).json()
    assert sorted(p["pool_id"] for p in stats["pools"]) == ["b0", "b1"]


async def test_per_pool_admin_calls_reach_the_owning_shard(sharded: Sharded):
    http = sharded.http
    a, b = sharded.shards
    await generate_on(sharded.workers["b0"].address, PROMPT)
    body = {"pool": "b0", "token_ids": PROMPT}
    pin = await http.post("/admin/cache/pin", json=body, headers=AUTH)
    assert pin.status_code == 200 and pin.json()["blocks"] > 0
    assert b.service is not None
    assert b.service.authority.get_pool("b0").pinned_blocks == pin.json()["blocks"]
    tree = (await http.get("/admin/cache/tree?pool=b0", headers=AUTH)).json()
    assert tree["nodes"]
    one = (await http.get("/admin/cache/stats?pool=b0", headers=AUTH)).json()
    assert [p["pool_id"] for p in one["pools"]] == ["b0"]
    evict = await http.post("/admin/cache/evict", json={"pool": "a1", "blocks": 1}, headers=AUTH)
    assert evict.status_code == 200 and evict.json()["evicted_blocks"] == 0
    missing = await http.get("/admin/cache/tree?pool=nope", headers=AUTH)
    assert missing.status_code == 404

    # An unknown owner is found by asking every shard; a stale one is corrected.
    cache = ShardedCache([CacheClient(a.address), CacheClient(b.address)])
    try:
        auth = f"Bearer {ADMIN_TOKEN}"
        resp = await cache.call_admin("GetStats", kv.StatsRequest(pool_id="b1"), auth)
        assert [p.pool_id for p in resp.pools] == ["b1"]  # type: ignore[attr-defined]
        assert cache.owners == {"b1": cache.shards[1]}
        with pytest.raises(Unauthorized):
            await cache.call_admin("GetStats", kv.StatsRequest(pool_id="a0"), "Bearer nope")
        cache.owners["b0"] = cache.shards[0]  # as if b0 had moved from A to B
        req = kv.InspectTreeRequest(pool_id="b0")
        assert (await cache.call_admin("InspectTree", req, auth)).nodes  # type: ignore[attr-defined]
        assert cache.owners["b0"] is cache.shards[1]
        # A NOT_FOUND about a prefix of a known pool is the answer, not a move.
        unknown = kv.PinRequest(pool_id="b0", prefix=kv.PrefixRef(token_ids=[1, 2, 3, 4, 5]))
        with pytest.raises(NotFound):
            await cache.call_admin("Unpin", unknown, auth)
        assert cache.owners["b0"] is cache.shards[1]
    finally:
        await cache.close()
