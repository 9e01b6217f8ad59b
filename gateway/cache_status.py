"""Whether the cache service answers, as the gateway has seen it: what /health, /metrics and
the request path say during an outage.

Without the cache service no worker can lease a block, so a request sent to a worker during an
outage only waits: a new chat got no answer in 50 s while /health said ok. So every call the
gateway makes to the service (Route per request, discovery every poll) reports here, and once
the service has been unreachable for ``grace_s`` (a restart takes about a second) new requests
are answered at once with 503 and Retry-After, /health says so (503), and
``kvserve_gateway_cache_service_up`` is 0. A request during an outage first asks the service
once more (at most every ``PROBE_INTERVAL_S``), so the first request after it is back is
served, not refused on the last poll's word. A sharded service is down only when every shard
is: a shard that fails alone drops its pools out of routing, the others serve.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

# During an outage, how often a request may ask the service whether it is back (the others
# are refused at once): a refused connection answers in about a millisecond.
PROBE_INTERVAL_S = 0.5


@dataclass
class CacheStatus:
    grace_s: float
    clock: Callable[[], float] = time.monotonic
    down_since: float | None = None
    last_error: str = ""
    probed_at: float | None = None

    def ok(self) -> None:
        self.down_since = None

    def probe_due(self) -> bool:
        """Whether a request during an outage should ask the service again (then it is the
        one asking until the interval passes)."""
        now = self.clock()
        if self.probed_at is not None and now - self.probed_at < PROBE_INTERVAL_S:
            return False
        self.probed_at = now
        return True

    def failed(self, error: object) -> None:
        if self.down_since is None:
            self.down_since = self.clock()
        self.last_error = str(error)

    def down_for(self) -> float:
        """Seconds since the first failed call of the current outage (0: reachable)."""
        return 0.0 if self.down_since is None else self.clock() - self.down_since

    @property
    def down(self) -> bool:
        """Unreachable for at least ``grace_s``: requests are refused rather than sent on."""
        return self.down_since is not None and self.down_for() >= self.grace_s

    def describe(self) -> str:
        return (
            f"the KV cache service has been unreachable for {self.down_for():.0f} s "
            f"({self.last_error}); no worker can admit a request until it is back"
        )
