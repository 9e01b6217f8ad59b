"""Failures never poison the cache and never take a worker down: a step that raises after it
wrote K/V ends its requests with INTERNAL, publishes none of its blocks, frees them, and the
worker serves the next request exactly; a cache service that forgot the pool is answered by
re-registering, decided by the status code alone."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from kvserve_proto.kvcache.v1 import kvcache_pb2 as kpb
from kvserve_proto.worker.v1 import worker_pb2 as pb
from tests.worker_engine.conftest import AUTH, BS, System, generate, request
from worker.engine.step import Step
from worker.errors import (
    BatchError,
    CacheRejected,
    Cancelled,
    InvalidRequest,
    ShuttingDown,
    StepFailed,
)
from worker.model.forward_batch import SeqInput
from worker.servicer import status_of

VOCAB = 256


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def test_the_error_table() -> None:
    code = grpc.StatusCode
    assert status_of(InvalidRequest("bad")) == code.INVALID_ARGUMENT
    assert status_of(Cancelled("gone")) == code.CANCELLED
    assert status_of(ShuttingDown("bye")) == code.UNAVAILABLE
    assert status_of(StepFailed("bug")) == code.INTERNAL
    assert status_of(CacheRejected("bug")) == code.INTERNAL
    assert status_of(BatchError("bug")) == code.INTERNAL  # not in the table: internal


def inject(system: System, where: str, target: list[int], failed_at: list[int]) -> None:
    """Makes the step that computes the last chunk of `target`'s prompt fail once, after its
    forward wrote the pool: in the runner right after the forward (`forward`), or in the
    engine's bookkeeping after postprocess advanced the sequences (`postprocess`)."""
    engine = system.workers[0].engine
    n = len(target)
    if where == "forward":
        runner = engine.executor.runner
        real_forward = runner.forward

        def forward(seqs: list[SeqInput]):
            logits = real_forward(seqs)  # evaluated together with the pool: the KV is written
            last = [
                s.start for s in seqs if len(s.token_ids) > 1 and s.start + len(s.token_ids) == n
            ]
            if last and not failed_at:
                failed_at.append(last[0])
                raise RuntimeError("injected: a forward that wrote the pool, then failed")
            return logits

        runner.forward = forward  # type: ignore[method-assign]
    else:
        real_postprocess = engine.scheduler.postprocess

        def postprocess(step: Step, sampled):
            finished = real_postprocess(step, sampled)
            for item in step.items:
                last = item.seq.prompt == target and item.start + len(item.token_ids) == n
                if last and not failed_at:
                    failed_at.append(item.start)
                    raise RuntimeError("injected: a bug after the step's postprocess")
            return finished

        engine.scheduler.postprocess = postprocess  # type: ignore[method-assign]


async def settled(system: System) -> kpb.PoolStats:
    """The pool's stats once every lease is released (releases are sent in the background)."""
    for _ in range(200):
        stats = await system.stats()
        if stats.live_leases == 0:
            return stats
        await asyncio.sleep(0.02)
    raise AssertionError(f"leases still live: {stats}")


@pytest.mark.parametrize("where", ["forward", "postprocess"])
async def test_a_failed_step_publishes_nothing_and_the_worker_serves_on(
    system: System, reference, where: str
) -> None:
    stub = await system.add_worker(warmup=False)  # 16-token blocks, 64-token prefill chunks
    engine = system.workers[0].engine
    p = prompt(70, 100)  # 7 blocks, prefilled in chunks of at most 64 tokens: the last fails
    before = await settled(system)
    failed_at: list[int] = []
    inject(system, where, p, failed_at)

    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(stub, request(p, max_tokens=8))
    assert err.value.code() == grpc.StatusCode.INTERNAL, err.value.details()
    [start] = failed_at
    committed = start // BS * BS  # full blocks written by the steps before the failing one
    assert 0 < committed < (len(p) - 1) // BS * BS, "the failing step must complete a block"

    # The index holds exactly what was committed before the failing step.
    after = await settled(system)
    found = await system.admin.Lookup(
        kpb.LookupRequest(pool_id="w0", prompt_token_ids=p), metadata=AUTH
    )
    assert found.pools[0].cached_tokens == committed
    assert (after.referenced_blocks, after.indexed_blocks) == (0, committed // BS)
    # No block leaked: the failed step's blocks are free again, only the committed are cached.
    assert after.free_blocks == before.free_blocks - committed // BS
    assert after.free_blocks + after.cached_blocks == after.num_blocks
    await system.check()

    # The worker is up: its loops run, and it serves the next requests exactly.
    assert not any(t.done() for t in [engine._task, *engine.leases._tasks])
    q = prompt(71, 40)
    assert (await generate(stub, request(q, max_tokens=8)))["tokens"] == reference(q, 8)[0]
    again = await generate(stub, request(p, max_tokens=8))
    assert again["last"].usage.cached_tokens == committed
    assert again["tokens"] == reference(p, 8)[0]
    info = await stub.GetInfo(pb.GetInfoRequest())
    assert (info.running, info.waiting) == (0, 0)


async def test_a_cache_service_that_forgot_the_pool_is_answered_by_registering(
    system: System, reference
) -> None:
    """FAILED_PRECONDITION (not a message to parse) tells the worker to register again."""
    stub = await system.add_worker(warmup=False)
    engine = system.workers[0].engine
    first = engine.leases.client.incarnation
    system.authority.pools.clear()  # as after a restart of the cache service
    system.authority._live.clear()
    p = prompt(80, 30)
    assert (await generate(stub, request(p, max_tokens=6)))["tokens"] == reference(p, 6)[0]
    assert engine.leases.client.incarnation != first
