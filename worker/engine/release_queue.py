"""Lease releases, coalesced: the first goes out at once, the ones that come while it is in
flight go together in the next ReleaseLeases, so a busy step's endings cost one call.

A release whose tokens the service refuses (``Rejected``: its lease is still live) is sent
again without them, so no lease is left behind. A release may carry a callback that runs once
the service has answered it, refused it or the call failed (``FinalHold`` sends a finished
request's last event that way): waiting longer would not index its tokens. Part of the lease
sync (``worker.engine.lease_sync``), which owns the one queue.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from worker.engine.lease import LeaseError, LeaseService, Rejected, Written

log = logging.getLogger(__name__)

RELEASE_BATCH = 256  # items per ReleaseLeases call (the service takes up to 1,024)


class ReleaseQueue:
    def __init__(
        self,
        client: LeaseService,
        spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task],
        answered: Callable[[], None],
    ) -> None:
        """``spawn``: runs the sending task (as the lease sync's, which its stop waits for).
        ``answered``: after each call came back or failed (blocks may be free again)."""
        self._client = client
        self._spawn = spawn
        self._answered = answered
        self._items: list[tuple[int, Written | None]] = []  # not sent yet
        self._after: dict[int, Callable[[], None]] = {}  # by lease id
        self._sending: asyncio.Task | None = None  # one call at a time: they batch up

    @property
    def pending(self) -> int:
        """Releases not sent yet."""
        return len(self._items)

    def add(
        self, lease_id: int, written: Written | None, then: Callable[[], None] | None = None
    ) -> None:
        """Releases ``lease_id`` (committing what ``written`` says, if given); ``then`` runs
        once the service has answered."""
        if then is not None:
            self._after[lease_id] = then
        self._items.append((lease_id, written))
        if self._sending is None or self._sending.done():
            self._sending = self._spawn(self._flush())

    async def _flush(self) -> None:
        while self._items:
            items = self._items[:RELEASE_BATCH]
            del self._items[:RELEASE_BATCH]
            results: list[LeaseError | None] | None = None
            try:
                results = await self._client.release(items)
            except LeaseError as err:
                log.debug("release of %d leases failed: %s", len(items), err)
            finally:
                # Answered, refused or failed: waiting longer would not index these tokens.
                for lease_id, _ in items:
                    after = self._after.pop(lease_id, None)
                    if after is not None:
                        after()
            if results is not None:
                for (lease_id, written), failed in zip(items, results, strict=True):
                    if isinstance(failed, Rejected) and written is not None:
                        # Its lease is still live: give its blocks back without the tokens.
                        log.warning(
                            "lease %d's tokens were refused (%s); releasing it", lease_id, failed
                        )
                        self._items.append((lease_id, None))
                    elif failed is not None:
                        log.debug("release of lease %d failed: %s", lease_id, failed)
            self._answered()
