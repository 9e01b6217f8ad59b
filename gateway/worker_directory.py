"""What the gateway knows about its workers: where they are, whether they answer, how busy.

Health: a worker that a call could not reach is marked unhealthy and the router passes it
over until it answers again (the poller re-probes it every interval, a successful call
clears the mark too). The cache service's own ``alive`` flag (heartbeats) counts as well: a
worker that stopped heartbeating has lost its leases and cannot serve.

Load: the larger of three views, since each misses something: the cache service's live
leases (every gateway's running requests, fresh, but not the queued ones), this gateway's
own in-flight requests (queued ones too, fresh, but only this gateway's), and the worker's
``running + waiting`` from the last poll (complete, but up to one interval old).

Only the event loop thread touches a directory (no locks).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from gateway.cache_client import PoolBlocks, PoolRoute
from gateway.router import Candidate
from gateway.worker_client import WorkerLoad


@dataclass(frozen=True, slots=True)
class HealthMark:
    """Why and since when a worker address is considered unreachable."""

    reason: str
    since: float


@dataclass(frozen=True, slots=True)
class WorkerView:
    """One worker as /metrics, /health and the gateway's GetInfo show it."""

    pool_id: str
    address: str
    healthy: bool
    alive: bool
    in_flight: int
    route: PoolRoute | None
    load: WorkerLoad | None
    blocks: PoolBlocks | None
    unhealthy_reason: str = ""


class WorkerDirectory:
    def __init__(self, static_workers: Sequence[str] = ()) -> None:
        self.static_workers = tuple(static_workers)
        # Last discovery (Route with a one-token prompt): pool id -> route.
        self.routes: dict[str, PoolRoute] = {}
        self.unhealthy: dict[str, HealthMark] = {}
        self.loads: dict[str, WorkerLoad] = {}
        self.blocks: dict[str, PoolBlocks] = {}
        self.in_flight: Counter[str] = Counter()
        # Set when the worker is next marked unhealthy: requests waiting for their first
        # chunk there fail over (gateway.dispatcher).
        self._marked: dict[str, asyncio.Event] = {}

    # -- health --------------------------------------------------------------------------------

    def mark_unhealthy(self, address: str, reason: str) -> bool:
        """Returns True when the mark is new (for logging once)."""
        if address in self.unhealthy:
            return False
        self.unhealthy[address] = HealthMark(reason, time.time())
        marked = self._marked.pop(address, None)
        if marked is not None:
            marked.set()
        return True

    def next_mark(self, address: str) -> asyncio.Event:
        """An event set when ``address`` is next marked unhealthy (never, for a worker marked
        already: a request sent there anyway has nowhere better to go)."""
        if address in self.unhealthy:
            return asyncio.Event()
        marked = self._marked.get(address)
        if marked is None:
            marked = self._marked[address] = asyncio.Event()
        return marked

    def mark_healthy(self, address: str) -> bool:
        """Returns True when a mark was cleared."""
        return self.unhealthy.pop(address, None) is not None

    def is_healthy(self, address: str) -> bool:
        return address not in self.unhealthy

    # -- observations --------------------------------------------------------------------------

    def set_routes(self, routes: Iterable[PoolRoute]) -> None:
        self.routes = {r.pool_id: r for r in routes if r.worker_address}

    def record_load(self, address: str, load: WorkerLoad) -> None:
        self.loads[address] = load

    def set_blocks(self, blocks: Iterable[PoolBlocks]) -> None:
        self.blocks = {b.pool_id: b for b in blocks}

    def addresses(self) -> set[str]:
        """Every worker address known: registered, configured, or with requests in flight."""
        return (
            {r.worker_address for r in self.routes.values()}
            | set(self.static_workers)
            | {a for a, n in self.in_flight.items() if n > 0}
        )

    # -- routing -------------------------------------------------------------------------------

    def candidates(self, routes: Sequence[PoolRoute]) -> list[Candidate]:
        """Router candidates for one prompt's ``Route`` answer (plus static workers)."""
        out = []
        for r in routes:
            if not r.worker_address:
                continue
            out.append(
                Candidate(
                    pool_id=r.pool_id,
                    address=r.worker_address,
                    cached_tokens=r.cached_tokens,
                    load=max(r.live_leases, self._gateway_load(r.worker_address)),
                    free_blocks=r.free_blocks,
                    healthy=r.alive and self.is_healthy(r.worker_address),
                    capacity=self._capacity(r.worker_address),
                )
            )
        seen = {c.address for c in out}
        for address in self.static_workers:
            if address not in seen:
                out.append(
                    Candidate(
                        pool_id=self._pool_id_of(address),
                        address=address,
                        cached_tokens=0,
                        load=self._gateway_load(address),
                        healthy=self.is_healthy(address),
                        capacity=self._capacity(address),
                    )
                )
        return out

    def known_routes(self) -> list[PoolRoute]:
        """The last discovery with nothing cached: routing when the cache service is away."""
        return [
            PoolRoute(r.pool_id, r.worker_address, r.model, 0, r.free_blocks, 0, 0, r.alive)
            for r in self.routes.values()
        ]

    def request_tokens(self) -> int:
        """The most tokens (prompt and completion together) one request can have on a worker
        known now: the largest KV pool's, blocks x block size, within that worker's own
        context; 0 while no worker's pool is known. A worker refuses at once a request its pool
        could never hold ("the request needs N KV blocks; this worker's pool has M",
        ``worker.engine.intake``), and a pool may hold fewer tokens than the model's context."""
        known = self.addresses()
        return max(
            (
                min(load.num_blocks * load.block_size, load.max_context or sys.maxsize)
                for address, load in self.loads.items()
                if address in known and load.num_blocks and load.block_size
            ),
            default=0,
        )

    def _gateway_load(self, address: str) -> int:
        polled = self.loads.get(address)
        return max(self.in_flight[address], polled.running + polled.waiting if polled else 0)

    def _capacity(self, address: str) -> int:
        polled = self.loads.get(address)
        return polled.max_pending if polled else 0

    def _pool_id_of(self, address: str) -> str:
        load = self.loads.get(address)
        return load.worker_id if load and load.worker_id else address

    # -- views ---------------------------------------------------------------------------------

    def views(self) -> list[WorkerView]:
        out = []
        by_address = {r.worker_address: r for r in self.routes.values()}
        for address in sorted(self.addresses()):
            route = by_address.get(address)
            pool_id = route.pool_id if route else self._pool_id_of(address)
            mark = self.unhealthy.get(address)
            alive = route.alive if route else True
            out.append(
                WorkerView(
                    pool_id=pool_id,
                    address=address,
                    healthy=alive and mark is None,
                    alive=alive,
                    in_flight=self.in_flight[address],
                    route=route,
                    load=self.loads.get(address),
                    blocks=self.blocks.get(pool_id),
                    unhealthy_reason=mark.reason if mark else ("" if alive else "no heartbeat"),
                )
            )
        return out
