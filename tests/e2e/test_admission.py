"""Admission under pins and quotas, with real processes, under load: a request the pool could
never hold is refused at once and holds up nobody; small requests keep being served throughout.
(The admission timeout, for a request that waits for room that does not come, is
``tests/worker_engine/test_admission.py``'s: a lease held for ever is made there directly.)

The issue this answers: a worker of 96 blocks with a 20-block prefix pinned, then a completion
of about 89 blocks, never answered, logged nothing, and every later request to that worker hung
behind it (the cache service answered "no room", which the worker took for "not yet").
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from kvserve_launch.process import KeptLines
from kvserve_launch.system import System
from kvserve_model.tiny_model import TINY_MODEL_NAME
from tests.e2e.conftest import started_system

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

BLOCKS, QUOTA = 96, 80
# The tiny model's tokenizer is a byte per token: 640 bytes are 20 blocks of 32.
PINNED = "Pinned system prompt. " * 29  # 638 bytes
SMALL = {"max_tokens": 4, "ignore_eos": True}


@pytest.fixture(scope="module")
def system() -> Iterator[System]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVCACHE_NAMESPACE_QUOTA_BLOCKS", str(QUOTA))
        yield from started_system(KeptLines(), workers=1, num_blocks=BLOCKS)


@pytest.fixture(scope="module")
def http(system: System) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"http://{system.http_address}", timeout=120) as client:
        yield client


def admin(system: System) -> dict[str, str]:
    return {"Authorization": f"Bearer {system.config.admin_token}"}


def chat(system_prompt: str, user: str, **extra: object) -> dict:
    return {
        "model": TINY_MODEL_NAME,
        "messages": [
            {"role": "system", "content": system_prompt},
            {"role": "user", "content": user},
        ],
        **SMALL,
        **extra,
    }


class Load:
    """Small chats in a loop from a few threads, each answer recorded, until stopped."""

    def __init__(self, base_url: str, threads: int = 3) -> None:
        self.stop = threading.Event()
        self.codes: list[int] = []
        self.threads = [
            threading.Thread(target=self._run, args=(base_url, i), daemon=True)
            for i in range(threads)
        ]
        for t in self.threads:
            t.start()

    def _run(self, base_url: str, i: int) -> None:
        with httpx.Client(base_url=base_url, timeout=60) as client:
            n = 0
            while not self.stop.is_set():
                resp = client.post("/v1/chat/completions", json=chat("Be brief.", f"Hi {i}.{n}"))
                self.codes.append(resp.status_code)
                n += 1

    def wait_for(self, n: int, timeout_s: float = 60) -> None:
        """Until ``n`` more answers came in."""
        target, deadline = len(self.codes) + n, time.monotonic() + timeout_s
        while len(self.codes) < target:
            assert time.monotonic() < deadline, f"the load stalled: {self.codes}"
            time.sleep(0.05)

    def end(self) -> list[int]:
        self.stop.set()
        for t in self.threads:
            t.join(90)
        return self.codes


def settle(system: System, http: httpx.Client) -> dict:
    """Once no lease is live: the pool's stats, the integrity check passed."""
    for _ in range(100):
        pool = http.get("/admin/cache/stats", headers=admin(system)).json()["pools"][0]
        if int(pool.get("live_leases", 0)) == 0:
            break
        time.sleep(0.1)
    check = http.get("/admin/cache/check", headers=admin(system)).json()
    assert check.get("ok") is True, check
    assert int(pool.get("referenced_blocks", 0)) == 0, pool
    return pool


def test_a_request_beyond_the_unpinned_blocks_is_refused_at_once(system, http):
    assert http.post("/v1/chat/completions", json=chat(PINNED, "Warm.")).status_code == 200
    pin = http.post(
        "/admin/cache/pin",
        headers=admin(system),
        json={"pool": "worker-0", "messages": [{"role": "system", "content": PINNED}]},
    )
    assert pin.status_code == 200, pin.text
    pinned = int(
        http.get("/admin/cache/stats", headers=admin(system)).json()["pools"][0]["pinned_blocks"]
    )
    assert pinned >= 19
    load = Load(f"http://{system.http_address}")
    try:
        load.wait_for(3)
        started = time.monotonic()
        # About 89 blocks: fits the pool of 96, not the 96 - pinned it can ever give.
        big = http.post("/v1/chat/completions", json=chat("Other.", "x" * 2800))
        took = time.monotonic() - started
        load.wait_for(3)  # and after it
    finally:
        codes = load.end()
    assert big.status_code == 400, big.text
    message = big.json()["error"]["message"]
    assert "pinned" in message and f"of its {BLOCKS}" in message, message
    assert took < 10, took  # refused, not left waiting
    assert codes and set(codes) == {200}, codes  # nobody held up behind it
    unpin = http.post(
        "/admin/cache/unpin",
        headers=admin(system),
        json={"pool": "worker-0", "messages": [{"role": "system", "content": PINNED}]},
    )
    assert unpin.status_code == 200, unpin.text
    settle(system, http)


def test_a_request_beyond_its_namespaces_quota_is_refused(system, http):
    # 85 blocks fit the pool, with nothing pinned, but not the quota of 80.
    body = chat("Tenant.", "y" * 2650, cache_salt="tenant-a")
    resp = http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 400, resp.text
    assert f"quota of {QUOTA}" in resp.json()["error"]["message"]
    ok = http.post("/v1/chat/completions", json=chat("Tenant.", "y" * 100, cache_salt="tenant-a"))
    assert ok.status_code == 200, ok.text
    settle(system, http)
