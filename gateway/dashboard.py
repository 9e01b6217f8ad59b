"""The live cache dashboard: ``GET /dashboard``, a static page that anyone may load, and the
JSON it polls under ``/admin/dashboard/``, every call of which needs the admin token.

The page is plain HTML, CSS and JS shipped in ``gateway/static/`` (no build step, nothing
from a CDN), served under a strict Content-Security-Policy: script, style and fetches only
from this origin, no inline script or style, no framing, no form submission. Text from the
cache (decoded prompts, namespaces, pool ids) is hostile input: the JSON carries it as data,
and the page writes it with ``textContent`` only.

Auth is that of ``/admin/cache/*``: the caller's ``Authorization`` header is forwarded to the
cache service, the one place that checks it, and each endpoint makes its admin call before it
answers anything, so a missing or wrong token is a 401 and nothing else. The page keeps the
token in the tab's sessionStorage and sends it only in that header, never in a URL.

Nothing is kept here between calls: hit rates over time are computed by the page from the
cache service's counters in consecutive polls, so any gateway behind a load balancer can
answer any poll, and a gateway that restarts loses no history.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from importlib import resources
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response

from gateway.core import Gateway
from gateway.errors import NotFound
from gateway.tokenizer import Tokenizer
from gateway.worker_directory import WorkerView
from kvserve_proto.kvcache.v1 import kvcache_pb2 as pb

STATIC = resources.files("gateway") / "static"
ASSETS = {
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
    "favicon.svg": "image/svg+xml",
}

CSP = "; ".join(
    [
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self'",
        "connect-src 'self'",
        "base-uri 'none'",
        # The token form is handled by the script: were it ever submitted, nothing may leave.
        "form-action 'none'",
        "frame-ancestors 'none'",
    ]
)
PAGE_HEADERS = {
    "content-security-policy": CSP,
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}
DATA_HEADERS = {"cache-control": "no-store", "x-content-type-options": "nosniff"}

# Nodes the tree endpoint answers by default and at most. The cache service sends up to 10k
# (parents first); a browser lays out a few thousand rows without trouble.
TREE_NODES = 500
MAX_TREE_NODES = 5000
# Preview tokens decoded on the event loop; more go to a thread (~20 us a node's decode).
OFF_LOOP_TOKENS = 4096


def dashboard_router(gw: Gateway) -> APIRouter:
    router = APIRouter()
    page = (STATIC / "dashboard.html").read_bytes()
    assets = {name: (STATIC / name).read_bytes() for name in ASSETS}

    @router.get("/dashboard", include_in_schema=False)
    async def dashboard() -> Response:
        return Response(page, media_type="text/html; charset=utf-8", headers=PAGE_HEADERS)

    @router.get("/dashboard/{name}", include_in_schema=False)
    async def asset(name: str) -> Response:
        if name not in assets:
            raise NotFound(f"no dashboard file {name!r}")
        return Response(assets[name], media_type=ASSETS[name], headers=PAGE_HEADERS)

    def authorization(request: Request) -> str:
        return request.headers.get("authorization", "")

    @router.get("/admin/dashboard/stats", tags=["admin"])
    async def stats(request: Request) -> JSONResponse:
        """Every pool's ``GetStats`` counters as numbers, with this gateway's view of its
        worker (health, requests in flight here, running and waiting at the last poll)."""
        resp = await gw.cache.call_admin("GetStats", pb.StatsRequest(), authorization(request))
        assert isinstance(resp, pb.StatsResponse)
        views = {v.pool_id: v for v in gw.directory.views()}
        pools = [pool_row(p, views.get(p.pool_id)) for p in resp.pools]
        body = {
            "now": time.time(),
            "model": gw.config.model_name,
            "cache_service": gw.cache.address,
            "pools": sorted(pools, key=lambda p: p["pool_id"]),
        }
        return JSONResponse(body, headers=DATA_HEADERS)

    @router.get("/admin/dashboard/tree", tags=["admin"])
    async def tree(
        request: Request,
        pool: str,
        namespace: str = "",
        max_nodes: int = Query(TREE_NODES, ge=1, le=MAX_TREE_NODES),
    ) -> JSONResponse:
        """One pool's radix index, parents first, each node's first tokens decoded to text
        with the gateway's tokenizer (``text``; ``ids`` are the same tokens)."""
        req = pb.InspectTreeRequest(pool_id=pool, namespace=namespace)
        resp = await gw.cache.call_admin("InspectTree", req, authorization(request))
        assert isinstance(resp, pb.InspectTreeResponse)
        nodes = list(resp.nodes[:max_nodes])
        texts = await decode_previews(gw.tokenizer, [list(n.token_preview) for n in nodes])
        now = time.time()
        body = {
            "pool": pool,
            "tokenizer": gw.config.model,
            "nodes": [tree_node(n, text, now) for n, text in zip(nodes, texts, strict=True)],
            "total_nodes": len(resp.nodes),
            "truncated": resp.truncated or len(resp.nodes) > len(nodes),
        }
        return JSONResponse(body, headers=DATA_HEADERS)

    return router


def pool_row(p: pb.PoolStats, view: WorkerView | None) -> dict[str, Any]:
    """``PoolStats`` with its numbers as JSON numbers (protobuf's JSON writes uint64 as
    strings), and the worker as this gateway sees it (None: not one of this gateway's model's
    workers, or not discovered yet)."""
    row: dict[str, Any] = {
        f.name: getattr(p, f.name) for f in p.DESCRIPTOR.fields if f.name != "tiers"
    }
    # The device pool first, then the worker's tiers (docs/kv-tiers.md).
    row["tiers"] = [
        {
            "medium": pb.Medium.Name(t.medium).removeprefix("MEDIUM_").lower(),
            "blocks": t.blocks,
            "capacity_blocks": t.capacity_blocks,
            "stored_blocks": t.stored_blocks,
            "loaded_blocks": t.loaded_blocks,
            "dropped_blocks": t.dropped_blocks,
        }
        for t in p.tiers
    ]
    worker = None
    if view is not None:
        load = view.load if view.healthy else None  # an unreachable worker's poll is stale
        worker = {
            "address": view.address,
            "healthy": view.healthy,
            "reason": view.unhealthy_reason,
            "in_flight": view.in_flight,
            "running": load.running if load else None,
            "waiting": load.waiting if load else None,
            "max_pending": load.max_pending if load else None,
            "preemptions": load.preemptions if load else None,
            "requests_finished": load.requests_finished if load else None,
            "runner": load.runner if load else None,
        }
    return {**row, "worker": worker}


def tree_node(n: pb.TreeNode, text: str | None, now: float) -> dict[str, Any]:
    return {
        "id": n.node_id,
        "parent": n.parent_id,
        "namespace": n.namespace,
        "depth": n.depth,
        "tokens": n.num_tokens,
        "blocks": len(n.blocks),
        # Blocks of the node that running requests hold, and by how many at most.
        "referenced": sum(1 for r in n.refcounts if r),
        "max_refcount": max(n.refcounts, default=0),
        "pinned": n.pinned,
        "idle_s": max(0.0, now - n.last_used_at) if n.last_used_at else None,
        "ids": list(n.token_preview),
        "text": text,
        # The preview is the node's first tokens; the rest are not shown.
        "preview_complete": len(n.token_preview) >= n.num_tokens,
    }


async def decode_previews(tok: Tokenizer, previews: Sequence[list[int]]) -> list[str | None]:
    """Each preview as text; None where the ids do not decode (ids of another model)."""

    def decode_all() -> list[str | None]:
        out: list[str | None] = []
        for ids in previews:
            try:
                out.append(tok.decode(ids))
            except Exception:  # a tokenizer raises what it likes on ids outside its vocab
                out.append(None)
        return out

    if sum(map(len, previews)) < OFF_LOOP_TOKENS:
        return decode_all()
    return await asyncio.to_thread(decode_all)
