"""Requests in flight per client and in all (``--max-concurrent-per-client``,
``--max-concurrent-requests``), counted from accept to the end of the response.

A client is its peer address: the TCP peer's host on HTTP, the host of ``context.peer()`` on
gRPC, written the same way on both, so one client's HTTP and gRPC requests share one count.
Not its API key: ``--api-key`` is one key shared by every client, so keying on it would make
them all one client. Not ``X-Forwarded-For``: nothing here knows which proxy to trust, and
trusting the header blindly lets a client pick a fresh identity per request (so the gateway
turns off uvicorn's own rewriting of the peer from it). Behind a reverse proxy or a NAT every
client has the proxy's address and shares one count: raise the limit there, or set 0.

Only the event loop touches a limiter (no locks).
"""

from __future__ import annotations

import ipaddress
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import unquote

from gateway.errors import TooManyRequests


class ConcurrencyLimiter:
    """Slots per client and in all; 0: no limit. Every ``acquire`` that returned must be
    matched by one ``release`` (``held`` does both)."""

    def __init__(self, per_client: int, total: int) -> None:
        self.per_client = per_client
        self.total = total
        # Only clients with a request in flight: a key is dropped at 0, so a scan of many
        # addresses does not grow it.
        self._by_client: Counter[str] = Counter()
        self._in_flight = 0

    def acquire(self, client: str) -> None:
        """Takes a slot for ``client`` or raises TooManyRequests (429 / RESOURCE_EXHAUSTED)."""
        if self.per_client and self._by_client[client] >= self.per_client:
            raise TooManyRequests(
                f"Too many concurrent requests from {client}: at most {self.per_client} may be "
                "in flight at once (--max-concurrent-per-client); retry when one has finished.",
                code="too_many_concurrent_requests",
            )
        if self.total and self._in_flight >= self.total:
            raise TooManyRequests(
                f"The server has {self.total} requests in flight, its limit "
                "(--max-concurrent-requests); retry later.",
                code="server_busy",
            )
        self._by_client[client] += 1
        self._in_flight += 1

    def release(self, client: str) -> None:
        self._in_flight -= 1
        self._by_client[client] -= 1
        if self._by_client[client] <= 0:
            del self._by_client[client]

    @contextmanager
    def held(self, client: str) -> Iterator[None]:
        self.acquire(client)
        try:
            yield
        finally:
            self.release(client)

    def in_flight(self, client: str | None = None) -> int:
        """Requests in flight from ``client``, or in all."""
        return self._in_flight if client is None else self._by_client[client]


def client_of_host(host: str | None) -> str:
    """A client's identity from its address: IPv4-mapped IPv6 as IPv4, the rest as given."""
    if not host:
        return "unknown"
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host
    mapped = getattr(ip, "ipv4_mapped", None)
    return str(mapped or ip)


def client_of_peer(peer: str) -> str:
    """A client's identity from a gRPC peer: ``ipv4:10.0.0.1:5000``, ``ipv6:[::1]:5000``
    (``%5B::1%5D`` in newer gRPC) -> the host; anything else (``unix:...``) as given."""
    kind, _, rest = unquote(peer).partition(":")
    if kind in ("ipv4", "ipv6"):
        return client_of_host(rest.rsplit(":", 1)[0].strip("[]"))
    return peer
