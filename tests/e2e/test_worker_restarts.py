"""A worker killed and restarted on its address, again and again under streams that clients
hang up: the gateway serves throughout and logs no asyncio error.

Before: the gateway logged "Task was destroyed but it is pending" (gRPC's task consuming the
request stream of a ``GenerateMany`` call the dead worker had ended) and "aclose(): asynchronous
generator is already running" (that stream's generator, finalized while it waited), once the
restarted worker's new call replaced the old one (``gateway/worker_client.py``, ``_Outbox``).
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from kvserve_launch.process import KeptLines
from tests.e2e.conftest import STARTUP_TIMEOUT_S, started_system
from tests.e2e.test_faults import port, respawn

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

ASYNCIO_ERRORS = (
    "Task was destroyed but it is pending",
    "aclose(): asynchronous generator is already running",
    "Task exception was never retrieved",
)


def stream(base: str, i: int, max_tokens: int, hang_up: bool) -> None:
    body = {"prompt": f"restart {i}", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    try:
        with (
            httpx.Client(base_url=base, timeout=60) as client,
            client.stream("POST", "/v1/completions", json=body) as r,
        ):
            for n, _ in enumerate(r.iter_lines()):
                if hang_up and n > 5:
                    return  # the client goes away mid-stream
    except httpx.HTTPError:
        pass  # cut off by the kill: expected


def test_worker_restarts_leave_no_asyncio_errors_in_the_gateway():
    """Also: the restarted worker takes its pool back at once (``worker.pool_claim``), within
    the default 30 s lease TTL of the killed one's last heartbeat; it was refused as a live
    pool's second registrant until that TTL lapsed."""
    logs = KeptLines(20_000)
    fixture = started_system(logs, workers=2)
    system = next(fixture)
    base = f"http://{system.http_address}"
    try:
        for round_ in range(3):
            threads = [
                threading.Thread(target=stream, args=(base, 10 * round_ + i, 400, i % 2 == 0))
                for i in range(8)
            ]
            for t in threads:
                t.start()
            time.sleep(0.5)
            system.workers[0].kill()
            for t in threads:
                t.join(120)
            system.workers[0] = respawn(
                system.workers[0], **{"--port": port(system.worker_addresses[0])}
            )
            system.workers[0].wait_ready(STARTUP_TIMEOUT_S)
            time.sleep(2.5)  # the gateway finds it again: its next request opens a new call
        with httpx.Client(base_url=base, timeout=60) as client:
            for i in range(6):
                body = {"prompt": f"after {i}", "max_tokens": 8, "ignore_eos": True}
                assert client.post("/v1/completions", json=body).status_code == 200
    finally:
        fixture.close()  # stops every process (the gateway last logs at its shutdown)
    lines = logs.dump().splitlines()
    refused = [line for line in lines if "register it after its TTL lapses" in line]
    assert not refused, "\n".join(refused[:5])
    assert sum("registered pool" in line for line in lines) >= 2 + 3  # each restart at once
    gateway = [line for line in lines if line.startswith("gateway")]
    found = [line for line in gateway if any(e in line for e in ASYNCIO_ERRORS)]
    assert not found, "\n".join(found[:10])
