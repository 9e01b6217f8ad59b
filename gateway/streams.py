"""Async stream plumbing for responses: merging the chunk streams of a request's choices,
and Server-Sent Events framing."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from typing import Any, TypeVar

T = TypeVar("T")

SSE_DONE = "data: [DONE]\n\n"


# Characters JSON leaves raw that str.splitlines() breaks a line at: clients that read SSE
# with httpx's or requests' iter_lines() (splitlines underneath) would get an event cut in two
# whenever a model writes one. Escaped, they are the same JSON string; the SSE framing itself
# only ever breaks at \n.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(payload: object) -> str:
    """One SSE event carrying JSON (a pydantic model's dump or a plain dict), on one line for
    any line splitter (``_LINE_BREAKS``)."""
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).translate(_LINE_BREAKS)
    return f"data: {data}\n\n"


async def settle(task: asyncio.Future[Any]) -> None:
    """Ends ``task`` for good once its awaiter has stopped waiting on it (it returned, failed,
    or was cancelled while waiting on several): cancelled and awaited if still running, its
    error collected if it ended with one. A task that failed in the same loop turn its awaiter
    was cancelled would otherwise make asyncio log "Task exception was never retrieved"."""
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    elif not task.cancelled():
        task.exception()


async def merge(
    streams: Sequence[AsyncGenerator[T, None]],
) -> AsyncGenerator[tuple[int, T], None]:
    """Items of all ``streams`` as they come, tagged with the stream's index.

    The first error of any stream ends the merge with that error. Closing the merge (or
    cancelling its consumer) cancels every stream still running, so each choice's worker
    call is cancelled with it.
    """
    if len(streams) == 1:  # the common case, without tasks
        async with aclosing(streams[0]) as only:
            async for item in only:
                yield 0, item
        return
    # (index, item) for an item; (index, None) when that stream ended; an error ends all.
    queue: asyncio.Queue[tuple[int, T | None] | BaseException] = asyncio.Queue()

    async def pump(i: int, stream: AsyncGenerator[T, None]) -> None:
        try:
            async with aclosing(stream):
                async for item in stream:
                    await queue.put((i, item))
            await queue.put((i, None))
        except Exception as e:
            await queue.put(e)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            got = await queue.get()
            if isinstance(got, BaseException):
                raise got
            i, value = got
            if value is None:
                running -= 1
                continue
            yield i, value
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
