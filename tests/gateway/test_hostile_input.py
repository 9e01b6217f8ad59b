"""Issue 10 (hostile input): big prompts never block the event loop, sizes and names are
bounded on both edges, the bearer scheme is case-insensitive, dead workers' load is stale."""

from __future__ import annotations

import asyncio
import gc
import logging
import statistics
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import httpx
import pytest

from gateway.server import running
from gateway.tokenizer import Tokenizer
from kvcache_service.server import RunningService
from kvserve_proto.worker.v1 import worker_pb2 as pb
from kvserve_proto.worker.v1 import worker_pb2_grpc as pb_grpc
from tests.gateway.conftest import Stack, gateway_config
from tests.gateway.fake_worker import FakeWorker
from worker.engine.outage import Outage


async def generate(stack: Stack, req: pb.GenerateRequest) -> grpc.StatusCode:
    async with grpc.aio.insecure_channel(stack.gateway.grpc_address) as channel:
        try:
            async for _ in pb_grpc.WorkerStub(channel).Generate(req):
                pass
        except grpc.aio.AioRpcError as e:
            return e.code()
    return grpc.StatusCode.OK


@pytest.fixture
async def big_stack(cache: RunningService, tokenizer: Tokenizer) -> AsyncIterator[Stack]:
    """A gateway that accepts prompts up to its whole 4 MB body limit."""
    worker = await FakeWorker("w0", cache.address).start()
    config = gateway_config(cache.address, max_prompt_chars=4 * 1024 * 1024, api_key="k3y")
    try:
        async with (
            running(config, tokenizer) as gw,
            httpx.AsyncClient(base_url=f"http://{gw.http_address}", timeout=60) as http,
        ):
            yield Stack(cache, [worker], gw, http)
    finally:
        await worker.close()


class GcPauses:
    """The garbage collector's pauses while in use, as (generation, seconds): a test that
    times the event loop says when a pause of its own process's collector was in the window."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float]] = []
        self._start = 0.0

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.pauses.append((info["generation"], round(time.perf_counter() - self._start, 3)))

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def __str__(self) -> str:
        return f"collector pauses over 10 ms: {[p for p in self.pauses if p[1] > 0.01]}"


class SignallingHF:
    """A tokenizer that says when an encode starts and ends, then encodes for real."""

    def __init__(self, hf: Any) -> None:
        self._hf = hf
        self.started = threading.Event()
        self.finished = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._hf, name)

    def encode(self, text: str, **kwargs: Any) -> Any:
        if len(text) < 100_000:
            return self._hf.encode(text, **kwargs)
        self.started.set()
        try:
            return self._hf.encode(text, **kwargs)
        finally:
            self.finished.set()


async def tokenize_on_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """The old behaviour: every tokenizer call on the event loop, whatever its size."""

    async def encode_async(self: Tokenizer, text: str) -> list[int]:
        return self.encode(text)

    async def template_async(self: Tokenizer, messages: Any, chars: int, **kw: Any) -> list[int]:
        return self.apply_chat_template(messages, **kw)

    monkeypatch.setattr(Tokenizer, "encode_async", encode_async)
    monkeypatch.setattr(Tokenizer, "apply_chat_template_async", template_async)


@pytest.mark.parametrize(
    "on_loop",
    [False, pytest.param(True, marks=pytest.mark.xfail(strict=True, raises=AssertionError))],
)
@pytest.mark.parametrize("entry", ["completions", "chat", "grpc"])
async def test_health_answers_while_a_huge_prompt_is_tokenized(
    cache: RunningService,
    tokenizer: Tokenizer,
    monkeypatch: pytest.MonkeyPatch,
    entry: str,
    on_loop: bool,
) -> None:
    """/health is probed *while* the tokenizer works on a 1.1 MB prompt (~0.7 s of encoding):
    at least 5 probes are answered meanwhile, each in well under the tokenizing time. With tokenizing forced back onto the loop (``on_loop``, the
    old code) no probe gets in until it is over: strictly expected to fail."""
    if on_loop:
        await tokenize_on_the_loop(monkeypatch)
    # The test runs in the suite's process, whose heap holds what every earlier test left
    # (~0.5M tracked objects): a full collection falling in the window stopped the loop for
    # 0.6 s on a CI machine, a pause of the test process, not of the gateway's work. Collected
    # now, the next full collection is far off.
    gc.collect()
    hf = SignallingHF(tokenizer.hf)
    signalling = Tokenizer(hf, tokenizer.max_context, tokenizer.vocab_size)
    worker = await FakeWorker("w0", cache.address).start()
    config = gateway_config(cache.address, max_prompt_chars=4 * 1024 * 1024)
    text = "the quick brown fox jumps over the lazy dog; " * 25_000  # 1.1 MB
    try:
        async with (
            running(config, signalling) as gw,
            httpx.AsyncClient(base_url=f"http://{gw.http_address}", timeout=60) as http,
        ):
            stack = Stack(cache, [worker], gw, http)
            if entry == "grpc":
                big: asyncio.Future[object] = asyncio.ensure_future(
                    generate(stack, pb.GenerateRequest(prompt_text=text))
                )
            elif entry == "chat":
                body = {"messages": [{"role": "user", "content": text}], "max_tokens": 1}
                big = asyncio.ensure_future(http.post("/v1/chat/completions", json=body))
            else:
                body = {"prompt": text, "max_tokens": 1}
                big = asyncio.ensure_future(http.post("/v1/completions", json=body))
            while not hf.started.is_set() and not big.done():
                await asyncio.sleep(0.005)
            latencies = []
            began = time.perf_counter()
            with GcPauses() as collector:
                while not hf.finished.is_set():
                    start = time.perf_counter()
                    r = await http.get("/health")
                    latencies.append(time.perf_counter() - start)
                    assert r.status_code in (200, 503)
                    await asyncio.sleep(0.02)
            tokenizing = time.perf_counter() - began
            result = await big
    finally:
        await worker.close()
    # Longer than the context, found after tokenizing.
    assert result == grpc.StatusCode.INVALID_ARGUMENT or result.status_code == 400  # type: ignore[union-attr]
    assert len(latencies) >= 5, (
        f"only {len(latencies)} /health probes ran while tokenizing: {latencies}; {collector}"
    )
    # A blocked loop answers no probe until tokenizing is over (the count above fails); a free
    # one answers probes all through it. Not a latency target: on 2 busy cores single probes
    # have taken 0.4 and 0.58 s (of 1.13) while the tokenizer thread held the GIL in slices,
    # so the typical probe is what must be quick, and no one probe may span most of it.
    typical, worst = statistics.median(latencies), max(latencies)
    assert typical < max(0.1, tokenizing / 10), (
        f"/health took {typical:.3f}s at the median; {collector}"
    )
    assert worst < max(0.25, tokenizing * 0.75), (
        f"/health took {worst:.3f}s of {tokenizing:.3f}s; {collector}"
    )


async def test_health_answers_while_a_huge_body_is_refused(stack: Stack) -> None:
    text = "the quick brown fox jumps over the lazy dog; " * 86_000  # 3.9 MB
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 1}
    big = asyncio.create_task(stack.http.post("/v1/chat/completions", json=body))
    await asyncio.sleep(0.05)
    worst = 0.0
    for _ in range(10):
        start = time.perf_counter()
        await stack.http.get("/health")
        worst = max(worst, time.perf_counter() - start)
        await asyncio.sleep(0.05)
    assert (await big).status_code == 400
    # Generous: on the old code the body was tokenized on the loop for 15 s.
    assert worst < 1.0, f"/health took {worst:.3f}s while a prompt was checked"


async def test_prompt_chars_are_checked_before_tokenizing(stack: Stack) -> None:
    limit = stack.gateway.gateway.serving.limits.prompt_chars
    text = "a" * (limit + 1)
    start = time.perf_counter()
    code = await generate(stack, pb.GenerateRequest(prompt_text=text))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    r = await stack.http.post("/v1/completions", json={"prompt": text})
    assert r.status_code == 400 and "characters" in r.json()["error"]["message"]
    r = await stack.http.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": text}]}
    )
    assert r.status_code == 400 and "characters" in r.json()["error"]["message"]
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize("namespace", ["n" * 257, "x" * 3_000_000, "ns\nline", "\x1b[2J"])
async def test_long_or_unprintable_namespaces_are_refused(stack: Stack, namespace: str) -> None:
    req = pb.GenerateRequest(prompt_text="hi", namespace=namespace)
    assert await generate(stack, req) == grpc.StatusCode.INVALID_ARGUMENT
    if len(namespace) < 1_000_000:  # (under the HTTP body limit)
        r = await stack.http.post("/v1/completions", json={"prompt": "hi", "cache_salt": namespace})
        assert r.status_code == 400, r.text
    assert await generate(stack, pb.GenerateRequest(prompt_text="hi", namespace="n" * 256)) == (
        grpc.StatusCode.OK
    )


async def test_bearer_scheme_is_case_insensitive(big_stack: Stack) -> None:
    for scheme in ("Bearer", "bearer", "BEARER"):
        r = await big_stack.http.get("/v1/models", headers={"Authorization": f"{scheme} k3y"})
        assert r.status_code == 200, scheme
    for bad in ("Bearer k3", "Basic k3y", "Bearerk3y", "k3y"):
        r = await big_stack.http.get("/v1/models", headers={"Authorization": bad})
        assert r.status_code == 401, bad


async def test_admin_token_scheme_is_case_insensitive(stack: Stack) -> None:
    from tests.gateway.conftest import ADMIN_TOKEN

    r = await stack.http.get(
        "/admin/cache/stats", headers={"Authorization": f"bearer {ADMIN_TOKEN}"}
    )
    assert r.status_code == 200, r.text


async def test_health_does_not_count_a_dead_workers_requests(stack: Stack) -> None:
    await stack.poll()
    w = stack.workers[0]
    gw = stack.gateway.gateway
    view = next(v for v in gw.directory.views() if v.pool_id == w.worker_id)
    gw.directory.mark_unhealthy(view.address, "test: unreachable")
    body = (await stack.http.get("/health")).json()
    dead = next(x for x in body["workers"] if x["worker"] == w.worker_id)
    assert not dead["healthy"] and dead["running"] is None and dead["waiting"] is None


def test_outage_backs_off_and_logs_rarely(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    outage = Outage(base_s=0.1, cap_s=5.0, log_every_s=10.0, clock=lambda: now[0])
    delays = []
    with caplog.at_level(logging.WARNING, logger="worker.engine.outage"):
        for _ in range(200):  # 200 failures in a row, each retried when due
            outage.failed("unavailable")
            delays.append(outage.retry_in())
            now[0] += outage.retry_in()
    assert delays[:4] == pytest.approx([0.1, 0.2, 0.4, 0.8]) and max(delays) == pytest.approx(5.0)
    lines = [r for r in caplog.records if r.name == "worker.engine.outage"]
    assert len(lines) <= now[0] / 10 + 1 < 200
    outage.recovered()
    assert outage.retry_in() == 0


async def test_an_unexpected_error_is_a_500_and_the_connection_stays(
    cache: RunningService, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exception no handler takes is a 500 with an OpenAI error body, and the client's
    keep-alive connection serves its next request. Starlette's last resort re-raised after its
    500, and the server then dropped the connection: the next request on it was reset."""
    worker = await FakeWorker("w0", cache.address).start()
    try:
        async with (
            running(gateway_config(cache.address), tokenizer) as gw,
            httpx.AsyncClient(base_url=f"http://{gw.http_address}", timeout=30) as http,
        ):

            async def boom(*_: Any) -> None:
                raise RuntimeError("a bug")

            monkeypatch.setattr(gw.gateway.chat, "create", boom)

            def port(r: httpx.Response) -> int:
                return int(r.extensions["network_stream"].get_extra_info("client_addr")[1])

            first = await http.get("/health")
            for _ in range(3):
                r = await http.post(
                    "/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                )
                assert r.status_code == 500
                err = r.json()["error"]
                assert err["type"] == "server_error" and "a bug" not in err["message"]
                await asyncio.sleep(0.2)  # a closing server would have closed it by now
                after = await http.get("/health")
                assert after.status_code in (200, 503)
                assert port(after) == port(r) == port(first), "the connection was dropped"
    finally:
        await worker.close()
