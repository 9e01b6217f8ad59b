"""Fixtures: a real in-process cache service, fake workers registered with it, and the real
gateway (HTTP on uvicorn and gRPC) on loopback ports, all in the test's event loop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import httpx
import pytest

from gateway.config import GatewayConfig
from gateway.server import RunningGateway, running
from gateway.tokenizer import Tokenizer
from kvcache_service.config import ServiceConfig
from kvcache_service.server import RunningService
from kvcache_service.server import running as running_cache
from tests.gateway.fake_worker import MODEL, FakeWorker

ADMIN_TOKEN = "test-admin-token"
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    """The embedded default model's tokenizer (made locally on first use; ~1 s to load)."""
    return Tokenizer.load(MODEL)


def gateway_config(cache_address: str, **overrides: object) -> GatewayConfig:
    config = GatewayConfig(
        cache_service=cache_address,
        host="127.0.0.1",
        http_port=0,
        grpc_port=0,
        model=MODEL,
        admin_token=ADMIN_TOKEN,
        poll_interval_s=0.2,
        # The fakes use 4-token blocks: let a one-block match count.
        min_match_tokens=4,
    )
    return replace(config, **overrides)  # type: ignore[arg-type]


@dataclass
class Stack:
    cache: RunningService
    workers: list[FakeWorker]
    gateway: RunningGateway
    http: httpx.AsyncClient
    clients: list[Any] = field(default_factory=list)

    def openai(self) -> Any:
        """An ``openai`` client of the gateway, closed with the stack: one left open was
        closed by the garbage collector on a later test's loop, after its own had closed,
        and logged an ERROR there ("Event loop is closed") that failed a test counting them."""
        from openai import AsyncOpenAI

        client = AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0)
        self.clients.append(client)
        return client

    @property
    def base_url(self) -> str:
        return f"http://{self.gateway.http_address}"

    async def poll(self) -> None:
        """Refresh the gateway's view of the workers now instead of waiting a poll."""
        await self.gateway.gateway.poller.poll_once()


@pytest.fixture
async def cache() -> AsyncIterator[RunningService]:
    config = ServiceConfig(host="127.0.0.1", port=0, admin_token=ADMIN_TOKEN)
    async with running_cache(config) as svc:
        yield svc


@contextlib.asynccontextmanager
async def started_stack(
    cache: RunningService, tokenizer: Tokenizer, **config: object
) -> AsyncIterator[Stack]:
    """Two fake workers and a gateway (``config``: GatewayConfig overrides)."""
    workers = [await FakeWorker(f"w{i}", cache.address).start() for i in range(2)]
    try:
        async with (
            running(gateway_config(cache.address, **config), tokenizer) as gw,
            httpx.AsyncClient(base_url=f"http://{gw.http_address}", timeout=10) as http,
        ):
            stack = Stack(cache, workers, gw, http)
            try:
                yield stack
            finally:
                for client in stack.clients:
                    await client.close()
    finally:
        for w in workers:
            await w.close()


@pytest.fixture
async def stack(cache: RunningService, tokenizer: Tokenizer) -> AsyncIterator[Stack]:
    async with started_stack(cache, tokenizer) as s:
        yield s


async def wait_for(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Polls ``predicate`` every 20 ms until it holds; fails after ``timeout_s``."""
    for _ in range(int(timeout_s / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not met in time")


async def released(stack: Stack) -> None:
    """Until no lease is live at the cache service. A worker releases (and so indexes) a
    request's blocks after its last token, which can reach the client first: a test whose
    next request must find them cached waits for this."""
    await wait_for(lambda: all(not p.leases.live for p in stack.cache.authority.pools.values()))


async def worker_of(stack: Stack, body: dict) -> str:
    """The worker that served a chat completion of ``body`` (its ``x-kvserve-worker`` header)."""
    resp = await stack.http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    return resp.headers["x-kvserve-worker"]
