"""Client of the cache service: ``Route`` for the router, and the admin RPCs the HTTP admin
pass-through forwards (with the caller's own bearer token).

:class:`CacheApi` is what the rest of the gateway uses: one :class:`CacheClient`, or a
``ShardedCache`` over several when the cache service is sharded by pool id
(``gateway.sharded_cache``); the router and the directory never learn which.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc
from google.protobuf.message import Message

from gateway.errors import from_rpc_error
from gateway.worker_client import Connect, plaintext
from kvserve_proto.kvcache.v1 import kvcache_pb2 as pb
from kvserve_proto.kvcache.v1 import kvcache_pb2_grpc as pb_grpc

ROUTE_TIMEOUT_S = 2.0
ADMIN_TIMEOUT_S = 30.0

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    # gRPC's default reconnect backoff grows to 120 s: a cache service (or shard) back after a
    # minute's outage would stay out of routing for up to a minute more (measured in
    # bench/bench_shards.py). Capped like the workers' channels (gateway.worker_client).
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


@dataclass(frozen=True, slots=True)
class PoolRoute:
    """One worker pool's answer to ``Route`` for one prompt, as the gateway reads it off the
    wire. Kept apart from the cache service's ``PoolRoute`` (kvcache_service/authority.py) on
    purpose: the two sides of the wire, and neither package may import the other."""

    pool_id: str
    worker_address: str
    model: str
    # Prompt tokens the pool would not compute: in its pool, or in its tiers (loaded back:
    # docs/kv-tiers.md), so a prefix a worker spilled to disk still routes there.
    cached_tokens: int
    free_blocks: int
    evictable_blocks: int
    live_leases: int
    alive: bool


@dataclass(frozen=True, slots=True)
class PoolBlocks:
    """Block accounting of one pool from the admin ``GetStats``."""

    pool_id: str
    num_blocks: int
    free_blocks: int
    cached_blocks: int
    referenced_blocks: int
    pinned_blocks: int
    token_hit_rate: float
    alive: bool


class CacheApi(Protocol):
    """The cache service as the gateway's parts call it."""

    address: str

    async def route(
        self, namespace: str, prompt_token_ids: Sequence[int], model: str
    ) -> list[PoolRoute]: ...

    async def pool_blocks(self, admin_token: str) -> list[PoolBlocks]: ...

    async def call_admin(self, method: str, request: Message, authorization: str) -> Message: ...

    async def close(self) -> None: ...


def pool_blocks_of(resp: pb.StatsResponse) -> list[PoolBlocks]:
    return [
        PoolBlocks(
            p.pool_id,
            p.num_blocks,
            p.free_blocks,
            p.cached_blocks,
            p.referenced_blocks,
            p.pinned_blocks,
            p.token_hit_rate,
            p.alive,
        )
        for p in resp.pools
    ]


class CacheClient:
    def __init__(self, address: str, token: str = "", connect: Connect | None = None) -> None:
        """``connect`` builds the channel (TLS, ``kvserve_launch.tls``); None: plaintext."""
        self.address = address
        # The cache service's service token for data-plane calls (empty: its auth is off).
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self.channel = (connect or plaintext)(address, CHANNEL_OPTIONS)
        self.stub = pb_grpc.KVCacheServiceStub(self.channel)
        self.admin = pb_grpc.KVCacheAdminStub(self.channel)

    async def route(
        self, namespace: str, prompt_token_ids: Sequence[int], model: str
    ) -> list[PoolRoute]:
        """Per pool serving ``model``, the cached prefix length of the prompt."""
        req = pb.RouteRequest(namespace=namespace, prompt_token_ids=prompt_token_ids, model=model)
        return await self.route_request(req)

    async def route_request(self, req: pb.RouteRequest) -> list[PoolRoute]:
        """``route`` with the request built (once for every shard: ~80 us for 2k tokens)."""
        try:
            resp = await self.stub.Route(req, timeout=ROUTE_TIMEOUT_S, metadata=self._metadata)
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e, f"cache service {self.address}") from e
        return [
            PoolRoute(
                p.pool_id,
                p.worker_address,
                p.model,
                p.cached_tokens + p.tier_tokens,
                p.free_blocks,
                p.evictable_blocks,
                p.live_leases,
                p.alive,
            )
            for p in resp.pools
        ]

    async def pool_blocks(self, admin_token: str) -> list[PoolBlocks]:
        resp = await self.call_admin("GetStats", pb.StatsRequest(), f"Bearer {admin_token}")
        assert isinstance(resp, pb.StatsResponse)
        return pool_blocks_of(resp)

    async def call_admin(self, method: str, request: Message, authorization: str) -> Message:
        """One ``KVCacheAdmin`` RPC with the given ``authorization`` header value."""
        rpc = getattr(self.admin, method)
        metadata = (("authorization", authorization),) if authorization else ()
        try:
            return await rpc(request, metadata=metadata, timeout=ADMIN_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e, f"cache service {self.address}") from e

    async def close(self) -> None:
        await self.channel.close()
