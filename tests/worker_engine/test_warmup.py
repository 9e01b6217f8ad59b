"""A warmed-up worker: the warm-up runs before the pool is registered, leaves no trace in the
cache service's accounting, and the worker's output still equals mlx-lm's."""

from __future__ import annotations

import logging
import random

import pytest

from tests.worker_engine.conftest import System, generate, request


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


@pytest.mark.parametrize("num_blocks", [256, 12])
async def test_warmed_up_worker_matches_mlx_lm(
    system: System, reference, caplog, num_blocks: int
) -> None:
    caplog.set_level(logging.INFO, logger="worker")
    stub = await system.add_worker(warmup=True, num_blocks=num_blocks)
    messages = [r.getMessage() for r in caplog.records]
    warmed = next(i for i, m in enumerate(messages) if m.startswith("warm-up:"))
    registered = next(i for i, m in enumerate(messages) if m.startswith("registered pool"))
    assert warmed < registered
    stats = await system.stats()
    assert (stats.free_blocks, stats.live_leases) == (num_blocks, 0)
    for seed, n in [(1, 5), (3, 100)]:
        p = prompt(seed, n)
        got = await generate(stub, request(p, max_tokens=24, logprobs=1))
        want_tokens, want_logprobs = reference(p, 24)
        assert got["tokens"] == want_tokens
        assert got["logprobs"] == pytest.approx(want_logprobs, abs=1e-4)
