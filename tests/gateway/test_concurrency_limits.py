"""Concurrency limits through the gateway, with fake workers that count like real ones.

Per client (``--max-concurrent-per-client``, by peer address, shared by HTTP and gRPC): the
request beyond the limit is 429 in the OpenAI shape with Retry-After (RESOURCE_EXHAUSTED over
gRPC) while another client is served, and the slot comes back however a request ends. Per
worker (``--max-pending-requests``): a busy worker is failed over and never marked unhealthy,
a full one is routed around, and all busy is 429 / RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import AsyncIterator

import grpc
import httpx
import openai
import pytest

from gateway.concurrency import ConcurrencyLimiter, client_of_host, client_of_peer
from gateway.errors import TooManyRequests
from kvcache_service.server import RunningService
from kvserve_proto.worker.v1 import worker_pb2 as pb
from kvserve_proto.worker.v1 import worker_pb2_grpc as pb_grpc
from tests.gateway.conftest import Stack, started_stack, wait_for
from tests.gateway.fake_worker import MODEL, OUTPUT

LIMIT = 2
ME = "127.0.0.1"
# Streams that outlast the test step: 75 tokens, 50 ms apart.
LONG = {"prompt": "Hello", "max_tokens": 500, "stream": True}
SHORT = {"prompt": "hi", "max_tokens": 2}
SYSTEM = "You are the assistant of team A. " * 6
SYSTEM_B = "Team B writes haiku only, never prose, and counts syllables. " * 4


@pytest.fixture
async def limited(cache: RunningService, tokenizer) -> AsyncIterator[Stack]:
    async with started_stack(cache, tokenizer, max_concurrent_per_client=LIMIT) as s:
        for w in s.workers:
            w.behaviour.delay_s = 0.05
        yield s


def _loopback_alias_works() -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.2", 0))
        except OSError:
            return False
    return True


needs_second_address = pytest.mark.skipif(
    not _loopback_alias_works(), reason="no 127.0.0.2 on this loopback (Linux has 127/8)"
)


def other_client(stack: Stack) -> httpx.AsyncClient:
    """Another client: the same gateway, reached from the loopback address 127.0.0.2."""
    transport = httpx.AsyncHTTPTransport(local_address="127.0.0.2")
    return httpx.AsyncClient(base_url=stack.base_url, transport=transport, timeout=10)


def in_flight(stack: Stack, client: str | None = ME) -> int:
    return stack.gateway.gateway.concurrency.in_flight(client)


@contextlib.asynccontextmanager
async def open_streams(stack: Stack, n: int) -> AsyncIterator[list[httpx.Response]]:
    """``n`` streams of this client, each past its first event (so counted and running)."""
    async with contextlib.AsyncExitStack() as opened:
        streams = []
        for _ in range(n):
            resp = await opened.enter_async_context(
                stack.http.stream("POST", "/v1/completions", json=LONG)
            )
            assert resp.status_code == 200
            streams.append(resp)
        yield streams


async def grpc_generate(stack: Stack, max_tokens: int = 2) -> str:
    async with grpc.aio.insecure_channel(stack.gateway.grpc_address) as channel:
        req = pb.GenerateRequest(
            prompt_text="hi", sampling=pb.SamplingParams(max_tokens=max_tokens)
        )
        return "".join([m.text async for m in pb_grpc.WorkerStub(channel).Generate(req)])


def assert_rate_limited(resp: httpx.Response, code: str, *needles: str) -> None:
    assert resp.status_code == 429, resp.text
    assert resp.headers["retry-after"] == "1"
    error = resp.json()["error"]
    assert (error["type"], error["code"]) == ("rate_limit_error", code)
    for needle in needles:
        assert needle in error["message"]


@needs_second_address
async def test_a_client_over_its_limit_is_429_while_another_is_served(limited: Stack):
    async with open_streams(limited, LIMIT):
        sent = sum(len(w.record.requests) for w in limited.workers)
        over = await limited.http.post("/v1/completions", json=SHORT)
        assert_rate_limited(
            over, "too_many_concurrent_requests", f"at most {LIMIT}", "--max-concurrent-per-client"
        )
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert (await limited.http.post("/v1/chat/completions", json=chat)).status_code == 429
        client = limited.openai()
        with pytest.raises(openai.RateLimitError):
            await client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        # gRPC from the same address is the same client.
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await grpc_generate(limited)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-concurrent-per-client" in (e.value.details() or "")
        # Refused before any work: no worker saw them.
        assert sum(len(w.record.requests) for w in limited.workers) == sent

        # Another client is served meanwhile; reads are not counted.
        async with other_client(limited) as other:
            resp = await other.post("/v1/completions", json=SHORT)
            assert resp.status_code == 200
            assert resp.json()["choices"][0]["text"] == OUTPUT[:2]
        assert (await limited.http.get("/v1/models")).status_code == 200
        assert in_flight(limited) == LIMIT
    await wait_for(lambda: in_flight(limited, None) == 0)
    assert (await limited.http.post("/v1/completions", json=SHORT)).status_code == 200


async def test_the_slot_comes_back_however_a_request_ends(limited: Stack):
    # A client that disconnects mid-stream.
    async with limited.http.stream("POST", "/v1/completions", json=LONG) as resp:
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                break  # one token arrived; now hang up
    await wait_for(lambda: in_flight(limited) == 0)
    # A client that gives up on a non-streaming request.
    with pytest.raises(httpx.ReadTimeout):
        await limited.http.post("/v1/completions", json={**LONG, "stream": False}, timeout=0.3)
    await wait_for(lambda: in_flight(limited) == 0)
    # A gRPC client that cancels.
    async with grpc.aio.insecure_channel(limited.gateway.grpc_address) as channel:
        call = pb_grpc.WorkerStub(channel).Generate(
            pb.GenerateRequest(prompt_text="Hello", sampling=pb.SamplingParams(max_tokens=500))
        )
        await call.read()
        assert in_flight(limited) == 1
        call.cancel()
    await wait_for(lambda: in_flight(limited) == 0)

    for w in limited.workers:
        w.behaviour.delay_s = 0.0
    # Bad input, a finished stream, a gRPC call to its end.
    assert (await limited.http.post("/v1/completions", json={"prompt": ""})).status_code == 400
    async with limited.http.stream("POST", "/v1/completions", json=LONG) as resp:
        text = [json.loads(ln[6:]) for ln in [x async for x in resp.aiter_lines()] if "{" in ln]
    assert "".join(e["choices"][0]["text"] for e in text) == OUTPUT
    assert await grpc_generate(limited) == OUTPUT[:2]
    # A worker error before the first token, and one mid-stream.
    for w in limited.workers:
        w.behaviour.fail_with = grpc.StatusCode.INTERNAL
    assert (await limited.http.post("/v1/completions", json=SHORT)).status_code == 500
    for w in limited.workers:
        w.behaviour.fail_after = 2
    async with limited.http.stream("POST", "/v1/completions", json=LONG) as resp:
        assert "server_error" in "".join([x async for x in resp.aiter_lines()])
    assert in_flight(limited, None) == 0

    # Every slot came back: the client may open its whole limit again.
    for w in limited.workers:
        w.behaviour = type(w.behaviour)(delay_s=0.05)
    async with open_streams(limited, LIMIT):
        assert in_flight(limited) == LIMIT


async def test_a_busy_worker_is_failed_over_and_stays_healthy(stack: Stack):
    body = {"messages": [{"role": "system", "content": SYSTEM}], "max_tokens": 2}
    first = await stack.http.post("/v1/chat/completions", json=body)
    holder = next(w for w in stack.workers if w.worker_id == first.headers["x-kvserve-worker"])
    other = next(w for w in stack.workers if w is not holder)

    # The prefix holder is tried first and answers RESOURCE_EXHAUSTED: the other one serves.
    holder.behaviour.fail_with = grpc.StatusCode.RESOURCE_EXHAUSTED
    resp = await stack.http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200
    assert resp.headers["x-kvserve-worker"] == other.worker_id
    assert len(holder.record.requests) == 2  # it was asked
    metrics = (await stack.http.get("/metrics")).text.splitlines()
    failovers = [ln for ln in metrics if ln.startswith("kvserve_gateway_failovers_total{")]
    assert len(failovers) == 1, failovers
    assert f'worker="{holder.worker_id}"' in failovers[0] and "WorkersBusy" in failovers[0]
    assert not stack.gateway.gateway.directory.unhealthy
    assert all(w["healthy"] for w in (await stack.http.get("/health")).json()["workers"])

    # A worker at its limit, as its GetInfo says, is routed around without being asked: the
    # holder of a new prefix takes a stream, its one slot, and the next request goes elsewhere.
    for w in stack.workers:
        w.behaviour = type(w.behaviour)(delay_s=0.05, max_pending=1)
    body = {"messages": [{"role": "system", "content": SYSTEM_B}], "max_tokens": 2}
    first = await stack.http.post("/v1/chat/completions", json=body)
    holder = next(w for w in stack.workers if w.worker_id == first.headers["x-kvserve-worker"])
    other = next(w for w in stack.workers if w is not holder)
    await stack.poll()  # (a poll during `first` saw the holder full)
    long = {**body, "stream": True, "max_tokens": 500}
    async with stack.http.stream("POST", "/v1/chat/completions", json=long) as s:
        assert s.headers["x-kvserve-worker"] == holder.worker_id  # the prefix, and room
        await stack.poll()
        health = {w["worker"]: w for w in (await stack.http.get("/health")).json()["workers"]}
        assert health[holder.worker_id]["max_pending_requests"] == 1
        asked = len(holder.record.requests)
        resp = await stack.http.post("/v1/chat/completions", json=body)
        assert resp.headers["x-kvserve-worker"] == other.worker_id
        assert len(holder.record.requests) == asked
    assert not stack.gateway.gateway.directory.unhealthy


async def test_all_workers_busy_is_429_and_resource_exhausted_over_grpc(stack: Stack):
    for w in stack.workers:
        w.behaviour.delay_s = 0.05
        w.behaviour.max_pending = 1
    async with open_streams(stack, 2) as streams:
        served = {s.headers["x-kvserve-worker"] for s in streams}
        assert served == {"w0", "w1"}  # one each: every worker is full now
        await stack.poll()
        info = await stack_info(stack)
        assert info.max_pending_requests == 2  # the fleet's, summed

        resp = await stack.http.post("/v1/completions", json=SHORT)
        assert_rate_limited(resp, "workers_busy", "--max-pending-requests")
        # Each worker was asked (the gateway's view may be stale) and refused.
        assert all(len(w.record.requests) == 2 for w in stack.workers)
        assert (await stack.http.post("/v1/completions", json=LONG)).status_code == 429
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await grpc_generate(stack)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "busy" in (e.value.details() or "")
        # Busy is not down: nobody is marked, /health stays 200.
        assert not stack.gateway.gateway.directory.unhealthy
        assert (await stack.http.get("/health")).status_code == 200
    await wait_for(lambda: all(w.pending == 0 for w in stack.workers))
    assert (await stack.http.post("/v1/completions", json=SHORT)).status_code == 200


# A real worker's words for a request its KV pool had no room for within --admission-timeout-s
# (worker.engine.lease_sync), and for one it refused at its --max-pending-requests.
NOT_ADMITTED = (
    "not admitted within 120 s: the worker's KV pool had no room for its 5000 tokens, and none "
    "came back meanwhile (held by running requests, pinned prefixes or a namespace quota); "
    "retry later"
)


async def test_not_admitted_says_the_pool_had_no_room_not_the_pending_limit(stack: Stack):
    """A request that waited a worker's --admission-timeout-s for KV blocks is told so
    (kv_pool_full, the worker's own reason), not that the workers hold their
    --max-pending-requests: that is said only when it is what they said."""
    for w in stack.workers:
        w.behaviour.fail_with = grpc.StatusCode.RESOURCE_EXHAUSTED
        w.behaviour.fail_message = NOT_ADMITTED
    resp = await stack.http.post("/v1/completions", json=SHORT)
    assert_rate_limited(resp, "kv_pool_full", "not admitted within 120 s", "no room")
    assert "max-pending" not in resp.json()["error"]["message"]
    assert all(len(w.record.requests) == 1 for w in stack.workers)  # each one tried
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await grpc_generate(stack)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "not admitted within 120 s" in (e.value.details() or "")

    # One at its pending limit, one without room: the pool's reason is the one to act on.
    stack.workers[
        0
    ].behaviour.fail_message = "this worker holds 9 requests (--max-pending-requests 9)"
    resp = await stack.http.post("/v1/completions", json=SHORT)
    assert_rate_limited(resp, "kv_pool_full", "not admitted within 120 s")
    # Both at their limit: the pending-limit message, as before.
    stack.workers[1].behaviour.fail_message = stack.workers[0].behaviour.fail_message
    resp = await stack.http.post("/v1/completions", json=SHORT)
    assert_rate_limited(resp, "workers_busy", "--max-pending-requests")
    # Something else (gRPC's own RESOURCE_EXHAUSTED, say): the worker's words, no guess.
    for w in stack.workers:
        w.behaviour.fail_message = "Received message larger than max (5 vs. 4)"
    resp = await stack.http.post("/v1/completions", json=SHORT)
    assert_rate_limited(resp, "workers_busy", "larger than max")
    assert "max-pending" not in resp.json()["error"]["message"]
    assert not stack.gateway.gateway.directory.unhealthy


async def stack_info(stack: Stack) -> pb.WorkerInfo:
    async with grpc.aio.insecure_channel(stack.gateway.grpc_address) as channel:
        return await pb_grpc.WorkerStub(channel).GetInfo(pb.GetInfoRequest())


def test_the_limiter_counts_per_client_and_in_all():
    limiter = ConcurrencyLimiter(per_client=2, total=3)
    limiter.acquire("a")
    limiter.acquire("a")
    with pytest.raises(TooManyRequests) as e:
        limiter.acquire("a")
    assert e.value.code == "too_many_concurrent_requests"
    limiter.acquire("b")
    with pytest.raises(TooManyRequests) as e:
        limiter.acquire("c")  # a fresh client, but the gateway is at its total
    assert e.value.code == "server_busy"
    for client in ("a", "a", "b"):
        limiter.release(client)
    assert limiter.in_flight() == 0 and not limiter._by_client  # no key left behind
    unlimited = ConcurrencyLimiter(per_client=0, total=0)
    for _ in range(1000):
        unlimited.acquire("a")
    assert unlimited.in_flight("a") == 1000


@pytest.mark.parametrize(
    ("peer", "client"),
    [
        ("ipv4:127.0.0.1:50123", "127.0.0.1"),
        ("ipv6:[::1]:50123", "::1"),
        ("ipv6:%5B::1%5D:50123", "::1"),
        ("ipv6:[::ffff:10.0.0.7]:50123", "10.0.0.7"),
        ("unix:/tmp/gateway.sock", "unix:/tmp/gateway.sock"),
    ],
)
def test_a_grpc_peer_names_the_client_as_http_does(peer: str, client: str):
    assert client_of_peer(peer) == client
    if client[0].isdigit() or client == "::1":
        assert client_of_host(client) == client
    assert client_of_host("::ffff:10.0.0.7") == "10.0.0.7"
    assert client_of_host(None) == "unknown"
