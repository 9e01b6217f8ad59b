"""Liveness does not depend on how long a forward takes.

A real cache service with a 2 s lease TTL (in process, on loopback), a real worker and model,
and every forward slowed down on the MLX thread in proportion to its padded tokens, the way
compute scales. Three kinds of slow: `sleep` (the GIL is free, only the step is long), `python`
(a Python loop: the interpreter hands the GIL over every 5 ms) and `gil` (a C call that keeps
the GIL: no other Python thread runs until it returns, so the event loop, gRPC and the
in-process cache service all stop). With --max-step-tokens 512 the 400-token prompt would be one
3.2 s step; it must be chunked so that each step stays well inside the TTL, and the pool must
never miss its deadline: no lease expires, no re-registration, the block accounting intact.
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import time
from collections.abc import AsyncIterator, Callable

import pytest

from tests.worker_engine.conftest import System, generate, request, started_system
from tests.worker_engine.test_engine import prompt
from worker.engine.lease import Fenced
from worker.engine.step_budget import TTL_FRACTION
from worker.model.loader import LoadedModel

TTL_S = 2.0
S_PER_TOKEN = 0.008  # slow-down per padded token of a forward
_libc = ctypes.PyDLL(None)  # a PyDLL's functions run with the GIL held


def hold_gil(seconds: float) -> None:
    _libc.usleep(int(seconds * 1e6))


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


SLOW: dict[str, Callable[[float], None]] = {"sleep": time.sleep, "python": spin, "gil": hold_gil}
PROMPT = prompt(80, 400)


@pytest.fixture(scope="module")
def expected(reference) -> list[int]:
    return reference(PROMPT, 8)[0]


@pytest.fixture
async def short_ttl(model: LoadedModel) -> AsyncIterator[System]:
    async with started_system(model, lease_ttl_s=TTL_S, sweep_interval_s=0.1) as s:
        yield s


@pytest.mark.parametrize("kind", list(SLOW))
async def test_a_slow_long_prefill_keeps_the_pool_alive(
    short_ttl: System, expected: list[int], monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    system = short_ttl
    stub = await system.add_worker(max_step_tokens=512)
    engine = system.workers[0].engine
    assert engine.leases.client.heartbeat_interval_s <= TTL_S / 4
    runner, slow = engine.executor.runner, SLOW[kind]
    forward, delays = runner.forward, []

    def slow_forward(seqs):
        delays.append(S_PER_TOKEN * len(seqs) * max(len(s.token_ids) for s in seqs))
        slow(delays[-1])
        return forward(seqs)

    monkeypatch.setattr(runner, "forward", slow_forward)
    # Every call of the pool renews its deadline (CacheAuthority._pool): time them there.
    renewals: list[float] = []
    pool_of = system.authority._pool

    def renewing(pool_id, incarnation):
        renewals.append(time.monotonic())
        return pool_of(pool_id, incarnation)

    monkeypatch.setattr(system.authority, "_pool", renewing)
    registrations: list[int] = []
    register = engine.leases.client.register

    async def counted(reg):
        registrations.append(await register(reg))
        return registrations[-1]

    monkeypatch.setattr(engine.leases.client, "register", counted)
    before = await system.stats()

    async with asyncio.timeout(20):  # ~5 s; a pool that keeps expiring recomputes forever
        out = await generate(stub, request(PROMPT, max_tokens=8))

    assert out["tokens"] == expected
    assert max(delays) <= TTL_FRACTION * TTL_S  # chunked: no step near the TTL
    gaps = [b - a for a, b in itertools.pairwise(renewals)]
    assert max(gaps) < 0.75 * TTL_S, f"silent for {max(gaps):.2f}s"
    after = await system.stats()
    assert (after.incarnation, after.expired_leases, after.alive) == (before.incarnation, 0, True)
    assert registrations == []  # never fenced, never registered again


async def test_a_stale_fenced_answer_does_not_register_again(system: System) -> None:
    """An answer to a call sent before the latest registration says nothing about the current
    incarnation; acting on it would fence off the new incarnation's calls in flight, whose
    answers would do it again."""
    stub = await system.add_worker()
    engine = system.workers[0].engine
    first = (await system.stats()).incarnation
    engine.leases._on_lease_error(Fenced("fenced off", incarnation=first - 1))
    await asyncio.sleep(0.3)
    assert (await system.stats()).incarnation == first
    engine.leases._on_lease_error(Fenced("fenced off", incarnation=first))
    for _ in range(100):
        if (await system.stats()).incarnation != first:
            break
        await asyncio.sleep(0.02)
    assert engine.leases.client.incarnation == (await system.stats()).incarnation != first
    assert len((await generate(stub, request(prompt(81, 20), max_tokens=4)))["tokens"]) == 4
