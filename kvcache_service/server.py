"""Builds the grpc.aio server: both services, health checking, reflection, the expiry sweep."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvcache_service.admin_servicer import AdminServicer
from kvcache_service.authority import AuthorityConfig, CacheAuthority
from kvcache_service.config import ENV_PREFIX, ServiceConfig
from kvcache_service.kv_events_config import KvEventsConfig
from kvcache_service.servicer import KVCacheServicer
from kvserve_launch.malformed import MalformedRequests
from kvserve_launch.startup import EXCLUSIVE_PORT, add_port
from kvserve_launch.tls import server_credentials
from kvserve_proto.kvcache.v1 import kvcache_pb2 as pb
from kvserve_proto.kvcache.v1 import kvcache_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from kvcache_service.vllm_events import VllmEventPublisher

log = logging.getLogger(__name__)

SERVICE_NAMES = (
    pb.DESCRIPTOR.services_by_name["KVCacheService"].full_name,
    pb.DESCRIPTOR.services_by_name["KVCacheAdmin"].full_name,
)


@dataclass
class RunningService:
    server: grpc.aio.Server
    port: int
    authority: CacheAuthority
    config: ServiceConfig
    kv_events: VllmEventPublisher | None = None  # --kv-events-config

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"


async def _sweep(authority: CacheAuthority, interval_s: float, events_retain_s: float) -> None:
    """Expires leases of pools that went silent even when no call comes in; stops recording KV
    events once nobody has watched them for ``events_retain_s``."""
    while True:
        await asyncio.sleep(interval_s)
        n = authority.expire_due()
        if n:
            log.warning("expired %d leases of silent pools", n)
        if authority.stop_events_if_idle(events_retain_s):
            log.info("KV events: no watcher for %.0f s, recording stopped", events_retain_s)


@contextlib.asynccontextmanager
async def running(config: ServiceConfig) -> AsyncIterator[RunningService]:
    """Starts the service (port 0 picks a free one) and stops it on exit. Raises
    StartupError (``kvserve_launch.startup``) when the port cannot be bound."""
    config = config.with_admin_token()
    authority = CacheAuthority(
        AuthorityConfig(
            lease_ttl_s=config.lease_ttl_s,
            block_size=config.block_size,
            namespace_quota_blocks=config.namespace_quota_blocks,
            max_pool_blocks=config.max_pool_blocks,
            max_pools=config.max_pools,
            max_namespace_chars=config.max_namespace_chars,
            events_buffer_bytes=config.events_buffer_mb << 20,
            max_watchers=config.events_max_watchers,
        )
    )
    # A step's KV events are sealed into batches (and watchers woken) right after the step.
    loop = asyncio.get_running_loop()

    def seal_soon() -> None:
        loop.call_soon(authority.events.seal)

    authority.events.on_pending = seal_soon
    server = grpc.aio.server(
        interceptors=[MalformedRequests()],
        options=[("grpc.max_receive_message_length", 64 * 1024 * 1024), EXCLUSIVE_PORT],
    )
    pb_grpc.add_KVCacheServiceServicer_to_server(
        KVCacheServicer(authority, config.service_token, config.admin_token), server
    )
    pb_grpc.add_KVCacheAdminServicer_to_server(AdminServicer(authority, config.admin_token), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (*SERVICE_NAMES, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    tls = server_credentials(config.tls_cert, config.tls_key, ENV_PREFIX, config.tls_client_ca)
    port = add_port(server, config.host, config.port, ENV_PREFIX, "port", tls)
    await server.start()
    for name in ("", *SERVICE_NAMES):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    sweeper = asyncio.create_task(
        _sweep(authority, config.sweep_interval_s, config.events_retain_s)
    )
    try:
        async with contextlib.AsyncExitStack() as stack:
            events, pub = KvEventsConfig.parse(config.kv_events_config), None
            if events.enabled:  # ZeroMQ, msgpack and numpy load only where they publish
                from kvcache_service.vllm_events import publishing

                pub = await stack.enter_async_context(publishing(authority, events))
            yield RunningService(server, port, authority, config, pub)
    finally:
        sweeper.cancel()
        await health_servicer.enter_graceful_shutdown()
        await server.stop(grace=2.0)
