"""HTTP pass-through of the cache service's admin RPCs under /admin/cache/.

The caller's own ``Authorization: Bearer <admin token>`` is forwarded as is: the cache
service is the one place that checks it, and the gateway holds no admin power of its own
to leak. Prefixes can be given as token ids, or as text (``prompt``) or chat ``messages``
that the gateway tokenizes exactly as its OpenAI endpoints do, so an operator can pin a
system prompt without computing its token ids.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from fastapi import APIRouter, Query, Request
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message
from pydantic import BaseModel, ConfigDict, Field

from gateway.chat import conversation_chars, template_messages
from gateway.core import Gateway
from gateway.errors import InvalidRequest
from gateway.protocol import ChatMessage, TokenId, parse_json
from kvserve_model.sampling_limits import UINT32_MAX
from kvserve_proto.kvcache.v1 import kvcache_pb2 as pb


class PrefixBody(BaseModel):
    """A pool and a prefix: ``token_ids``, or ``prompt`` text, or chat ``messages``."""

    model_config = ConfigDict(strict=True, extra="forbid")

    pool: str = ""
    namespace: str = ""
    token_ids: list[TokenId] | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)


class EvictBody(PrefixBody):
    """Exactly one target: ``blocks`` (LRU), a prefix, or a whole ``namespace``. ``blocks``
    goes into a uint32 (``EvictRequest.num_blocks``): past it protobuf raises ValueError when
    the message is built, a 500; bounded here, it is a 400 naming the field and its range."""

    blocks: int | None = Field(None, ge=1, le=UINT32_MAX)


class FlushBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    pool: str = ""
    # A tier to clear instead of the pool's unreferenced blocks (docs/kv-tiers.md).
    tier: Literal["", "host", "disk"] = ""


B = TypeVar("B", PrefixBody, EvictBody, FlushBody)


def admin_router(gw: Gateway) -> APIRouter:
    router = APIRouter(prefix="/admin/cache", tags=["admin"])
    _add_inspect_routes(router, gw)
    _add_maintenance_routes(router, gw)
    return router


async def _call(gw: Gateway, request: Request, method: str, message: Message) -> dict[str, Any]:
    """The admin RPC ``method``, with the caller's own authorization, its answer as JSON."""
    auth = request.headers.get("authorization", "")
    resp = await gw.cache.call_admin(method, message, auth)
    return MessageToDict(
        resp, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )


async def _body(request: Request, model: type[B]) -> B:
    return parse_json(await request.body() or b"{}", model)


async def _tokens(gw: Gateway, b: PrefixBody, required: bool = True) -> list[int]:
    """The body's prefix as token ids (tokenized as the OpenAI endpoints do: the same length
    limit, long prompts off the event loop); [] if none was given and none is ``required``."""
    given = [x is not None for x in (b.token_ids, b.prompt, b.messages)]
    if sum(given) > 1 or (required and not any(given)):
        raise InvalidRequest("give exactly one of token_ids, prompt or messages")
    if b.token_ids is not None:
        ids = list(b.token_ids)
    elif b.prompt is not None:
        gw.serving.limits.check_prompt_chars(len(b.prompt))
        ids = await gw.tokenizer.encode_async(b.prompt)
    elif b.messages is not None:
        messages = template_messages(b.messages)
        chars = conversation_chars(messages)
        gw.serving.limits.check_prompt_chars(chars, param="messages")
        ids = await gw.tokenizer.apply_chat_template_async(
            messages, chars, add_generation_prompt=False
        )
    else:
        return []
    if not ids:
        raise InvalidRequest("the prefix is empty")
    return ids


def _pool_of(b: PrefixBody | FlushBody) -> str:
    if not b.pool:
        raise InvalidRequest("pool is required (a worker id; see /admin/cache/stats)")
    return b.pool


def _evict_request(b: EvictBody, pool: str, ids: list[int]) -> pb.EvictRequest:
    """Exactly one of the body's targets: blocks, a prefix (``ids``), or a namespace."""
    if b.blocks is not None:
        if ids:
            raise InvalidRequest("give blocks or a prefix, not both")
        return pb.EvictRequest(pool_id=pool, num_blocks=b.blocks)
    if ids:
        prefix = pb.PrefixRef(namespace=b.namespace, token_ids=ids)
        return pb.EvictRequest(pool_id=pool, prefix=prefix)
    if "namespace" in b.model_fields_set:
        return pb.EvictRequest(pool_id=pool, namespace=b.namespace)
    raise InvalidRequest("evict needs blocks, a prefix, or a namespace")


def _add_inspect_routes(router: APIRouter, gw: Gateway) -> None:
    """What the cache holds: stats, a pool's tree, a dry-run lookup."""

    @router.get("/stats")
    async def stats(request: Request, pool: str = "") -> dict[str, Any]:
        """Per pool: blocks free / cached / referenced / pinned, hit rates, leases."""
        return await _call(gw, request, "GetStats", pb.StatsRequest(pool_id=pool))

    @router.get("/tree")
    async def tree(
        request: Request,
        pool: str,
        namespace: str = "",
        max_depth: int = Query(0, ge=0, le=UINT32_MAX, description="0: the whole tree"),
    ) -> dict[str, Any]:
        """One pool's radix index: nodes with token counts, blocks, refcounts, last use."""
        req = pb.InspectTreeRequest(pool_id=pool, namespace=namespace, max_depth=max_depth)
        return await _call(gw, request, "InspectTree", req)

    @router.post("/lookup")
    async def lookup(request: Request) -> dict[str, Any]:
        """Dry-run match of a prompt on every pool (or one): cached tokens, blocks needed."""
        b = await _body(request, PrefixBody)
        ids = await _tokens(gw, b)
        req = pb.LookupRequest(pool_id=b.pool, namespace=b.namespace, prompt_token_ids=ids)
        return {**await _call(gw, request, "Lookup", req), "prompt_tokens": len(ids)}


def _add_maintenance_routes(router: APIRouter, gw: Gateway) -> None:
    """What an operator changes: evict, flush, pin, unpin; and the integrity check."""

    @router.post("/evict")
    async def evict(request: Request) -> dict[str, Any]:
        """Evict ``blocks`` LRU blocks, a prefix, or every block of a ``namespace``."""
        b = await _body(request, EvictBody)
        pool = _pool_of(b)
        req = _evict_request(b, pool, await _tokens(gw, b, required=False))
        return await _call(gw, request, "Evict", req)

    @router.post("/flush")
    async def flush(request: Request) -> dict[str, Any]:
        """Evict every unreferenced, unpinned block (of one pool, or all): safe under load."""
        b = await _body(request, FlushBody)
        medium = {"": pb.MEDIUM_UNSPECIFIED, "host": pb.MEDIUM_HOST, "disk": pb.MEDIUM_DISK}
        flush = pb.FlushRequest(pool_id=b.pool, medium=medium[b.tier])
        return await _call(gw, request, "Flush", flush)

    async def pin_call(request: Request, method: str) -> dict[str, Any]:
        b = await _body(request, PrefixBody)
        prefix = pb.PrefixRef(namespace=b.namespace, token_ids=await _tokens(gw, b))
        return await _call(gw, request, method, pb.PinRequest(pool_id=_pool_of(b), prefix=prefix))

    @router.post("/pin")
    async def pin(request: Request) -> dict[str, Any]:
        """Protect a cached prefix from eviction (flush and LRU alike)."""
        return await pin_call(request, "Pin")

    @router.post("/unpin")
    async def unpin(request: Request) -> dict[str, Any]:
        return await pin_call(request, "Unpin")

    @router.get("/check")
    async def check(request: Request) -> dict[str, Any]:
        """Verify the block accounting invariants of every pool."""
        return await _call(gw, request, "CheckIntegrity", pb.CheckIntegrityRequest())
