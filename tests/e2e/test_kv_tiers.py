"""The disk tier with real processes: the whole system stopped and started again serves a long
prompt from disk; a worker killed (-9) while it spills comes back with nothing half-written and
answers exactly what a cold system answers."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import httpx
import mlx.core as mx
import pytest

from kvserve_launch.process import KeptLines
from tests.e2e.conftest import ADMIN_TOKEN, STARTUP_TIMEOUT_S, started_system
from tests.e2e.test_faults import port, respawn

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}
BS = 32  # the launcher's workers' default block size


def long_prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(n)]


def complete(base: str, prompt: list[int], max_tokens: int = 12) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=base, timeout=120) as client:
        r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    return {"text": out["choices"][0]["text"], "cached": cached_of(out)}


def cached_of(body: dict) -> int:
    return body["usage"].get("prompt_tokens_details", {}).get("cached_tokens") or 0


def admin(base: str, method: str, path: str, **body) -> dict:
    with httpx.Client(base_url=base, timeout=60, headers=ADMIN) as client:
        r = client.request(method, f"/admin/cache{path}", json=body or None)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(autouse=True)
def always_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """The workers load granted blocks whatever loading measures against computing here (a
    timing; these tests are about what loads, not when it pays). The launcher's children
    inherit the environment."""
    monkeypatch.setenv("KVWORKER_TIER_LOAD", "always")


def test_a_full_restart_serves_a_long_prompt_from_the_disk_tier(tmp_path: Path) -> None:
    prompt = long_prompt(1, 1500)
    logs = KeptLines(5_000)
    fixture = started_system(logs, workers=1, offload_dir=str(tmp_path))
    system = next(fixture)
    try:
        cold = complete(f"http://{system.http_address}", prompt)
        assert cold["cached"] == 0
    finally:
        fixture.close()  # every process stops; the disk tier stays
    assert list(tmp_path.glob("worker-0/*/*.kvb")), "nothing was spilled"
    fixture = started_system(logs, workers=1, offload_dir=str(tmp_path))
    system = next(fixture)
    try:
        base = f"http://{system.http_address}"
        warm = complete(base, prompt)
        assert warm["text"] == cold["text"]
        assert warm["cached"] == (len(prompt) - 1) // BS * BS  # all but the last block, loaded
        assert admin(base, "GET", "/check")["ok"]
    finally:
        fixture.close()


@pytest.mark.skipif(mx.default_device() == mx.gpu, reason="the CPU ring group; GPUs: NCCL")
def test_a_worker_groups_disk_tier_serves_any_group_size(tmp_path: Path) -> None:
    """A 2-rank worker group spills whole blocks (every rank's KV heads, gathered on rank 0);
    after a full stop a one-process worker serves the prompt from those files, and a group
    started again loads them too (each rank its own slice): the text is the cold group's."""
    prompt = long_prompt(3, 1500)
    logs = KeptLines(5_000)
    answers = []
    for tensor_parallel in (2, 1, 2):
        fixture = started_system(
            logs, workers=1, offload_dir=str(tmp_path), tensor_parallel=tensor_parallel
        )
        system = next(fixture)
        try:
            base = f"http://{system.http_address}"
            answers.append(complete(base, prompt))
            assert admin(base, "GET", "/check")["ok"]
        finally:
            fixture.close()
        assert list(tmp_path.glob("worker-0/*/*.kvb")), "nothing was spilled"
    cold, one, group = answers
    assert cold["cached"] == 0
    for warm in (one, group):
        assert warm["text"] == cold["text"]
        assert warm["cached"] == (len(prompt) - 1) // BS * BS  # all but the last block, loaded


def test_a_worker_killed_while_it_spills_comes_back_clean(tmp_path: Path) -> None:
    logs = KeptLines(5_000)
    fixture = started_system(logs, workers=1, offload_dir=str(tmp_path))
    system = next(fixture)
    try:
        base = f"http://{system.http_address}"
        prompt = long_prompt(2, 3000)
        # Killed while the prompt's blocks are being written: a long prefill spills as it goes.
        t = threading.Thread(
            target=lambda: httpx.post(
                f"{base}/v1/completions",
                json={"prompt": prompt, "max_tokens": 200, "ignore_eos": True},
                timeout=120,
            )
        )
        t.start()
        for _ in range(400):
            if list(tmp_path.glob("worker-0/*/*.kvb")):
                break
            threading.Event().wait(0.01)
        system.workers[0].kill()
        t.join(120)
        system.workers[0] = respawn(
            system.workers[0], **{"--port": port(system.worker_addresses[0])}
        )
        system.workers[0].wait_ready(STARTUP_TIMEOUT_S)
        assert not list(tmp_path.glob("worker-0/*/*.tmp")), "a half-written block survived"
        after = None
        for _ in range(60):  # the gateway finds the worker again
            try:
                after = complete(base, prompt)
                break
            except AssertionError:
                threading.Event().wait(0.5)
        assert after is not None
        # A cold answer: the pool and the tier flushed, everything computed.
        admin(base, "POST", "/flush", pool="worker-0")
        admin(base, "POST", "/flush", pool="worker-0", tier="disk")
        cold = complete(base, prompt)
        assert cold["cached"] == 0
        assert after["text"] == cold["text"]
        assert admin(base, "GET", "/check")["ok"]
    finally:
        fixture.close()
