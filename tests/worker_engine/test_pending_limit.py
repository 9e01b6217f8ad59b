"""A worker's bound on the requests it holds, running + waiting (``--max-pending-requests``):
the request beyond it ends at once with RESOURCE_EXHAUSTED, holding no lease and touching no
model, and the room comes back as requests end."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from kvserve_proto.worker.v1 import worker_pb2 as pb
from kvserve_proto.worker.v1 import worker_pb2_grpc as pb_grpc
from tests.worker_engine.conftest import System, generate, request
from worker.device_defaults import PENDING_PER_BATCH_SLOT


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


async def held(stub: pb_grpc.WorkerStub, running: int, waiting: int) -> pb.WorkerInfo:
    """Waits (up to 5 s) until the worker holds this many requests; its info then."""
    for _ in range(250):
        info = await stub.GetInfo(pb.GetInfoRequest())
        if (info.running, info.waiting) == (running, waiting):
            return info
        await asyncio.sleep(0.02)
    raise AssertionError(f"the worker holds {info.running} + {info.waiting}")


async def test_a_request_beyond_the_limit_is_resource_exhausted(system: System) -> None:
    # A batch of one: the first request runs, the second waits for its slot, the third is over.
    stub = await system.add_worker(max_batch_size=1, max_pending_requests=2, warmup=False)
    running = stub.Generate(request(prompt(1, 40), max_tokens=4000))
    await running.read()  # prefilled and decoding; 4,000 tokens outlast the test
    waiting = stub.Generate(request(prompt(2, 40), max_tokens=8))
    before = await held(stub, running=1, waiting=1)
    assert before.max_pending_requests == 2

    with pytest.raises(grpc.aio.AioRpcError) as e:
        await generate(stub, request(prompt(3, 40), max_tokens=8))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-pending-requests 2" in (e.value.details() or "")
    # Refused before it held anything: no lease, no prefill, still 1 + 1 held.
    after = await held(stub, running=1, waiting=1)
    assert after.prefilled_tokens == before.prefilled_tokens == 40
    assert (await system.stats()).live_leases == 1  # the running request's

    # The room comes back as requests end: cancel the running one, the waiting one runs.
    running.cancel()
    rest = [m async for m in waiting]
    assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert len((await generate(stub, request(prompt(3, 40), max_tokens=8)))["tokens"]) == 8
    await system.wait_idle()


async def test_the_default_limit_scales_with_the_batch(system: System) -> None:
    stub = await system.add_worker(warmup=False)
    info = await stub.GetInfo(pb.GetInfoRequest())
    batch = system.workers[0].engine.limits.max_batch_size
    assert info.max_pending_requests == PENDING_PER_BATCH_SLOT * batch
