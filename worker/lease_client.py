"""The worker's gRPC client of the cache service, at the edge: kvcache.v1's messages and status
codes in, the plain values and typed errors of ``worker.engine.lease`` out. It implements
``worker.engine.lease.LeaseService``, the protocol the engine is written against; the engine
never sees gRPC (tests/test_import_rules.py), and is handed this client by the assembly
(``worker.server``).

Only this module touches the generated kvcache protos on the worker side. It sends only the
batched calls (AcquireLeases, ExtendLeases, CommitLeases, ReleaseLeases: wire revision 2). The
single-item AcquireLease and ReleaseLease stay in the contract on purpose, though no worker
sends them: clients written to wire revision 1 send one per lease, and the cache service's own
tests and benchmarks (``bench/bench_kvcache.py``, ``bench/bench_shards.py``,
``bench/bench_grpc_models.py``) and the gateway tests' fake worker call them, one lease at a
time being the simplest way to drive the service.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from kvserve_launch.grpc_status import status_code
from kvserve_proto.kvcache.v1 import kvcache_pb2 as pb
from kvserve_proto.kvcache.v1 import kvcache_pb2_grpc as pb_grpc
from kvserve_proto.packed_tokens import pack
from worker.engine.lease import (
    CacheUnavailable,
    Deferred,
    Fenced,
    Incompatible,
    Lease,
    LeaseAsk,
    LeaseError,
    LeaseLost,
    NeverFits,
    NoRoom,
    PoolRegistration,
    Rejected,
    TierEntry,
    Written,
)
from worker.pool_claim import PoolClaim

RPC_TIMEOUT_S = 10.0
# Heartbeats at most this share of the lease TTL apart, whatever interval the service suggests
# (it suggests TTL/4): a late or lost heartbeat still leaves the next one well inside the TTL.
HEARTBEAT_TTL_FRACTION = 0.25
# A namespace's longest length when the service does not say (one that predates the field).
DEFAULT_MAX_NAMESPACE_CHARS = 256
# The cache service's contract revision this client needs (RegisterPoolResponse): packed
# token ids, sequence updates, AcquireLeases and ReleaseLeases. Upgrade the service first.
WIRE_REVISION = 2
# A tier's medium, as PoolRegistration names it, on the wire.
_MEDIA = {"host": pb.MEDIUM_HOST, "disk": pb.MEDIUM_DISK}
_MEDIUM_OF = {v: k for k, v in _MEDIA.items()}


# The cache service's codes (kvcache.proto) -> what the engine does about them. Decided by the
# code alone: details are for logs, never parsed.
_ERROR_OF: dict[grpc.StatusCode, type[LeaseError]] = {
    grpc.StatusCode.RESOURCE_EXHAUSTED: NoRoom,
    grpc.StatusCode.OUT_OF_RANGE: NeverFits,
    grpc.StatusCode.FAILED_PRECONDITION: Fenced,
    grpc.StatusCode.NOT_FOUND: LeaseLost,
    grpc.StatusCode.INVALID_ARGUMENT: Rejected,
}


def _translate(err: grpc.aio.AioRpcError, incarnation: int) -> LeaseError:
    return _lease_error(err.code(), err.details() or "", incarnation)


def _lease_error(code: grpc.StatusCode, details: str, incarnation: int) -> LeaseError:
    """A status code of a whole call, or of one item of a batch, typed alike."""
    cls = _ERROR_OF.get(code)
    if cls is Fenced:
        return Fenced(details, incarnation)
    if cls is not None:
        return cls(details)
    return CacheUnavailable(f"{code.name}: {details}")


class LeaseClient:
    """``worker.engine.lease.LeaseService`` over gRPC: async calls on one channel.
    `incarnation` is set by register() and sent with every call."""

    def __init__(
        self,
        address: str,
        token: str = "",
        channel: grpc.aio.Channel | None = None,
        claim: PoolClaim | None = None,
    ) -> None:
        """``channel``: one to ``address`` already built (TLS, ``kvserve_launch.tls``); the
        client owns and closes it. None: a plaintext one. ``claim``: where the pool's
        incarnation is kept for a restart of this worker (``worker.pool_claim``); the client
        owns and closes it."""
        self._claim = claim
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
        self._tier_evict: list[tuple[int, str]] = []

    async def close(self) -> None:
        await self._channel.close()
        if self._claim is not None:
            self._claim.close()

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
        if not self.incarnation and self._claim is not None:
            # A restart of this worker: the incarnation its last run recorded takes the pool
            # back while the dead run's heartbeats have not lapsed yet.
            self.incarnation = self._claim.incarnation()
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
                    bytes_per_block=reg.bytes_per_block,
                ),
                tiers=[pb.TierSpec(medium=_MEDIA[m], capacity_blocks=c) for m, c in reg.tiers],
            ),
        )
        if resp.wire_revision < WIRE_REVISION:
            raise Incompatible(
                f"the cache service at {self.address} speaks wire revision "
                f"{resp.wire_revision or 1}; this worker needs {WIRE_REVISION}: upgrade the "
                "cache service first"
            )
        self.pool_id = reg.pool_id
        self.incarnation = resp.incarnation
        if self._claim is not None:
            self._claim.record(resp.incarnation)
        self.lease_ttl_s = resp.lease_ttl_s
        ttl_share = resp.lease_ttl_s * HEARTBEAT_TTL_FRACTION
        announced = (i for i in (resp.heartbeat_interval_s, ttl_share) if i > 0)
        self.heartbeat_interval_s = min(announced, default=1.0)
        self.max_namespace_chars = resp.max_namespace_chars or DEFAULT_MAX_NAMESPACE_CHARS
        return resp.incarnation

    async def heartbeat(self) -> list[int]:
        """Renews liveness; returns lease ids that expired since the last report."""
        resp = await self._call(self._stub.Heartbeat, pb.HeartbeatRequest(pool=self._ref))
        if resp.tier_evict:
            self._tier_evict += [(b.key, _MEDIUM_OF[b.medium]) for b in resp.tier_evict]
        return list(resp.expired_lease_ids)

    async def update_tiers(
        self, stored: Sequence[TierEntry], dropped: Sequence[tuple[int, str]]
    ) -> list[tuple[int, str]]:
        resp = await self._call(
            self._stub.UpdateTiers,
            pb.UpdateTiersRequest(
                pool=self._ref,
                stored=[
                    pb.TierBlock(
                        key=e.key,
                        parent_key=e.parent_key,
                        namespace=e.namespace,
                        medium=_MEDIA[e.medium],
                    )
                    for e in stored
                ],
                dropped=[pb.TierBlock(key=k, medium=_MEDIA[m]) for k, m in dropped],
            ),
        )
        return [(b.key, _MEDIUM_OF[b.medium]) for b in resp.evict]

    def take_tier_evictions(self) -> list[tuple[int, str]]:
        out, self._tier_evict = self._tier_evict, []
        return out

    async def acquire(
        self, asks: Sequence[LeaseAsk]
    ) -> tuple[list[Lease | Deferred | LeaseError], list[int]]:
        """One AcquireLeases for ``asks``, tried in order: per ask a Lease, a Deferred or the
        error it met (NoRoom for the first that did not fit and every ask after it), and the
        pool's leases that expired since it last heard. A failure of the whole call raises."""
        incarnation = self.incarnation
        resp = await self._call(
            self._stub.AcquireLeases,
            pb.AcquireLeasesRequest(
                pool=self._ref,
                items=[
                    pb.AcquireItem(
                        namespace=a.namespace,
                        prompt_tokens=pack(a.tokens),
                        reserve_tokens=a.reserve,
                        allow_defer=not a.skip_cache,
                        skip_cache=a.skip_cache,
                    )
                    for a in asks
                ],
            ),
        )
        out: list[Lease | Deferred | LeaseError] = []
        for r in resp.results:
            kind = r.WhichOneof("result")
            if kind == "lease":
                lease = r.lease
                cow = tuple((c.src_block, c.dst_block) for c in lease.copy_on_write)
                out.append(
                    Lease(
                        lease.lease_id,
                        tuple(lease.block_table),
                        lease.cached_tokens,
                        cow,
                        lease.tier_blocks,
                    )
                )
            elif kind == "deferred":
                d = r.deferred
                out.append(Deferred(d.waiting_on_lease_id, d.cached_tokens, d.pending_tokens))
            else:
                out.append(_item_error(r.error, incarnation))
        if len(out) != len(asks):
            raise CacheUnavailable(f"AcquireLeases answered {len(out)} of {len(asks)} items")
        return out, list(resp.expired_lease_ids)

    async def extend(self, items: Sequence[tuple[int, int]]) -> dict[int, list[int]]:
        resp = await self._call(
            self._stub.ExtendLeases,
            pb.ExtendLeasesRequest(
                pool=self._ref,
                items=[pb.ExtendItem(lease_id=i, num_tokens=n) for i, n in items],
            ),
        )
        return {e.lease_id: list(e.new_blocks) for e in resp.leases}

    async def commit(self, items: Sequence[tuple[int, Written]]) -> None:
        await self._call(
            self._stub.CommitLeases,
            pb.CommitLeasesRequest(
                pool=self._ref,
                items=[pb.CommitItem(lease_id=i, update=_update(w)) for i, w in items],
            ),
        )

    async def release(self, items: Sequence[tuple[int, Written | None]]) -> list[LeaseError | None]:
        """One ReleaseLeases: per item None (released) or the error it met; an item whose
        update was refused (Rejected) keeps its lease (release it again with None)."""
        incarnation = self.incarnation
        resp = await self._call(
            self._stub.ReleaseLeases,
            pb.ReleaseLeasesRequest(
                pool=self._ref,
                items=[
                    pb.ReleaseItem(lease_id=i, update=_update(w) if w is not None else None)
                    for i, w in items
                ],
            ),
        )
        if len(resp.results) != len(items):
            raise CacheUnavailable(f"ReleaseLeases answered {len(resp.results)} of {len(items)}")
        return [
            _item_error(r.error, incarnation) if r.HasField("error") else None for r in resp.results
        ]


def _update(w: Written) -> pb.SequenceUpdate:
    return pb.SequenceUpdate(
        written_tokens=w.count, appended_from=w.tail_from, appended_tokens=pack(w.tail)
    )


def _item_error(err: pb.ItemError, incarnation: int) -> LeaseError:
    """One item's error of a batched call (its code as a number), typed as a call's would be."""
    code = status_code(err.code)
    if code is None:
        return CacheUnavailable(f"unknown status {err.code}: {err.message}")
    return _lease_error(code, err.message, incarnation)
