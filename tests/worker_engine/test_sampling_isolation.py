"""Sampling cannot poison a batch: bad values are refused before batching, a row whose
sampling fails ends alone, and no request touches MLX's global random state."""

from __future__ import annotations

import asyncio
import random

import grpc
import mlx.core as mx
import pytest

from kvserve_model.sampling_limits import INT32_MAX
from kvserve_proto.worker.v1 import worker_pb2 as pb
from tests.worker_engine.conftest import System, generate, request
from worker.model.sampling import RowSampler


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(n)]


def sampled(p: list[int], **kw) -> pb.GenerateRequest:
    return request(p, max_tokens=kw.pop("max_tokens", 12), temperature=1.0, **kw)


async def ten_sampled_requests_succeed(stub) -> None:
    outs = await asyncio.gather(*(generate(stub, sampled(prompt(i, 6))) for i in range(10)))
    assert all(len(o["tokens"]) == 12 for o in outs)


async def test_top_k_beyond_the_vocabulary_is_invalid_argument(system: System) -> None:
    stub = await system.add_worker()
    vocab = (await stub.GetInfo(pb.GetInfoRequest())).vocab_size
    for top_k in (vocab + 1, INT32_MAX):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await generate(stub, sampled(prompt(1, 6), top_k=top_k))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "top_k" in (info.value.details() or "")
    # top_k == vocab keeps every token: accepted, and the same as top_k off.
    full = await generate(stub, sampled(prompt(2, 6), top_k=vocab, seed=3))
    off = await generate(stub, sampled(prompt(2, 6), seed=3))
    assert full["tokens"] == off["tokens"]
    await ten_sampled_requests_succeed(stub)


async def test_a_row_whose_sampling_fails_ends_alone(
    system: System, reference, monkeypatch: pytest.MonkeyPatch
) -> None:
    stub = await system.add_worker()
    p = prompt(5, 10)
    seeded = [sampled(p, seed=s, max_tokens=16) for s in (11, 12, 13)]
    alone = [await generate(stub, r) for r in seeded]
    greedy = request(p, max_tokens=16, logprobs=1)  # logprobs: sampled row by row, too

    real = RowSampler.uniform
    POISON = 666

    def uniform(self: RowSampler, position: int) -> float:
        if self.params.seed == POISON and position == 3:
            raise RuntimeError("injected sampler failure")
        return real(self, position)

    monkeypatch.setattr(RowSampler, "uniform", uniform)
    bad = sampled(p, seed=POISON, max_tokens=16)
    results = await asyncio.gather(
        generate(stub, bad),
        generate(stub, greedy),
        *(generate(stub, r) for r in seeded),
        return_exceptions=True,
    )
    failed, got_greedy, *got_seeded = results
    assert isinstance(failed, grpc.aio.AioRpcError)
    assert failed.code() == grpc.StatusCode.INTERNAL
    assert "sampling failed" in (failed.details() or "")
    assert not isinstance(got_greedy, BaseException)
    assert got_greedy["tokens"] == reference(p, 16)[0]
    for got, want in zip(got_seeded, alone, strict=True):
        assert not isinstance(got, BaseException)
        assert got["tokens"] == want["tokens"]
    await ten_sampled_requests_succeed(stub)
    for _ in range(100):  # releases are sent in the background
        stats = await system.stats()
        if (stats.live_leases, stats.referenced_blocks) == (0, 0):
            break
        await asyncio.sleep(0.02)
    assert (stats.live_leases, stats.referenced_blocks) == (0, 0)


async def test_unseeded_sampling_leaves_the_global_random_state_alone(system: System) -> None:
    stub = await system.add_worker()
    mx.random.seed(123)
    expected = mx.random.uniform(shape=(4,)).tolist()
    mx.random.seed(123)
    outs = await asyncio.gather(
        *(generate(stub, sampled(prompt(7, 8))) for _ in range(4)),
        generate(stub, sampled(prompt(7, 8), seed=5)),
    )
    assert mx.random.uniform(shape=(4,)).tolist() == expected
    # Unseeded requests still draw independently: four identical requests do not all agree.
    assert len({tuple(o["tokens"]) for o in outs[:4]}) > 1
