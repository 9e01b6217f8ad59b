"""A coroutine run in a task of its own between ``start`` and ``stop``: the gateway's pollers."""

from __future__ import annotations

import asyncio
import contextlib


class Background:
    """Subclasses define :meth:`_run`; :meth:`start` runs it in a task, :meth:`stop` cancels
    it and waits for it to end."""

    _task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
