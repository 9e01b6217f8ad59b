"""A worker's warm-up runs in the background once it serves: on scratch blocks no lease can
name, only between requests, leaving no trace in the cache service's accounting; requests
served before, during and after it equal mlx-lm's."""

from __future__ import annotations

import asyncio
import logging
import random

import pytest

from tests.worker_engine.conftest import System, generate, request


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


@pytest.mark.parametrize("num_blocks", [256, 12])
async def test_warm_up_runs_after_ready_between_requests(
    system: System, reference, caplog, num_blocks: int
) -> None:
    caplog.set_level(logging.INFO, logger="worker")
    stub = await system.add_worker(warmed=False, warmup=True, num_blocks=num_blocks)
    worker = system.workers[-1]
    assert worker.warming is not None
    executor = worker.engine.executor
    runner = executor.runner
    scratch = runner.num_blocks - num_blocks
    assert scratch >= 1  # the pool holds the warm-up's blocks beyond what it registered
    seen: list[tuple[int, set[int]]] = []
    real = executor.run_batch

    async def run_batch(inputs, copies, samples, speculations=()):
        blocks = {b for s in inputs for b in s.block_table} | {b for p in copies for b in p}
        seen.append((worker.engine.held_requests, blocks))
        return await real(inputs, copies, samples, speculations)

    executor.run_batch = run_batch  # type: ignore[method-assign]
    # Requests while the warm-up runs: served, and equal to mlx-lm.
    prompts = [prompt(seed, n) for seed, n in [(1, 5), (3, 100), (4, 40)]]
    got = await asyncio.gather(
        *(generate(stub, request(p, max_tokens=24, logprobs=1)) for p in prompts)
    )
    await worker.warming
    for p, g in zip(prompts, got, strict=True):
        want_tokens, want_logprobs = reference(p, 24)
        assert g["tokens"] == want_tokens
        assert g["logprobs"] == pytest.approx(want_logprobs, abs=1e-4)
    messages = [r.getMessage() for r in caplog.records]
    registered = next(i for i, m in enumerate(messages) if m.startswith("registered pool"))
    warmed = next(i for i, m in enumerate(messages) if m.startswith("warm-up:"))
    assert registered < warmed  # ready first, warmed after
    # Every warm-up forward ran on scratch blocks, with no request held.
    assert seen and all(held == 0 for held, _ in seen)
    assert all(num_blocks <= b < num_blocks + scratch for _, blocks in seen for b in blocks)
    stats = await system.wait_idle()
    assert (stats.free_blocks + stats.cached_blocks, stats.live_leases) == (num_blocks, 0)
