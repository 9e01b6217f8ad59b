"""The gateway's waits on several things at once end every task they started, in the one race
an outside probe hit: the awaited task fails in the same loop turn as its awaiter is cancelled.

Seen from outside: a flood of streaming requests with short client timeouts against a worker
at its --max-pending-requests logged, once per request, asyncio's "Task exception was never
retrieved" with the worker's refusal (AtPendingLimit) from ``first_chunk``'s task. The
request's own handling was right (the client had gone); the error log was not.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncGenerator
from typing import Any

import pytest
from starlette.requests import Request

from gateway.dispatcher import first_chunk
from gateway.errors import AtPendingLimit
from gateway.generation import Chunk
from gateway.http_app import until_disconnected
from gateway.worker_directory import WorkerDirectory

ADDRESS = "127.0.0.1:1"


def unretrieved(contexts: list[dict[str, Any]]) -> list[str]:
    return [str(c.get("message")) for c in contexts if "never retrieved" in str(c.get("message"))]


async def fail_as_awaiter_is_cancelled(
    start: asyncio.Event, awaiter: asyncio.Task[Any]
) -> list[str]:
    """Lets ``awaiter`` block on its wait, then in one loop turn lets the awaited work fail and
    cancels ``awaiter``; returns the asyncio error messages logged once the tasks are gone."""
    loop = asyncio.get_running_loop()
    seen: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _, context: seen.append(context))
    try:
        for _ in range(5):
            await asyncio.sleep(0)  # the awaiter reaches its asyncio.wait
        start.set()  # the work fails on its next step...
        awaiter.cancel()  # ...and the awaiter is cancelled in the same turn, after it
        with pytest.raises(asyncio.CancelledError):
            await awaiter
        del awaiter
        for _ in range(3):
            gc.collect()
            await asyncio.sleep(0)
        return unretrieved(seen)
    finally:
        loop.set_exception_handler(None)


async def test_a_refusal_as_the_client_leaves_is_collected_by_first_chunk() -> None:
    start = asyncio.Event()

    async def refused() -> AsyncGenerator[Chunk, None]:
        await start.wait()
        raise AtPendingLimit(f"worker {ADDRESS}: RESOURCE_EXHAUSTED: at its limit")
        yield  # an async generator, as a worker call's stream is

    directory = WorkerDirectory()
    stream = refused()
    awaiter = asyncio.ensure_future(
        first_chunk(stream, directory.next_mark(ADDRESS), directory, ADDRESS, [])
    )
    assert await fail_as_awaiter_is_cancelled(start, awaiter) == []
    await stream.aclose()


async def test_first_chunk_still_raises_the_refusal_it_waited_for() -> None:
    async def refused() -> AsyncGenerator[Chunk, None]:
        raise AtPendingLimit(f"worker {ADDRESS}: RESOURCE_EXHAUSTED: at its limit")
        yield

    directory = WorkerDirectory()
    with pytest.raises(AtPendingLimit):
        await first_chunk(refused(), directory.next_mark(ADDRESS), directory, ADDRESS, [])


async def test_work_failing_as_the_request_is_cancelled_is_collected_by_until_disconnected() -> (
    None
):
    start = asyncio.Event()
    connected = asyncio.Event()  # never set: the client stays

    async def receive() -> dict[str, Any]:
        await connected.wait()
        return {"type": "http.disconnect"}

    async def work() -> str:
        await start.wait()
        raise ValueError("the work failed")

    request = Request({"type": "http", "method": "POST", "path": "/v1/x", "headers": []}, receive)
    awaiter = asyncio.ensure_future(until_disconnected(request, work()))
    assert await fail_as_awaiter_is_cancelled(start, awaiter) == []
