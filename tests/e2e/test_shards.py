"""The cache service as two shards, real processes started by the launcher (``--cache-shards
2``): worker-0 registers with shard 0, worker-1 with shard 1, and one gateway fans out over
both. A real completion goes through, repeated prompts hit their cached prefix, the admin
pass-through sees both shards' pools, and with one shard SIGKILLed the other keeps serving.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator

import grpc
import httpx
import pytest

from kvserve_launch.__main__ import banner
from kvserve_launch.config import LaunchConfig
from kvserve_launch.system import System, cache_command
from kvserve_proto.kvcache.v1 import kvcache_pb2 as kv
from kvserve_proto.kvcache.v1 import kvcache_pb2_grpc as kv_grpc
from tests.e2e.conftest import ADMIN_TOKEN, LogSink, started_system

MODEL = "kvserve-tiny-llama"
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
SYSTEM_PROMPT = (
    "You are kvserve's sharded test assistant. Answer briefly. This sentence only makes the "
    "system prompt long enough to span a few KV blocks of the byte-level tokenizer."
)


def port_of(argv: list[str]) -> str:
    return argv[argv.index("--port") + 1]


def test_shard_i_listens_on_cache_port_plus_i_and_the_banner_lists_them():
    cfg = LaunchConfig(cache_port=9002, cache_shards=2, admin_token="tok")
    assert [port_of(cache_command(cfg, shard=i)) for i in range(2)] == ["9002", "9003"]
    assert port_of(cache_command(LaunchConfig(cache_port=0), shard=1)) == "0"
    system = System(
        cfg, None, [None, None], None,  # type: ignore[arg-type]
        "127.0.0.1:9002", ["127.0.0.1:4000", "127.0.0.1:4001"], "127.0.0.1:8000",
        "127.0.0.1:50050", [None], ["127.0.0.1:9003"],  # type: ignore[list-item]
    )  # fmt: skip
    assert "cache shards  127.0.0.1:9002, 127.0.0.1:9003" in banner(system)
    with pytest.raises(SystemExit):
        LaunchConfig.from_args(["--cache-shards", "0"])


@pytest.fixture(scope="module")
def sharded(logs: LogSink) -> Iterator[System]:
    yield from started_system(logs, cache_shards=2)


def pools_on(address: str) -> list[str]:
    with grpc.insecure_channel(address) as channel:
        stats = kv_grpc.KVCacheAdminStub(channel).GetStats(
            kv.StatsRequest(), metadata=(("authorization", f"Bearer {ADMIN_TOKEN}"),), timeout=10
        )
    return [p.pool_id for p in stats.pools]


def chat(http: httpx.Client, user: str) -> httpx.Response:
    body = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": user},
        ],
        "max_tokens": 4,
    }
    resp = http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    return resp


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_a_completion_through_two_shards(sharded: System, logs: LogSink):
    assert len(sharded.cache_addresses) == 2
    assert [pools_on(a) for a in sharded.cache_addresses] == [["worker-0"], ["worker-1"]]
    with httpx.Client(base_url=f"http://{sharded.http_address}", timeout=120) as http:
        stats = http.get("/admin/cache/stats", headers=AUTH).json()
        assert sorted(p["pool_id"] for p in stats["pools"]) == ["worker-0", "worker-1"]
        health = http.get("/health").json()
        assert health["status"] == "ok" and len(health["workers"]) == 2

        first = chat(http, "Hello!")
        assert first.json()["usage"]["completion_tokens"] > 0
        again = chat(http, "Hello again!")
        assert again.headers["x-kvserve-worker"] == first.headers["x-kvserve-worker"]
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        check = http.get("/admin/cache/check", headers=AUTH).json()
        assert check == {"ok": True, "problems": [], "pools_checked": 2}

        # Shard 1 dies without a word: its pool leaves routing, shard 0's keeps serving.
        sharded.extra_caches[0].signal(signal.SIGKILL)
        sharded.extra_caches[0].process.wait(10)  # type: ignore[union-attr]
        for i in range(3):
            resp = chat(http, f"After the shard died, {i}")
            assert resp.headers["x-kvserve-worker"] == "worker-0", logs.dump()
        stats = http.get("/admin/cache/stats", headers=AUTH).json()
        assert [p["pool_id"] for p in stats["pools"]] == ["worker-0"]
        check = http.get("/admin/cache/check", headers=AUTH).json()
        assert check["ok"] is False and check["pools_checked"] == 1


def test_each_shard_publishes_kv_events_on_its_own_ports():
    """vLLM's --kv-events-config passes to every shard, its tcp ports moved up by the shard's
    number and its data-parallel rank set to it, as vLLM does per rank; the cache service
    reads what it gets (its config check parses it)."""
    from kvcache_service.config import ServiceConfig
    from kvcache_service.kv_events_config import KvEventsConfig

    raw = '{"enable_kv_cache_events": true, "publisher": "zmq", "replay_endpoint": "tcp://*:6001"}'
    cfg = LaunchConfig(cache_shards=2, kv_events_config=raw, admin_token="tok")
    got = []
    for i in range(2):
        argv = cache_command(cfg, shard=i)
        config = ServiceConfig.from_args(argv[3:])
        got.append(KvEventsConfig.parse(config.kv_events_config))
    assert [c.endpoint for c in got] == ["tcp://*:5557", "tcp://*:5558"]
    assert [c.replay_endpoint for c in got] == ["tcp://*:6001", "tcp://*:6002"]
    assert [c.data_parallel_rank for c in got] == [0, 1]
    assert "--kv-events-config" not in cache_command(LaunchConfig(), shard=0)
