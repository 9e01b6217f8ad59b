"""Admission when the pool has no room, with a real cache service and a real worker: a request
the pool could never hold is refused at once (INVALID_ARGUMENT naming the numbers); one that
waits for room held by a lease that never ends gives up after ``--admission-timeout-s``
(RESOURCE_EXHAUSTED); requests behind it that fit are admitted past it meanwhile."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from gateway.errors import PoolTooSmall, from_status
from kvcache_service.leases import AcquireRequest, Reuse
from kvcache_service.tokens import pack
from kvserve_proto.kvcache.v1 import kvcache_pb2 as kpb
from kvserve_proto.worker.v1 import worker_pb2 as pb
from tests.worker_engine.conftest import AUTH, BS, System, generate, request

BLOCKS = 24


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


async def test_a_request_beyond_the_unpinned_blocks_is_refused_at_once(system: System) -> None:
    stub = await system.add_worker(num_blocks=BLOCKS)
    pinned = prompt(1, 8 * BS)
    await generate(stub, request(pinned, max_tokens=1))
    await system.wait_idle()
    await system.admin.Pin(
        kpb.PinRequest(pool_id="w0", prefix=kpb.PrefixRef(token_ids=pinned)), metadata=AUTH
    )
    # 20 blocks: the pool has 24, but 8 are pinned.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await asyncio.wait_for(generate(stub, request(prompt(2, 19 * BS), max_tokens=1)), 10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "can give at most 16 of its 24 (8 are pinned)" in (err.value.details() or "")
    # The gateway knows these words: another pool may hold the request, so it fails over.
    refusal = from_status(err.value.code(), err.value.details() or "", "w0")
    assert isinstance(refusal, PoolTooSmall) and refusal.held_back and refusal.pool_blocks == 16
    got = await generate(stub, request(prompt(3, 2 * BS), max_tokens=4))  # the worker serves on
    assert len(got["tokens"]) == 4
    await system.admin.Unpin(
        kpb.PinRequest(pool_id="w0", prefix=kpb.PrefixRef(token_ids=pinned)), metadata=AUTH
    )
    await system.wait_idle()


async def test_waiting_for_room_ends_after_the_timeout_and_others_pass(system: System) -> None:
    stub = await system.add_worker(num_blocks=BLOCKS, admission_timeout_s=4.0)
    worker = system.workers[0]
    incarnation = worker.engine.leases.client.incarnation
    # Another lease holds 18 blocks and never ends (the pool heartbeats, so it stays live).
    held, _ = system.authority.acquire(
        AcquireRequest("w0", incarnation, "", pack(prompt(4, 18 * BS), "p"), reuse=Reuse.NONE)
    )
    big = asyncio.create_task(generate(stub, request(prompt(5, 10 * BS), max_tokens=1)))
    for _ in range(200):
        if any(s.no_room_since is not None for s in worker.engine.scheduler.waiting):
            break
        await asyncio.sleep(0.01)
    else:
        raise AssertionError("the big request was never refused room")
    # A small request behind it fits beside the held lease: it is admitted past it.
    small = await asyncio.wait_for(generate(stub, request(prompt(6, BS), max_tokens=4)), 10)
    assert len(small["tokens"]) == 4 and not big.done()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await asyncio.wait_for(big, 30)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "not admitted within 4 s" in (err.value.details() or "")
    system.authority.release("w0", incarnation, held.lease_id)
    await system.wait_idle()


async def test_without_max_tokens_a_request_gets_what_the_pool_holds(system: System) -> None:
    """max_tokens unset (0) is as many as fit, in the context and in the pool: a pool smaller
    than the model's context serves the request to its end instead of refusing it."""
    stub = await system.add_worker(num_blocks=BLOCKS)
    p = prompt(4, 3 * BS)
    got = await generate(stub, request(p, max_tokens=0))
    assert got["last"].finish_reason == pb.FINISH_REASON_LENGTH
    assert len(p) + len(got["tokens"]) == BLOCKS * BS
    await system.wait_idle()
