"""gRPC servicer of KVCacheAdmin, for operators (``kvserve-admin``, the gateway's /admin/cache
pass-through): stats, the tree, lookups, evictions, pins and the integrity check.

Thin, as the data plane's (servicer.py): every call needs the admin token, then asks the
CacheAuthority and converts the answer.
"""

from __future__ import annotations

import asyncio
import functools
import logging

import grpc

from kvcache_service import convert
from kvcache_service.authority import CacheAuthority, as_tokens
from kvcache_service.errors import InvalidArgument
from kvcache_service.ids import Namespace
from kvcache_service.servicer import Handler, Req, Resp, bearer_problem, domain_errors
from kvserve_proto.kvcache.v1 import kvcache_pb2 as pb
from kvserve_proto.kvcache.v1 import kvcache_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


def admin_only(fn: Handler[Req, Resp]) -> Handler[Req, Resp]:
    """Requires `authorization: Bearer <admin token>`; then maps domain errors."""
    inner = domain_errors(fn)

    @functools.wraps(fn)
    async def wrapper(self: AdminServicer, request: Req, context: grpc.aio.ServicerContext) -> Resp:
        if problem := bearer_problem(context, self.token, "admin"):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, problem)
        return await inner(self, request, context)

    return wrapper


class AdminServicer(pb_grpc.KVCacheAdminServicer):
    """proto3 has no absent field: where a pool id, a namespace or a depth filters, empty (0)
    asks for every one, None to the domain."""

    def __init__(self, authority: CacheAuthority, token: str) -> None:
        if not token:
            raise ValueError("the admin service needs a token")
        self.auth = authority
        self.token = token
        self._checking = asyncio.Lock()

    @admin_only
    async def GetStats(self, request, context):
        pools = self.auth.select(request.pool_id or None)
        return pb.StatsResponse(
            pools=[convert.pool_stats(p, self.auth.is_alive(p.spec.pool_id)) for p in pools]
        )

    @admin_only
    async def InspectTree(self, request, context):
        pool = self.auth.get_pool(request.pool_id)
        ns = self.auth.namespace(request.namespace) if request.namespace else None
        return convert.tree(pool, ns, request.max_depth or None)

    @admin_only
    async def Lookup(self, request, context):
        found = self.auth.lookup(
            request.pool_id or None, Namespace(request.namespace), request.prompt_token_ids
        )
        return pb.LookupResponse(pools=[convert.pool_lookup(p, lk) for p, lk in found])

    @admin_only
    async def Evict(self, request, context):
        pool = self.auth.get_pool(request.pool_id)
        target = request.WhichOneof("target")
        if target == "num_blocks":
            n = pool.admin.evict_lru(request.num_blocks)
        elif target == "namespace":
            n = pool.admin.evict_namespace(self.auth.namespace(request.namespace))
        elif target == "prefix":
            tokens = as_tokens(request.prefix.token_ids, "prefix")
            n = pool.admin.evict_prefix(self.auth.namespace(request.prefix.namespace), tokens)
        else:
            raise InvalidArgument("evict needs num_blocks, namespace or prefix")
        log.info("admin evicted %d blocks from pool %r (%s)", n, request.pool_id, target)
        return pb.EvictResponse(evicted_blocks=n)

    @admin_only
    async def Flush(self, request, context):
        medium = convert.flush_medium(request.medium)
        n = self.auth.flush(request.pool_id or None, medium)
        where = f"{medium.name} tier " if medium is not None else ""
        log.info("admin flushed %d %sblocks", n, where)
        return pb.EvictResponse(evicted_blocks=n)

    @admin_only
    async def Pin(self, request, context):
        pool = self.auth.get_pool(request.pool_id)
        tokens = as_tokens(request.prefix.token_ids, "prefix")
        return pb.PinResponse(
            blocks=pool.admin.pin(self.auth.namespace(request.prefix.namespace), tokens)
        )

    @admin_only
    async def Unpin(self, request, context):
        pool = self.auth.get_pool(request.pool_id)
        tokens = as_tokens(request.prefix.token_ids, "prefix")
        return pb.PinResponse(
            blocks=pool.admin.unpin(self.auth.namespace(request.prefix.namespace), tokens)
        )

    @admin_only
    async def CheckIntegrity(self, request, context):
        # One pool at a time: its snapshot is taken on the loop (consistent, a few ms), the
        # O(num_blocks) pass over it (0.6 s per 1M blocks, measured) runs in slices with the
        # loop's other work between them, so Heartbeats and leases are served meanwhile (why
        # not a thread: kvcache_service/integrity.py). One check at a time: each holds copies.
        problems: list[str] = []
        pools = list(self.auth.pools.values())
        async with self._checking:
            for pool in pools:
                steps = pool.integrity_snapshot().steps()
                while True:
                    try:
                        next(steps)
                    except StopIteration as done:
                        problems += done.value
                        break
                    await asyncio.sleep(0)
        if problems:
            log.error("integrity check failed: %s", problems[:10])
        return pb.CheckIntegrityResponse(
            ok=not problems, problems=problems[:1000], pools_checked=len(pools)
        )
