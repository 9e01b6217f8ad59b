"""Keeps the worker directory fresh: discovery, load, health, block stats.

Every interval: ``Route`` with a one-token prompt lists every registered pool of the model
(the cache service is the registry; no static worker list is needed), ``GetInfo`` on each
worker reads its load and doubles as the health probe (a worker marked unhealthy is routed
to again as soon as it answers), and with an admin token ``GetStats`` adds the pools' block
accounting for /metrics.
"""

from __future__ import annotations

import asyncio
import logging

from gateway.background import Background
from gateway.cache_client import CacheApi
from gateway.cache_status import CacheStatus
from gateway.errors import GatewayError, WorkerSilent, WorkerUnavailable
from gateway.worker_client import WorkerClients
from gateway.worker_directory import WorkerDirectory

log = logging.getLogger(__name__)

DISCOVERY_PROMPT = (0,)
# While no worker is known (the system is starting) the directory is polled this often, so the
# first worker serves within a fraction of a second of registering, not an interval later.
STARTING_POLL_S = 0.25
# Health polls a worker may leave unanswered in a row before it is marked unhealthy: its
# channel is up but it makes no progress (a stopped or stalled process still accepts
# connections). Until then requests kept going to it and waited; its lease TTL (30 s) was
# the first thing to notice.
SILENT_POLLS = 2


class WorkerPoller(Background):
    def __init__(
        self,
        *,
        model: str,
        cache: CacheApi,
        clients: WorkerClients,
        directory: WorkerDirectory,
        interval_s: float,
        admin_token: str = "",
        cache_status: CacheStatus | None = None,
    ) -> None:
        self.model = model
        self.cache = cache
        self.clients = clients
        self.directory = directory
        self.interval_s = interval_s
        self.admin_token = admin_token
        self.cache_status = cache_status or CacheStatus(grace_s=float("inf"))
        self.silent: dict[str, int] = {}  # address -> health polls unanswered in a row

    async def poll_once(self) -> None:
        try:
            self.directory.set_routes(await self.cache.route("", DISCOVERY_PROMPT, self.model))
            self.cache_status.ok()
        except GatewayError as e:
            self.cache_status.failed(e)
            log.warning("worker discovery failed (keeping the last view): %s", e)
        addresses = self.directory.addresses()
        await asyncio.gather(*(self._probe(a) for a in addresses))
        if self.admin_token:
            try:
                self.directory.set_blocks(await self.cache.pool_blocks(self.admin_token))
            except GatewayError as e:
                log.debug("GetStats failed: %s", e)
        await self.clients.retain(addresses)

    async def _probe(self, address: str) -> None:
        timeout = max(0.5, min(self.interval_s, 5.0))
        marked = not self.directory.is_healthy(address)
        try:
            load = await self.clients.get(address).get_info(timeout, wait_for_ready=marked)
        except WorkerUnavailable as e:
            if self.directory.mark_unhealthy(address, e.message):
                log.warning("worker at %s marked unhealthy: %s", address, e)
            return
        except WorkerSilent as e:
            n = self.silent[address] = self.silent.get(address, 0) + 1
            if n >= SILENT_POLLS:
                reason = f"{e.message}, {n} times in a row: hung or stalled"
                if self.directory.mark_unhealthy(address, reason):
                    log.warning("worker at %s marked unhealthy: %s", address, reason)
            return
        except GatewayError as e:  # odd, but it answers: keep its mark as it is
            log.debug("GetInfo on %s: %s", address, e)
            return
        self.silent.pop(address, None)
        self.directory.record_load(address, load)
        if self.directory.mark_healthy(address):
            log.info("worker %s at %s answers again", load.worker_id, address)

    async def _run(self) -> None:
        while True:
            known = self.directory.addresses()
            await asyncio.sleep(self.interval_s if known else min(self.interval_s, STARTING_POLL_S))
            try:
                await self.poll_once()
            except Exception:  # the poller must outlive any one bad round
                log.exception("worker poll failed")
