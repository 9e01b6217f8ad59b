"""Proto <-> domain conversions, each written once. Only this module, the servicers and the
clients import the generated code.

Over 300 lines on purpose: a flat list of small functions, one per message, in the order of
kvcache.proto (registration, leases, routing, admin, events); one file is where a reader looks
up how any message maps, and where the wire's rules (the compact tokens, ids, limits) are
applied alike.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import grpc

from kvcache_service.authority import MAX_TIER_ITEMS, PoolRoute, Registration
from kvcache_service.errors import (
    CacheError,
    FellBehind,
    InvalidArgument,
    MustRegister,
    NeverFits,
    NotFound,
    OutOfBlocks,
    RegistrationLimit,
    TooManyWatchers,
    UnknownLease,
)
from kvcache_service.event_types import (
    Batch,
    Cleared,
    ClearReason,
    Cursor,
    Event,
    Removed,
    ResetReason,
    Stored,
    TierRemoved,
    TierStored,
)
from kvcache_service.ids import Namespace, PoolId, Tokens
from kvcache_service.leases import AcquireRequest, Deferral, Grant, Reuse, SequenceUpdate
from kvcache_service.names import MAX_NAME_CHARS, check_id, check_name
from kvcache_service.pool import PoolSpec, PoolState
from kvcache_service.pool_admin import Lookup
from kvcache_service.tier_index import TIER_MEDIA, Medium, TierBlock
from kvcache_service.tokens import from_wire, pack, to_wire
from kvserve_proto.kvcache.v1 import kvcache_pb2 as pb

# What each code means to the caller, so a client acts on the code and never parses details:
# FAILED_PRECONDITION is "register (again)": the pool is unknown (this service restarted) or
# the call's incarnation is fenced off; every lease of the caller is void either way.
STATUS_OF: dict[type[CacheError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,  # a bug or bad input: do not retry
    UnknownLease: grpc.StatusCode.NOT_FOUND,  # the lease expired or was released
    NotFound: grpc.StatusCode.NOT_FOUND,  # an admin target (pool, prefix) is not there
    MustRegister: grpc.StatusCode.FAILED_PRECONDITION,  # unregistered pool, fenced incarnation
    OutOfBlocks: grpc.StatusCode.RESOURCE_EXHAUSTED,  # queue and retry
    NeverFits: grpc.StatusCode.OUT_OF_RANGE,  # larger than the pool can ever give: refuse
    RegistrationLimit: grpc.StatusCode.RESOURCE_EXHAUSTED,  # too many blocks or pools
    TooManyWatchers: grpc.StatusCode.RESOURCE_EXHAUSTED,  # WatchEvents: retry later
    FellBehind: grpc.StatusCode.RESOURCE_EXHAUSTED,  # WatchEvents: resume from the cursor
}


def status_of(err: CacheError) -> grpc.StatusCode:
    for cls in type(err).__mro__:
        if cls in STATUS_OF:
            return STATUS_OF[cls]
    return grpc.StatusCode.INTERNAL


# The contract revision this service speaks (RegisterPoolResponse.wire_revision): 2 adds packed
# token ids, sequence updates that carry only new tokens, AcquireLeases and ReleaseLeases.
WIRE_REVISION = 2


MEDIA: dict[int, Medium] = {
    pb.MEDIUM_DEVICE: Medium.DEVICE,
    pb.MEDIUM_HOST: Medium.HOST,
    pb.MEDIUM_DISK: Medium.DISK,
}
WIRE_MEDIA: dict[Medium, pb.Medium] = {
    Medium.DEVICE: pb.MEDIUM_DEVICE,
    Medium.HOST: pb.MEDIUM_HOST,
    Medium.DISK: pb.MEDIUM_DISK,
}


def medium(value: int, what: str) -> Medium:
    """A Medium off the wire; UNSPECIFIED or a number this service does not know is refused
    (proto3 enums are open: any int32 arrives)."""
    m = MEDIA.get(value)
    if m is None:
        raise InvalidArgument(f"{what}: medium {value} is none of DEVICE, HOST, DISK")
    return m


def pool_spec(req: pb.RegisterPoolRequest) -> PoolSpec:
    """The pool a worker registers; its names checked (names.py) before anything stores them."""
    if len(req.tiers) > len(TIER_MEDIA):
        raise InvalidArgument(f"at most {len(TIER_MEDIA)} tiers: one on HOST, one on DISK")
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
        bytes_per_block=req.layout.bytes_per_block,
        tiers=tuple((medium(t.medium, "tiers"), t.capacity_blocks) for t in req.tiers),
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
        wire_revision=WIRE_REVISION,
    )


def tier_update(req: pb.UpdateTiersRequest) -> tuple[list[TierBlock], list[tuple[int, Medium]]]:
    """An UpdateTiers call's stored blocks and dropped (key, medium); a medium that is no tier
    (UNSPECIFIED, DEVICE, unknown) is refused. Bounded before anything is read (as the
    authority bounds it): a call with a million blocks costs one len()."""
    if len(req.stored) + len(req.dropped) > MAX_TIER_ITEMS:
        raise InvalidArgument(f"UpdateTiers reports at most {MAX_TIER_ITEMS} blocks a call")
    stored = [
        TierBlock(b.key, b.parent_key, Namespace(b.namespace), _tier_medium(b.medium, "stored"))
        for b in req.stored
    ]
    dropped = [(b.key, _tier_medium(b.medium, "dropped")) for b in req.dropped]
    return stored, dropped


def _tier_medium(value: int, what: str) -> Medium:
    m = medium(value, what)
    if m not in TIER_MEDIA:
        raise InvalidArgument(f"{what}: a tier block is on HOST or DISK, not {m.name}")
    return m


def tier_evict(evicted: list[tuple[int, Medium]]) -> list[pb.TierBlock]:
    """Blocks the service dropped from a tier, as the worker is told them: key and medium."""
    return [pb.TierBlock(key=k, medium=WIRE_MEDIA[m]) for k, m in evicted]


def flush_medium(value: int) -> Medium | None:
    """A FlushRequest's medium: None (UNSPECIFIED, DEVICE) flushes the pool itself."""
    m = medium(value, "flush") if value else Medium.DEVICE
    return None if m is Medium.DEVICE else m


def tokens(readable: Sequence[int], compact: bytes, what: str, allow_empty: bool = False) -> Tokens:
    """Token ids in either wire form (kvcache.proto: ``repeated int32`` or packed ``bytes``),
    checked and packed for the domain; giving both is refused."""
    if compact:
        if len(readable):
            raise InvalidArgument(f"{what}: give token ids or packed tokens, not both")
        return from_wire(compact, what, allow_empty)
    return pack(readable, what, allow_empty)


def _reuse(skip_cache: bool, allow_defer: bool) -> Reuse:
    if skip_cache:
        return Reuse.NONE
    return Reuse.SHARE_OR_DEFER if allow_defer else Reuse.SHARE


def acquire_request(
    req: pb.AcquireLeaseRequest | pb.AcquireItem, pool: pb.PoolRef | None = None
) -> AcquireRequest:
    """An AcquireLease call, or one item of an AcquireLeases batch (``pool``: the batch's);
    both carry the same fields."""
    ref = pool if pool is not None else req.pool
    return AcquireRequest(
        pool_id=PoolId(ref.pool_id),
        incarnation=ref.incarnation,
        namespace=Namespace(req.namespace),
        prompt=tokens(req.prompt_token_ids, req.prompt_tokens, "prompt"),
        reserve_tokens=req.reserve_tokens,
        reuse=_reuse(req.skip_cache, req.allow_defer),
    )


def acquire_items(req: pb.AcquireLeasesRequest) -> list[AcquireRequest | CacheError]:
    """Each item of a batch as an AcquireRequest, or the error its tokens met (that item
    fails alone)."""
    out: list[AcquireRequest | CacheError] = []
    for item in req.items:
        try:
            out.append(acquire_request(item, req.pool))
        except InvalidArgument as err:
            out.append(err)
    return out


def sequence_update(
    token_ids: Sequence[int], update: pb.SequenceUpdate | None
) -> SequenceUpdate | None:
    """A commit's or release's tokens in either form: the whole sequence (readable; empty is
    None, nothing to commit) or a SequenceUpdate (compact). Giving both is refused."""
    if update is not None:
        if len(token_ids):
            raise InvalidArgument("give token_ids or update, not both")
        appended = from_wire(update.appended_tokens, "appended_tokens", allow_empty=True)
        return SequenceUpdate(update.written_tokens, appended, update.appended_from)
    if not len(token_ids):
        return None
    return SequenceUpdate.whole(pack(token_ids, "token_ids"))


def commit_items(req: pb.CommitLeasesRequest) -> list[tuple[int, SequenceUpdate]]:
    out = []
    for item in req.items:
        update = sequence_update(item.token_ids, item.update if item.HasField("update") else None)
        out.append((item.lease_id, update or SequenceUpdate(0)))
    return out


def release_items(
    req: pb.ReleaseLeasesRequest,
) -> list[tuple[int, SequenceUpdate | CacheError | None]]:
    out: list[tuple[int, SequenceUpdate | CacheError | None]] = []
    for item in req.items:
        try:
            update = sequence_update((), item.update if item.HasField("update") else None)
        except InvalidArgument as err:
            out.append((item.lease_id, err))
            continue
        out.append((item.lease_id, update))
    return out


def item_error(err: CacheError) -> pb.ItemError:
    return pb.ItemError(code=status_of(err).value[0], message=str(err))


def acquire_results(
    results: list[Grant | Deferral | CacheError], expired: list[int]
) -> pb.AcquireLeasesResponse:
    out = []
    for r in results:
        if isinstance(r, Grant):
            out.append(pb.AcquireResult(lease=lease(r)))
        elif isinstance(r, Deferral):
            out.append(pb.AcquireResult(deferred=deferred(r)))
        else:
            out.append(pb.AcquireResult(error=item_error(r)))
    return pb.AcquireLeasesResponse(results=out, expired_lease_ids=expired)


def release_results(results: list[int | CacheError]) -> pb.ReleaseLeasesResponse:
    return pb.ReleaseLeasesResponse(
        results=[
            pb.ReleaseResult(error=item_error(r))
            if isinstance(r, CacheError)
            else pb.ReleaseResult(indexed_tokens=r)
            for r in results
        ]
    )


def lease(grant: Grant) -> pb.Lease:
    return pb.Lease(
        lease_id=grant.lease_id,
        block_table=grant.block_table,
        cached_tokens=grant.cached_tokens,
        copy_on_write=[pb.CopyOnWrite(src_block=s, dst_block=d) for s, d in grant.copy_on_write],
        expires_at=grant.expires_at,
        tier_blocks=grant.tier_blocks,
    )


def deferred(d: Deferral) -> pb.Deferred:
    return pb.Deferred(
        waiting_on_lease_id=d.waiting_on,
        cached_tokens=d.cached_tokens,
        pending_tokens=d.pending_tokens,
    )


def acquire_response(result: Grant | Deferral, expired: list[int]) -> pb.AcquireLeaseResponse:
    if isinstance(result, Grant):
        return pb.AcquireLeaseResponse(lease=lease(result), expired_lease_ids=expired)
    return pb.AcquireLeaseResponse(deferred=deferred(result), expired_lease_ids=expired)


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
        tier_tokens=r.tier_tokens,
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
        bytes_per_block=spec.bytes_per_block,
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
        tiers=tier_stats(pool),
        tier_hit_tokens=c.tier_hit_tokens,
    )


def tier_stats(pool: PoolState) -> list[pb.TierStats]:
    """The device pool first (its indexed blocks of its capacity; what left it: evictions),
    then each tier, fastest first."""
    out = [
        pb.TierStats(
            medium=pb.MEDIUM_DEVICE,
            blocks=len(pool.index),
            capacity_blocks=pool.spec.num_blocks,
            dropped_blocks=pool.counters.evicted_blocks,
        )
    ]
    tiers = pool.tiers
    for m in tiers.media:
        c = tiers.counters(m)
        out.append(
            pb.TierStats(
                medium=WIRE_MEDIA[m],
                blocks=tiers.count(m),
                capacity_blocks=tiers.capacity(m),
                stored_blocks=c.stored,
                loaded_blocks=c.loaded,
                dropped_blocks=c.dropped,
            )
        )
    return out


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
                num_tokens=node.num_tokens,
                blocks=node.blocks,
                refcounts=[rc[b] for b in node.blocks],
                token_preview=_preview(node.chunks),
                last_used_at=node.last_used,
                pinned=any(pins[b] for b in node.blocks),
            )
        )
    return pb.InspectTreeResponse(nodes=out)


# Tokens of a node's start that InspectTree shows: enough for a line of decoded text.
PREVIEW_TOKENS = 64


def _preview(chunks: Iterable[Sequence[int]]) -> list[int]:
    """The first PREVIEW_TOKENS tokens of a node, reading (decoding) only the blocks needed."""
    out: list[int] = []
    for chunk in chunks:
        out.extend(chunk[: PREVIEW_TOKENS - len(out)])
        if len(out) >= PREVIEW_TOKENS:
            break
    return out


def pool_lookup(pool_id: str, lk: Lookup) -> pb.PoolLookup:
    return pb.PoolLookup(
        pool_id=pool_id,
        cached_tokens=lk.cached_tokens,
        matched_blocks=lk.matched_blocks,
        pending_tokens=lk.pending_tokens,
        blocks_needed=lk.blocks_needed,
        copied_tokens=lk.copied_tokens,
        tier_tokens=lk.tier_tokens,
    )


# -- KV events (WatchEvents) ----------------------------------------------------------------

CLEAR_REASONS = {
    ClearReason.REGISTERED: pb.PoolCleared.REASON_REGISTERED,
    ClearReason.FORGOTTEN: pb.PoolCleared.REASON_FORGOTTEN,
}
RESET_REASONS = {
    ResetReason.NO_CURSOR: pb.EventsReset.REASON_NO_CURSOR,
    ResetReason.OTHER_LOG: pb.EventsReset.REASON_OTHER_LOG,
    ResetReason.TOO_OLD: pb.EventsReset.REASON_TOO_OLD,
    ResetReason.AHEAD: pb.EventsReset.REASON_AHEAD,
}


def watch_cursor(req: pb.WatchEventsRequest) -> Cursor | None:
    """Where the watcher asks to resume; None without a cursor."""
    return Cursor(req.after.log_id, req.after.seq) if req.HasField("after") else None


def _cursor(c: Cursor) -> pb.EventCursor:
    return pb.EventCursor(log_id=c.log_id, seq=c.seq)


def _event(e: Event) -> pb.KVEvent:
    if isinstance(e, Stored):
        stored = pb.BlocksStored(
            namespace=e.namespace, blocks=e.blocks, tokens=to_wire(Tokens(e.tokens))
        )
        if e.parent is not None:
            stored.parent_block = e.parent
        return pb.KVEvent(stored=stored)
    if isinstance(e, Removed):
        return pb.KVEvent(removed=pb.BlocksRemoved(blocks=e.blocks))
    if isinstance(e, TierStored):
        return pb.KVEvent(
            tier_stored=pb.TierBlocksStored(
                medium=WIRE_MEDIA[Medium(e.medium)],
                namespace=e.namespace,
                keys=e.keys,
                parent_keys=e.parents,
            )
        )
    if isinstance(e, TierRemoved):
        medium = WIRE_MEDIA[Medium(e.medium)]
        return pb.KVEvent(tier_removed=pb.TierBlocksRemoved(medium=medium, keys=e.keys))
    assert isinstance(e, Cleared)
    return pb.KVEvent(cleared=pb.PoolCleared(reason=CLEAR_REASONS[e.reason]))


def event_batch(b: Batch, log_id: int) -> pb.WatchEventsResponse:
    return pb.WatchEventsResponse(
        batch=pb.KVEventBatch(
            cursor=pb.EventCursor(log_id=log_id, seq=b.seq),
            pool_id=b.pool.pool_id,
            incarnation=b.pool.incarnation,
            block_size=b.pool.block_size,
            pool_seq=b.pool_seq,
            timestamp=b.timestamp,
            events=[_event(e) for e in b.events],
        )
    )


def events_reset(reason: ResetReason, at: Cursor) -> pb.WatchEventsResponse:
    return pb.WatchEventsResponse(
        reset=pb.EventsReset(reason=RESET_REASONS[reason], cursor=_cursor(at))
    )


def events_synced(at: Cursor) -> pb.WatchEventsResponse:
    return pb.WatchEventsResponse(synced=_cursor(at))
