"""The cache service being unreachable, as the engine sees it: when to retry, when to say so.

Without it, admission retried every 100 ms and logged a warning each time: ten lines a
second for the length of an outage. Retries back off exponentially to a cap, and the warning
comes at most once per ``log_every_s`` with the count of failures since the last one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Outage:
    base_s: float = 0.1
    cap_s: float = 5.0
    log_every_s: float = 10.0
    clock: Callable[[], float] = time.monotonic
    failures: int = 0
    unlogged: int = 0
    next_try: float = 0.0
    last_log: float = field(default=-float("inf"))
    since: float | None = None  # the first failure of the current outage
    last_error: str = ""

    def failed(self, err: object) -> None:
        now = self.clock()
        if self.since is None:
            self.since = now
        self.last_error = str(err)
        self.failures += 1
        delay = min(self.cap_s, self.base_s * 2 ** min(self.failures - 1, 30))
        self.next_try = now + delay
        self.unlogged += 1
        if now - self.last_log >= self.log_every_s:
            log.warning(
                "cache service unavailable (%d failed calls since the last report): %s; "
                "retrying in %.1fs",
                self.unlogged,
                err,
                delay,
            )
            self.last_log = now
            self.unlogged = 0

    def recovered(self) -> None:
        if self.failures:
            log.info("cache service reachable again after %d failed calls", self.failures)
        self.failures = self.unlogged = 0
        self.next_try = 0.0
        self.last_log = -float("inf")
        self.since = None

    def down_for(self) -> float:
        """Seconds since the current outage's first failure (0: reachable)."""
        return 0.0 if self.since is None else self.clock() - self.since

    def retry_in(self) -> float:
        """Seconds until the next call is worth trying (0: now)."""
        return max(0.0, self.next_try - self.clock())
