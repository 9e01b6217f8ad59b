"""A cache-service outage, as users meet it, with real processes (docs/reliability.md, "A
cache-service outage"): the only cache service SIGKILLed and not restarted at once.

What was seen before: /health said ok with every worker healthy, a new chat got no answer in
50 s, running streams stalled. What is asserted: within seconds /health answers 503 "cache
service unreachable" with Retry-After and ``kvserve_gateway_cache_service_up`` is 0; a new
chat gets 503 with Retry-After at once; streams that need a block end after the worker's
``--cache-outage-timeout-s`` instead of stalling; once the service is back on its port,
everything serves again and the books are clean.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from kvserve_launch.process import KeptLines
from kvserve_launch.system import System
from tests.e2e.conftest import STARTUP_TIMEOUT_S, started_system
from tests.e2e.test_faults import Streams, assert_books, chat, port, respawn, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

WORKER_OUTAGE_S = 4


@pytest.fixture(scope="module")
def system() -> Iterator[System]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVWORKER_CACHE_OUTAGE_TIMEOUT_S", str(WORKER_OUTAGE_S))
        mp.setenv("KVCACHE_LEASE_TTL_S", "8")  # heartbeats every 2 s
        yield from started_system(KeptLines(), workers=1)


def test_an_outage_is_said_bounded_and_recovered_from(system: System) -> None:
    http = httpx.Client(base_url=f"http://{system.http_address}", timeout=60)
    assert http.get("/health").json()["cache_service"]["reachable"] is True
    streams = Streams(f"http://{system.http_address}", 2, max_tokens=3000)
    streams.started.wait(120)
    system.cache.kill()
    killed = time.monotonic()

    def says_down() -> bool:
        r = http.get("/health")
        return r.status_code == 503 and r.json()["status"] == "cache service unreachable"

    wait_for("/health to say the cache service is unreachable", says_down, timeout_s=15)
    health = http.get("/health")
    assert health.headers["retry-after"] == "5"
    assert health.json()["cache_service"]["reachable"] is False
    assert "kvserve_gateway_cache_service_up 0.0" in http.get("/metrics").text
    started = time.monotonic()
    new = http.post("/v1/chat/completions", json=chat("during the outage", 4, stream=False))
    assert new.status_code == 503 and new.headers["retry-after"] == "5", new.text
    assert "unreachable" in new.json()["error"]["message"]
    assert time.monotonic() - started < 5  # at once, not after a wait
    # The streams need blocks only the service grants: they end within the worker's bound.
    ends = streams.join(timeout_s=60)
    assert all(r != "length" and r != "not run" for r in ends), ends
    assert time.monotonic() - killed < 60
    # Back on its port: the worker re-registers, the gateway sees it, requests are served.
    system.cache = respawn(system.cache, **{"--port": port(system.cache_address)})
    system.cache.wait_ready(STARTUP_TIMEOUT_S)
    wait_for("/health to be ok again", lambda: http.get("/health").status_code == 200, 60)
    assert "kvserve_gateway_cache_service_up 1.0" in http.get("/metrics").text

    def served() -> bool:  # as a client that honours Retry-After: the worker may learn last
        r = http.post("/v1/chat/completions", json=chat("after the outage", 4, stream=False))
        assert r.status_code in (200, 503), r.text
        return r.status_code == 200

    wait_for("a chat to be served again", served, timeout_s=30)
    assert_books(system, http)
