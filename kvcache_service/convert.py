"""Proto <-> domain conversions, each written once. Only this module, the servicer and the
clients import the generated code."""

from __future__ import annotations

from kvcache_service.authority import PoolRoute, Registration
from kvcache_service.ids import Namespace, PoolId
from kvcache_service.leases import AcquireRequest, Deferral, Grant, Reuse
from kvcache_service.names import MAX_NAME_CHARS, check_id, check_name
from kvcache_service.pool import PoolSpec, PoolState
from kvcache_service.pool_admin import Lookup
from kvserve_proto.kvcache.v1 import kvcache_pb2 as pb


def pool_spec(req: pb.RegisterPoolRequest) -> PoolSpec:
    """The pool a worker registers; its names checked (names.py) before anything stores them."""
    return PoolSpec(
        pool_id=PoolId(check_id(req.pool_id, "pool_id")),
        num_blocks=req.num_blocks,
        block_size=req.block_size,
        model_fingerprint=check_id(req.model_fingerprint, "model_fingerprint", MAX_NAME_CHARS),
        model=check_name(req.model, "model"),
        worker_address=check_name(req.worker_address, "worker_address"),
        num_layers=req.layout.num_layers,
        num_kv_heads=req.layout.num_kv_heads,
        head_dim=req.layout.head_dim,
        dtype=req.layout.dtype,
    )


def incarnation(req: pb.RegisterPoolRequest) -> int | None:
    """The incarnation a registrant holds; proto3's 0 (unset) is none."""
    return req.incarnation or None


def registration(reg: Registration) -> pb.RegisterPoolResponse:
    return pb.RegisterPoolResponse(
        incarnation=reg.incarnation,
        lease_ttl_s=reg.lease_ttl_s,
        heartbeat_interval_s=reg.heartbeat_interval_s,
        max_namespace_chars=reg.max_namespace_chars,
    )


def acquire_request(req: pb.AcquireLeaseRequest) -> AcquireRequest:
    if req.skip_cache:
        reuse = Reuse.NONE
    else:
        reuse = Reuse.SHARE_OR_DEFER if req.allow_defer else Reuse.SHARE
    return AcquireRequest(
        pool_id=PoolId(req.pool.pool_id),
        incarnation=req.pool.incarnation,
        namespace=Namespace(req.namespace),
        prompt=tuple(req.prompt_token_ids),
        reserve_tokens=req.reserve_tokens,
        reuse=reuse,
    )


def lease(grant: Grant) -> pb.Lease:
    return pb.Lease(
        lease_id=grant.lease_id,
        block_table=grant.block_table,
        cached_tokens=grant.cached_tokens,
        copy_on_write=[pb.CopyOnWrite(src_block=s, dst_block=d) for s, d in grant.copy_on_write],
        expires_at=grant.expires_at,
    )


def acquire_response(result: Grant | Deferral, expired: list[int]) -> pb.AcquireLeaseResponse:
    if isinstance(result, Grant):
        return pb.AcquireLeaseResponse(lease=lease(result), expired_lease_ids=expired)
    return pb.AcquireLeaseResponse(
        deferred=pb.Deferred(
            waiting_on_lease_id=result.waiting_on,
            cached_tokens=result.cached_tokens,
            pending_tokens=result.pending_tokens,
        ),
        expired_lease_ids=expired,
    )


def pool_route(r: PoolRoute) -> pb.PoolRoute:
    return pb.PoolRoute(
        pool_id=r.pool_id,
        worker_address=r.worker_address,
        model=r.model,
        cached_tokens=r.cached_tokens,
        free_blocks=r.free_blocks,
        evictable_blocks=r.evictable_blocks,
        live_leases=r.live_leases,
        alive=r.alive,
    )


def pool_stats(pool: PoolState, alive: bool) -> pb.PoolStats:
    c = pool.counters
    spec = pool.spec
    return pb.PoolStats(
        pool_id=spec.pool_id,
        incarnation=pool.incarnation,
        worker_address=spec.worker_address,
        model_fingerprint=spec.model_fingerprint,
        block_size=spec.block_size,
        num_blocks=spec.num_blocks,
        free_blocks=pool.blocks.num_free,
        cached_blocks=pool.cached_blocks,
        referenced_blocks=pool.referenced_blocks,
        pinned_blocks=pool.pinned_blocks,
        indexed_blocks=len(pool.index),
        peak_used_blocks=pool.blocks.peak_used,
        live_leases=len(pool.leases),
        acquires=c.acquires,
        acquire_hits=c.acquire_hits,
        deferrals=c.deferrals,
        exhausted=c.exhausted,
        prompt_tokens=c.prompt_tokens,
        cached_tokens=c.cached_tokens,
        evicted_blocks=c.evicted_blocks,
        expired_leases=c.expired_leases,
        alive=alive,
        token_hit_rate=c.cached_tokens / c.prompt_tokens if c.prompt_tokens else 0.0,
        request_hit_rate=c.acquire_hits / c.acquires if c.acquires else 0.0,
    )


# InspectTree answers at most this many nodes (parents first): it runs on the event loop,
# ~5 us a node, so 10k nodes hold the data plane ~50 ms where a 1M-node tree took seconds.
MAX_TREE_NODES = 10_000


def tree(
    pool: PoolState,
    namespace: Namespace | None,
    max_depth: int | None,
    limit: int = MAX_TREE_NODES,
) -> pb.InspectTreeResponse:
    """The index of ``pool`` (one namespace, or all for None) as nodes, parents first, at most
    ``limit`` of them (``truncated`` says the cap cut it short), to ``max_depth`` if given."""
    rc, pins = pool.blocks.refcount, pool.blocks.pins
    out: list[pb.TreeNode] = []
    for ns, node, depth in pool.index.nodes(namespace):
        if max_depth is not None and depth > max_depth:
            continue
        if len(out) >= limit:
            return pb.InspectTreeResponse(nodes=out, truncated=True)
        parent = node.parent
        out.append(
            pb.TreeNode(
                node_id=node.node_id,
                parent_id=parent.node_id if parent is not None and parent.parent is not None else 0,
                namespace=ns,
                depth=depth,
                num_tokens=len(node.blocks) * pool.block_size,
                blocks=node.blocks,
                refcounts=[rc[b] for b in node.blocks],
                token_preview=node.chunks[0][:16],
                last_used_at=node.last_used,
                pinned=any(pins[b] for b in node.blocks),
            )
        )
    return pb.InspectTreeResponse(nodes=out)


def pool_lookup(pool_id: str, lk: Lookup) -> pb.PoolLookup:
    return pb.PoolLookup(
        pool_id=pool_id,
        cached_tokens=lk.cached_tokens,
        matched_blocks=lk.matched_blocks,
        pending_tokens=lk.pending_tokens,
        blocks_needed=lk.blocks_needed,
    )
