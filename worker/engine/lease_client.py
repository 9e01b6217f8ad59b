"""The worker's client of the cache service: its messages and status codes in, the plain
values and typed errors of ``worker.engine.lease`` out.

Only this module touches the generated kvcache protos on the worker side.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from kvserve_proto.kvcache.v1 import kvcache_pb2 as pb
from kvserve_proto.kvcache.v1 import kvcache_pb2_grpc as pb_grpc
from worker.engine.lease import (
    CacheUnavailable,
    Deferred,
    Fenced,
    Lease,
    LeaseError,
    LeaseLost,
    NoRoom,
    PoolRegistration,
    Rejected,
)

RPC_TIMEOUT_S = 10.0
# Heartbeats at most this share of the lease TTL apart, whatever interval the service suggests
# (it suggests TTL/4): a late or lost heartbeat still leaves the next one well inside the TTL.
HEARTBEAT_TTL_FRACTION = 0.25
# A namespace's longest length when the service does not say (one that predates the field).
DEFAULT_MAX_NAMESPACE_CHARS = 256


# The cache service's codes (kvcache.proto) -> what the engine does about them. Decided by the
# code alone: details are for logs, never parsed.
_ERROR_OF: dict[grpc.StatusCode, type[LeaseError]] = {
    grpc.StatusCode.RESOURCE_EXHAUSTED: NoRoom,
    grpc.StatusCode.FAILED_PRECONDITION: Fenced,
    grpc.StatusCode.NOT_FOUND: LeaseLost,
    grpc.StatusCode.INVALID_ARGUMENT: Rejected,
}


def _translate(err: grpc.aio.AioRpcError, incarnation: int) -> LeaseError:
    code, details = err.code(), err.details() or ""
    cls = _ERROR_OF.get(code)
    if cls is Fenced:
        return Fenced(details, incarnation)
    if cls is not None:
        return cls(details)
    return CacheUnavailable(f"{code.name}: {details}")


class LeaseClient:
    """Async calls on one channel. `incarnation` is set by register() and sent with every call."""

    def __init__(
        self, address: str, token: str = "", channel: grpc.aio.Channel | None = None
    ) -> None:
        """``channel``: one to ``address`` already built (TLS, ``kvserve_launch.tls``); the
        client owns and closes it. None: a plaintext one."""
        self.address = address
        # The cache service's service token, on every call (empty: the service's auth is off).
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._channel = channel or grpc.aio.insecure_channel(address)
        self._stub = pb_grpc.KVCacheServiceStub(self._channel)
        self.pool_id = ""
        self.incarnation = 0
        self.lease_ttl_s = 0.0
        self.heartbeat_interval_s = 1.0
        # The longest namespace the service stores (it says so at registration).
        self.max_namespace_chars = DEFAULT_MAX_NAMESPACE_CHARS

    async def close(self) -> None:
        await self._channel.close()

    @property
    def _ref(self) -> pb.PoolRef:
        return pb.PoolRef(pool_id=self.pool_id, incarnation=self.incarnation)

    async def _call(self, method, request):
        incarnation = self.incarnation
        try:
            return await method(request, timeout=RPC_TIMEOUT_S, metadata=self._metadata)
        except grpc.aio.AioRpcError as err:
            raise _translate(err, incarnation) from err

    async def register(self, reg: PoolRegistration) -> int:
        resp = await self._call(
            self._stub.RegisterPool,
            pb.RegisterPoolRequest(
                pool_id=reg.pool_id,
                model_fingerprint=reg.model_fingerprint,
                model=reg.model,
                worker_address=reg.worker_address,
                # Ours, if we hold one: lets us re-register our own pool while it is live.
                incarnation=self.incarnation,
                num_blocks=reg.num_blocks,
                block_size=reg.block_size,
                layout=pb.PoolLayout(
                    num_layers=reg.num_layers,
                    num_kv_heads=reg.num_kv_heads,
                    head_dim=reg.head_dim,
                    dtype=reg.dtype,
                ),
            ),
        )
        self.pool_id = reg.pool_id
        self.incarnation = resp.incarnation
        self.lease_ttl_s = resp.lease_ttl_s
        ttl_share = resp.lease_ttl_s * HEARTBEAT_TTL_FRACTION
        announced = (i for i in (resp.heartbeat_interval_s, ttl_share) if i > 0)
        self.heartbeat_interval_s = min(announced, default=1.0)
        self.max_namespace_chars = resp.max_namespace_chars or DEFAULT_MAX_NAMESPACE_CHARS
        return resp.incarnation

    async def heartbeat(self) -> list[int]:
        """Renews liveness; returns lease ids that expired since the last report."""
        resp = await self._call(self._stub.Heartbeat, pb.HeartbeatRequest(pool=self._ref))
        return list(resp.expired_lease_ids)

    async def acquire(
        self, tokens: Sequence[int], namespace: str, reserve: int, skip_cache: bool
    ) -> tuple[Lease | Deferred, list[int]]:
        resp = await self._call(
            self._stub.AcquireLease,
            pb.AcquireLeaseRequest(
                pool=self._ref,
                namespace=namespace,
                prompt_token_ids=tokens,
                reserve_tokens=reserve,
                allow_defer=not skip_cache,
                skip_cache=skip_cache,
            ),
        )
        expired = list(resp.expired_lease_ids)
        if resp.WhichOneof("result") == "deferred":
            d = resp.deferred
            return Deferred(d.waiting_on_lease_id, d.cached_tokens, d.pending_tokens), expired
        lease = resp.lease
        cow = tuple((c.src_block, c.dst_block) for c in lease.copy_on_write)
        return Lease(lease.lease_id, tuple(lease.block_table), lease.cached_tokens, cow), expired

    async def extend(self, items: Sequence[tuple[int, int]]) -> dict[int, list[int]]:
        resp = await self._call(
            self._stub.ExtendLeases,
            pb.ExtendLeasesRequest(
                pool=self._ref,
                items=[pb.ExtendItem(lease_id=i, num_tokens=n) for i, n in items],
            ),
        )
        return {e.lease_id: list(e.new_blocks) for e in resp.leases}

    async def commit(self, items: Sequence[tuple[int, Sequence[int]]]) -> None:
        await self._call(
            self._stub.CommitLeases,
            pb.CommitLeasesRequest(
                pool=self._ref,
                items=[pb.CommitItem(lease_id=i, token_ids=t) for i, t in items],
            ),
        )

    async def release(self, lease_id: int, tokens: Sequence[int]) -> None:
        await self._call(
            self._stub.ReleaseLease,
            pb.ReleaseLeaseRequest(pool=self._ref, lease_id=lease_id, token_ids=tokens),
        )
