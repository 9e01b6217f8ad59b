"""``GenerateMany``: many requests over one call, on a real worker and cache service. Tokens
equal the dense mlx-lm path's; a request's refusal or cancellation ends that request only;
the call's end aborts the rest; every test ends with the block accounting intact
(``started_system`` checks integrity) and no block referenced."""

from __future__ import annotations

import asyncio
import random
from collections import defaultdict
from collections.abc import AsyncIterator

import grpc
import pytest

from kvserve_proto.worker.v1 import worker_pb2 as pb
from tests.worker_engine.conftest import System, request


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


class Client:
    """A GenerateMany call with its request side as a queue; collects every update."""

    def __init__(self, stub) -> None:
        self.outbox: asyncio.Queue[pb.GenerateManyRequest | None] = asyncio.Queue()
        self.call = stub.GenerateMany(self._requests())
        self.tokens: dict[int, list[int]] = defaultdict(list)
        self.last: dict[int, pb.GenerateResponse] = {}
        self.errors: dict[int, pb.StreamError] = {}
        self.sizes: list[int] = []  # updates per message

    async def _requests(self) -> AsyncIterator[pb.GenerateManyRequest]:
        while (msg := await self.outbox.get()) is not None:
            yield msg

    def start(self, stream: int, req: pb.GenerateRequest) -> None:
        self.outbox.put_nowait(pb.GenerateManyRequest(stream=stream, start=req))

    def cancel(self, stream: int) -> None:
        self.outbox.put_nowait(pb.GenerateManyRequest(stream=stream, cancel=True))

    async def read_until(self, done) -> None:
        while not done():
            msg = await self.call.read()
            assert msg is not grpc.aio.EOF, "the call ended early"
            self.sizes.append(len(msg.updates))
            for u in msg.updates:
                assert u.stream not in self.errors and u.stream not in self.last, "after its end"
                if u.WhichOneof("kind") == "error":
                    self.errors[u.stream] = u.error
                else:
                    self.tokens[u.stream] += u.response.token_ids
                    if u.response.finish_reason:
                        self.last[u.stream] = u.response

    def ended(self, *streams: int):
        return lambda: all(s in self.last or s in self.errors for s in streams)


async def test_many_requests_share_a_call_and_each_matches_mlx_lm(
    system: System, reference
) -> None:
    stub = await system.add_worker()
    client = Client(stub)
    prompts = {s: prompt(s, 10 + 7 * s) for s in range(1, 6)}
    for s, p in prompts.items():
        client.start(s, request(p, max_tokens=24))
    await client.read_until(client.ended(*prompts))
    for s, p in prompts.items():
        assert client.tokens[s] == reference(p, 24)[0]
        assert client.last[s].usage.completion_tokens == 24
    assert max(client.sizes) > 1, "a step's tokens for several requests share a message"
    client.outbox.put_nowait(None)  # done sending: the call ends
    assert await client.call.read() is grpc.aio.EOF
    assert await client.call.code() == grpc.StatusCode.OK
    await system.wait_idle()


async def test_a_refused_request_ends_alone(system: System, reference) -> None:
    stub = await system.add_worker()
    client = Client(stub)
    good = prompt(7, 20)
    client.start(1, request(good, max_tokens=12))
    client.start(2, request([], max_tokens=4))  # empty prompt
    client.start(3, request(prompt(8, 5), max_tokens=10**6))  # past the context
    await client.read_until(client.ended(1, 2, 3))
    assert client.errors[2].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "empty" in client.errors[2].message
    assert client.errors[3].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert client.tokens[1][:12] == reference(good, 12)[0]
    client.outbox.put_nowait(None)
    assert await client.call.read() is grpc.aio.EOF
    await system.wait_idle()


@pytest.mark.parametrize("bad", ["reused stream", "no action"])
async def test_a_message_no_client_may_send_ends_the_call(system: System, bad: str) -> None:
    stub = await system.add_worker()
    client = Client(stub)
    client.start(1, request(prompt(4, 20), max_tokens=2000))
    await client.read_until(lambda: client.tokens[1])
    if bad == "reused stream":
        client.start(1, request(prompt(5, 20), max_tokens=4))
    else:
        client.outbox.put_nowait(pb.GenerateManyRequest(stream=2))
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await client.read_until(lambda: False)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert ("in use" if bad == "reused stream" else "neither") in (e.value.details() or "")
    await system.wait_idle()  # request 1 was aborted with the call


async def test_cancel_one_request_and_end_the_call_on_the_rest(system: System) -> None:
    stub = await system.add_worker()
    client = Client(stub)
    client.start(1, request(prompt(1, 30), max_tokens=2000))
    client.start(2, request(prompt(2, 30), max_tokens=2000))
    await client.read_until(lambda: client.tokens[1] and client.tokens[2])
    client.cancel(1)
    seen = len(client.tokens[2])
    await client.read_until(lambda: len(client.tokens[2]) > seen + 4)  # 2 goes on
    assert 1 not in client.last and 1 not in client.errors
    client.call.cancel()  # the gateway went away: the worker aborts request 2 too
    await system.wait_idle()
    # The worker keeps serving new calls.
    again = Client(stub)
    again.start(1, request(prompt(3, 8), max_tokens=4))
    await again.read_until(again.ended(1))
    assert len(again.tokens[1]) == 4
    again.outbox.put_nowait(None)
    await system.wait_idle()


@pytest.mark.parametrize("interval", [3])
async def test_stream_interval_holds_tokens_back(system: System, reference, interval) -> None:
    stub = await system.add_worker(stream_interval=interval)
    client = Client(stub)
    p = prompt(9, 12)
    updates: list[int] = []
    client.start(1, request(p, max_tokens=14))
    while 1 not in client.last:
        msg = await client.call.read()
        for u in msg.updates:
            updates.append(len(u.response.token_ids))
            client.tokens[1] += u.response.token_ids
            if u.response.finish_reason:
                client.last[1] = u.response
    assert client.tokens[1] == reference(p, 14)[0]
    assert updates[0] == 1  # the first token alone, at once
    assert all(n >= interval for n in updates[1:-1]), updates
    client.outbox.put_nowait(None)
    await system.wait_idle()


async def test_bytes_that_do_not_parse_end_the_call_invalid_argument(system: System) -> None:
    await system.add_worker()
    good = pb.GenerateManyRequest(stream=1, start=request(prompt(6, 20), max_tokens=2000))
    async with grpc.aio.insecure_channel(system.workers[-1].address) as channel:
        call = channel.stream_stream("/worker.v1.Worker/GenerateMany")(
            iter([good.SerializeToString(), b"\xff\xff\xff"])
        )
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in call:
                pass
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "does not parse" in (e.value.details() or "")
    await system.wait_idle()  # the request it had started was aborted
